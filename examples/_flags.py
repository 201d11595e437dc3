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
