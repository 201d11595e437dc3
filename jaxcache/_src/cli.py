"""The ``jaxcache`` command line.

``jaxcache replay TRACE.npy --batch B --capacity C --policy P`` replays an id
trace through the planner with no model and prints one JSON object per run;
``--sweep`` gives one per capacity (a miss-ratio curve) and ``--plot`` draws
it. Everything it computes comes from :mod:`jaxcache._src.replay`.
``jaxcache vocabulary TRACE.npy --rows R`` admits a trace of raw ids into a
dynamic vocabulary of ``R`` rows (:mod:`jaxcache._src.vocabulary_replay`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pickle
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from jaxcache._src import replay as replay_lib
from jaxcache._src import tier_replay, validation
from jaxcache._src.config import DEFAULTS, FORGET, POLICIES, DynamicVocabulary
from jaxcache._src.planner import CapacityError
from jaxcache._src.vocabulary import _INT32_MAX
from jaxcache._src.vocabulary_replay import replay_vocabulary

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``jaxcache`` command line.

    Args:
      argv: the arguments after the program name; ``sys.argv[1:]`` when
        ``None``.

    Returns:
      The exit status, ``0``. A bad argument exits with status ``2`` and a
      message on stderr that names it and says what to do.

    Examples:
      >>> import os, tempfile, numpy as np
      >>> from jaxcache._src.cli import main
      >>> path = os.path.join(tempfile.mkdtemp(), "trace.npy")
      >>> np.save(path, np.array([[0, 1], [0, 2], [1, 0], [2, 2], [0, 1]]))
      >>> main(["replay", path, "--capacity", "2", "--policy", "lru"])  # doctest: +ELLIPSIS
      {"policy": "lru", "capacity": 2, ..., "unique_hit_rate": 0.333..., ...}
      0
    """
    parser = argparse.ArgumentParser(
        prog="jaxcache", description="Tools for jaxcache's host-offloaded embedding tables."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    replay_parser = commands.add_parser(
        "replay",
        help="replay an id trace through the planner, with no model, to size a cache",
        description=(
            "Replays an id trace through the cache planner, with no model, and prints one JSON "
            "object per run: hit rates, rows fetched and rows written back. Every batch is "
            "planned as a training step."
        ),
    )
    replay_parser.add_argument(
        "trace",
        help="a .npy array of integer ids: 1-D (split into batches of --batch ids) or 2-D "
        "[steps, ids] (one batch per row)",
    )
    replay_parser.add_argument(
        "--batch",
        type=_positive_int,
        help="ids per batch; required for a 1-D trace, re-splits a 2-D one",
    )
    size = replay_parser.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--capacity",
        type=_capacity,
        help="rows on device: a row count such as 5000 or a fraction of the table such as 0.02",
    )
    size.add_argument(
        "--sweep",
        type=_capacities,
        metavar="C1,C2,...",
        help="several capacities (row counts or fractions), one result each, e.g. "
        "0.005,0.01,0.02,0.05; one below a batch's distinct ids is marked infeasible",
    )
    replay_parser.add_argument(
        "--policy",
        type=_policies,
        default=["adaptive"],
        metavar="P[,P...]",
        help="eviction policy, or a comma list to compare: "
        f"{', '.join(replay_lib.REPLAY_POLICIES)} (default: adaptive); belady is the offline "
        "optimum, a ceiling for the others",
    )
    replay_parser.add_argument(
        "--num-embeddings",
        type=_positive_int,
        help="rows in the table (default: length of --frequencies, else the largest id + 1)",
    )
    replay_parser.add_argument(
        "--frequencies",
        metavar="FILE.npy",
        help="int [num_embeddings] dataset counts that the frequency policy ranks and warms by "
        "(default: counted over the whole trace, for frequency only); given, they are also the "
        "prior of adaptive (warmed by them too) and seed lfu",
    )
    replay_parser.add_argument(
        "--padding-id",
        type=int,
        default=None,
        help="an id that marks padding (of multi-hot bags): it takes no row and is not counted",
    )
    replay_parser.add_argument(
        "--plot", metavar="OUT.png", help="also draw hit rate and miss ratio against capacity"
    )
    replay_parser.add_argument(
        "--dram-budget",
        type=_bytes,
        metavar="BYTES",
        help="also replay the rows moved through the DRAM tier of a jaxcache.TieredTable with "
        "this budget (e.g. 512M or 64G; needs --row-bytes): its hit rate and disk traffic",
    )
    replay_parser.add_argument(
        "--row-bytes",
        type=_positive_int,
        metavar="BYTES",
        help="bytes of one row with its optimizer state, for --dram-budget (D * 4 + 4 for "
        "float32 rows and row-wise Adagrad)",
    )
    vocabulary_parser = commands.add_parser(
        "vocabulary",
        help="admit a trace of raw ids into a dynamic vocabulary, to size its row budget",
        description=(
            "Admits a trace of raw int64 ids into a dynamic vocabulary "
            "(CacheConfig(vocabulary=...)) with no model, and prints one JSON object: ids "
            "given rows, forgotten, refused by admission, and the rows that forget nothing."
        ),
    )
    vocabulary_parser.add_argument("trace", help="a .npy array of raw int64 ids, 1-D or 2-D")
    vocabulary_parser.add_argument("--rows", type=_positive_int, required=True, help="row budget")
    vocabulary_parser.add_argument(
        "--batch", type=_positive_int, help="ids per batch; required for a 1-D trace"
    )
    vocabulary_parser.add_argument(
        "--admit-after", type=_positive_int, default=1, help="lookups before an id gets a row"
    )
    vocabulary_parser.add_argument("--forget", choices=FORGET, default="lru")
    vocabulary_parser.add_argument(
        "--bonus",
        type=int,
        default=None,
        help='steps per doubling of lookups, of --forget "lrfu"',
    )
    vocabulary_parser.add_argument(
        "--ttl", type=_positive_int, help="steps after which an unused id is forgotten"
    )
    vocabulary_parser.add_argument(
        "--ways", type=_positive_int, default=64, help="the most rows of a bucket"
    )
    vocabulary_parser.add_argument(
        "--protect",
        type=_nonnegative_int,
        default=2,
        help="batches before each batch whose rows its new ids may not take (at least the "
        "training pipeline's look-ahead)",
    )
    vocabulary_parser.add_argument(
        "--default",
        choices=DEFAULTS,
        default="zeros",
        help="what an id without a row reads: zeros, or a shared row (the budget's last)",
    )
    vocabulary_parser.add_argument(
        "--padding-id", type=int, default=None, help="a raw id that marks padding, skipped"
    )
    vocabulary_parser.add_argument(
        "--capacity", type=_capacity, help="also plan the rows through a device cache this large"
    )
    vocabulary_parser.add_argument(
        "--policy",
        # "frequency" ranks rows by dataset counts, which raw ids do not have.
        choices=[p for p in POLICIES if p != "frequency"],
        default=None,
        help="the device cache's policy, with --capacity (default adaptive)",
    )
    args = parser.parse_args(argv)
    if args.command == "replay":
        _replay(replay_parser, args)
    else:
        trace = _load(vocabulary_parser, "trace", args.trace)
        with _blame(vocabulary_parser, "--padding-id"):
            validation.check_padding_id(args.padding_id)
        # Flags that would change nothing are refused, not ignored.
        if args.bonus is not None and args.forget != "lrfu":
            vocabulary_parser.error(
                f'argument --bonus: it sets --forget "lrfu", not {args.forget!r}; pass '
                "--forget lrfu with it, or leave it out."
            )
        if args.policy is not None and args.capacity is None:
            vocabulary_parser.error(
                "argument --policy: it is the device cache's, which --capacity adds; pass "
                "--capacity with it, or leave it out."
            )
        with _blame_field(vocabulary_parser):
            vocabulary = DynamicVocabulary(
                admit_after=args.admit_after,
                forget=args.forget,
                **({} if args.bonus is None else {"bonus": args.bonus}),
                ttl=args.ttl,
                ways=args.ways,
                default=args.default,
                protect=args.protect,
            )
        _check_vocabulary_rows(vocabulary_parser, args.rows, args.default)
        _check_vocabulary_capacity(vocabulary_parser, args.capacity, args.rows)
        if args.batch is None and np.ndim(trace) == 1:
            vocabulary_parser.error(
                "argument --batch: a 1-D trace does not say where one step ends; pass --batch, "
                "the ids one step looks up, or save a 2-D trace [steps, ids]."
            )
        try:
            result = replay_vocabulary(
                trace,
                rows=args.rows,
                batch=args.batch,
                vocabulary=vocabulary,
                capacity=args.capacity,
                policy=args.policy or "adaptive",
                padding_id=args.padding_id,
            )
        except CapacityError as error:  # the budget's refusal, or the device cache's
            flag = "--rows" if error.rows_needed is not None else "--capacity"
            vocabulary_parser.error(
                f"argument {flag}: {error} (--rows is the budget, num_embeddings; --capacity "
                "the device cache's rows.)"
            )
        except (TypeError, ValueError) as error:
            vocabulary_parser.error(f"argument trace: {error}")
        print(json.dumps(result), flush=True)
    return 0


