"""Range checks of the examples' flags, each refusal naming the flag and its fix."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def check_ranges(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    counts: Iterable[str] = (),
    fractions: Iterable[str] = (),
) -> None:
    """``counts`` must be at least 1, ``fractions`` in (0, 1], and
    ``--lookahead`` (where the example has it) 0 or more."""
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if getattr(args, "lookahead", 0) < 0:
        parser.error(f"--lookahead={args.lookahead} must be 0 (unpipelined) or more, e.g. 2.")
    for name in fractions:
        value = getattr(args, name)
        if not 0 < value <= 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be in (0, 1], e.g. 0.02.")


def refuse_other_options(script: str, flag: str, directory: str, saved: dict, now: dict) -> None:
    """Exits when the checkpoint in ``directory`` was saved under other options.

    Another seed or batch size would read another data stream from the saved
    batch index on, in silence; another model would not restore. Options a
    checkpoint does not record (saved by an older version of ``script``) are
    not compared.

    Args:
      script: the script's file name, which starts the message.
      flag: the flag that names the checkpoint directory, e.g. ``--checkpoint-dir``.
      directory: that directory.
      saved: the options recorded with the checkpoint.
      now: the same options of this run.
    """
    changed = {k: (v, saved[k]) for k, v in now.items() if k in saved and saved[k] != v}
    if changed:
        flags = ", ".join(
            f"--{k.replace('_', '-')} {value} (saved: {was})" for k, (value, was) in changed.items()
        )
        raise SystemExit(
            f"{script}: {directory} holds a run of other options: {flags}; resume with the "
            f"saved ones, or give another {flag}."
        )