def _check_vocabulary_rows(parser: argparse.ArgumentParser, rows: int, default: str) -> None:
    """Refuses a ``--rows`` budget the vocabulary cannot have, naming the flag
    (the library's message would be blamed on the trace)."""
    least = 2 if default == "shared" else 1
    if not least <= rows <= _INT32_MAX:
        why = " (one of them is the shared default row)" if least == 2 else ""
        parser.error(f"argument --rows: {rows} must be in [{least}, 2^31 - 1]{why}.")


def _check_vocabulary_capacity(
    parser: argparse.ArgumentParser, capacity: int | float | None, rows: int
) -> None:
    """Refuses a ``--capacity`` the budget of ``--rows`` cannot fill, in the
    command's words (``CacheConfig`` would name its own arguments)."""
    if capacity is None:
        return
    # As ``CacheConfig`` reads it: a whole number past 1 counts rows, and a
    # fraction rounds up.
    whole = isinstance(capacity, int) or (capacity > 1 and float(capacity).is_integer())
    slots = int(capacity) if whole else max(1, math.ceil(capacity * rows))
    if not 0 < slots <= rows or (not whole and not 0 < capacity <= 1):
        parser.error(
            f"argument --capacity: {capacity} is not a cache of 1 to {rows} rows (the budget "
            "of --rows); give a row count up to --rows or a fraction of it in (0, 1]."
        )


def _replay(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks each argument (blaming the right flag), replays, prints, plots."""
    if args.plot is not None:
        _check_plot(parser, args.plot)
    capacity_flag = "--sweep" if args.sweep is not None else "--capacity"
    capacities = args.sweep if args.sweep is not None else [args.capacity]
    trace = _load(parser, "trace", args.trace)
    frequencies = None
    if args.frequencies is not None:
        frequencies = _load(parser, "--frequencies", args.frequencies)
    with _blame(parser, "--padding-id"):
        validation.check_padding_id(args.padding_id)
    with _blame(parser, "trace"):
        trace = replay_lib._check_trace(trace, args.padding_id)
    with _blame(parser, "--batch"):
        _, ids = replay_lib._read_trace(trace, args.batch, args.padding_id)
    flag = "--frequencies" if args.num_embeddings is None else "--num-embeddings"
    with _blame(parser, flag), _blame_memory(parser, None):
        n = replay_lib._table_size(ids, args.num_embeddings, frequencies)
    with _blame(parser, "--frequencies"):
        replay_lib._check_frequencies(frequencies, n)
    with _blame(parser, "--padding-id"):
        validation.check_padding_outside(args.padding_id, n)
    with _blame(parser, capacity_flag), _blame_memory(parser, n):
        for capacity in capacities:
            replay_lib._resolve_capacity(capacity, n)
        results = replay_lib.sweep(
            trace,
            capacities=capacities,
            policies=args.policy,
            batch=args.batch,
            num_embeddings=args.num_embeddings,
            frequencies=frequencies,
            padding_id=args.padding_id,
        )
        if args.sweep is None and not results[0]["feasible"]:
            raise CapacityError(results[0]["infeasible"])
    if args.dram_budget is not None:
        if args.row_bytes is None:
            parser.error("argument --dram-budget: needs --row-bytes, the bytes of one row.")
        with _blame(parser, "--dram-budget"):
            results = [
                {
                    **result,
                    **tier_replay.replay_dram_tier(
                        trace,
                        capacity=result["capacity"],
                        policy=result["policy"],
                        dram_budget=args.dram_budget,
                        row_bytes=args.row_bytes,
                        batch=args.batch,
                        num_embeddings=n,
                        frequencies=frequencies,
                        padding_id=args.padding_id,
                    ),
                }
                if result["feasible"]
                else result
                for result in results
            ]
    for result in results:
        print(json.dumps(result), flush=True)
    if args.plot is not None:
        with _blame(parser, "--plot", (OSError, ValueError)):
            replay_lib.plot_curve(results, args.plot)


def _check_plot(parser: argparse.ArgumentParser, path: str) -> None:
    """Fails before the replay if ``--plot`` cannot be written."""
    folder = os.path.dirname(path) or "."
    if not os.path.basename(path) or os.path.isdir(path):
        parser.error(
            f"argument --plot: {path!r} is a folder; give a file in it, such as "
            f"{os.path.join(path, 'curve.png')!r}."
        )
    if not os.path.isdir(folder):
        parser.error(f"argument --plot: no such folder {folder!r}; create it or pick another path.")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        parser.error(
            "argument --plot: drawing needs matplotlib; install it with "
            "pip install 'jaxcache[examples]', or leave --plot out."
        )
    kinds = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(path)[1][1:].lower()
    if extension and extension not in kinds:
        parser.error(
            f"argument --plot: matplotlib cannot write {path!r} (.{extension}); end the name "
            f"with one of {', '.join(sorted(kinds))}, such as .png."
        )


@contextlib.contextmanager
def _blame(
    parser: argparse.ArgumentParser,
    flag: str,
    errors: tuple[type[Exception], ...] = (TypeError, ValueError),
) -> Iterator[None]:
    """Turns ``errors`` raised inside into a usage error about ``flag`` (exit 2)."""
    try:
        yield
    except errors as error:
        parser.error(f"argument {flag}: {error}")


@contextlib.contextmanager
def _blame_field(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Turns a ``ValueError`` of a ``DynamicVocabulary`` field into a usage
    error about the flag that sets it (its message starts ``field=``)."""
    try:
        yield
    except ValueError as error:
        field = str(error).split("=", 1)[0]
        flag = f"--{field.replace('_', '-')}" if field.isidentifier() else "the vocabulary's"
        parser.error(f"argument {flag}: {error}")


@contextlib.contextmanager
def _blame_memory(parser: argparse.ArgumentParser, rows: int | None) -> Iterator[None]:
    """Turns a table too large to replay here into a usage error naming its size."""
    try:
        yield
    except MemoryError as error:
        if rows is None:  # the error names the size and the fix
            parser.error(f"argument trace: {error}")
        parser.error(
            f"argument trace: replaying a table of {rows} rows needs more memory than this "
            f"machine has ({error}); its largest id sets the table's size, so give ids "
            "in [0, N) for a smaller N, or use `jaxcache vocabulary` for raw ids."
        )


def _load(parser: argparse.ArgumentParser, flag: str, path: str) -> np.ndarray:
    """The array saved at ``path`` with ``np.save``, or a usage error about ``flag``."""
    if not os.path.isfile(path):
        parser.error(
            f"argument {flag}: no such file {path!r}; pass the path of a .npy array saved "
            "with np.save."
        )
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as error:
        # NumPy takes any file without the .npy magic for a pickle and
        # suggests allow_pickle, which would run code from the file.
        reason = "no .npy header" if "allow_pickle" in str(error) else str(error)
        parser.error(
            f"argument {flag}: cannot read {path!r} as a .npy array ({reason}); save the ids "
            "with np.save(path, ids)."
        )
    if not isinstance(array, np.ndarray):
        array.close()
        parser.error(
            f"argument {flag}: {path!r} is an .npz archive; save one array with "
            "np.save(path, ids) instead."
        )
    return array


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _bytes(text: str) -> int:
    """A byte count: ``"4096"``, or with a binary suffix, ``"512M"``, ``"64G"``, ``"1T"``."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in units else ""
    try:
        value = float(number[: len(number) - len(unit)]) * units[unit]
    except ValueError:
        value = 0
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 512M or 64G, got {text!r}")
    return int(value)


def _capacity(text: str) -> int | float:
    """A row count (``"5000"``) or a fraction of the table (``"0.02"``)."""
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        if math.isfinite(value):
            return value
    raise argparse.ArgumentTypeError(
        f"expected a row count such as 5000 or a fraction of the table such as 0.02, got {text!r}"
    )


def _capacities(text: str) -> list[int | float]:
    return [_capacity(part.strip()) for part in text.split(",")]


def _policies(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",")]
    for name in names:
        if name not in replay_lib.REPLAY_POLICIES:
            raise argparse.ArgumentTypeError(
                f"unknown policy {name!r}; use one of "
                f"{', '.join(replay_lib.REPLAY_POLICIES)}, or a comma list such as lru,belady"
            )
    return names


if __name__ == "__main__":
    sys.exit(main())
