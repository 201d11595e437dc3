"""Vectorized parsing of delimited text files with NumPy.

A file is read in blocks of whole lines; each block is split into fields and
its columns are parsed as integers or hexadecimal ids by array operations
(no Python loop per line), so a block of 100k lines costs a few dozen NumPy
passes. Every malformed line is found with its line number: the caller either
raises a ``DataFormatError`` naming the file, the line and the problem, or
drops the line and counts it.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["Block", "DataFormatError", "read_blocks", "split_block"]

_NEWLINE, _CR, _MINUS, _ZERO = 10, 13, ord("-"), ord("0")
# Longest decimal integer parsed (10**18 - 1 fits in int64) and hexadecimal id
# (16 digits fill a uint64).
_MAX_DIGITS = 18
_MAX_HEX_DIGITS = 16
_HEX_VALUE = np.full(256, 255, np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX_VALUE[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX_VALUE[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
# Problems quoted in full when lines are skipped; the rest are only counted.
MAX_EXAMPLES = 10


class DataFormatError(ValueError):
    """A data file that cannot be parsed: names the file, the line and the problem.

    Attributes:
      path: the file.
      line: 1-based line number, or ``None`` for a problem with the whole file.
      problem: what is wrong, and what to do about it.

    Examples:
      >>> from jaxcache.datasets import DataFormatError
      >>> error = DataFormatError("train.txt", 7, "expected 40 columns, found 39")
      >>> str(error)
      'train.txt, line 7: expected 40 columns, found 39'
      >>> isinstance(error, ValueError), error.line
      (True, 7)
    """

    def __init__(self, path: str | os.PathLike[str], line: int | None, problem: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.problem = problem
        where = self.path if line is None else f"{self.path}, line {line}"
        super().__init__(f"{where}: {problem}")


def read_blocks(
    path: str | os.PathLike[str], block_bytes: int = 1 << 22
) -> Iterator[tuple[int, bytes]]:
    """Whole lines of a text file (gzip when it ends in ``.gz``), block by block.

    Args:
      path: the file.
      block_bytes: bytes read at a time (a block is cut after its last newline).

    Yields:
      ``(first_line, block)``: the 1-based number of the block's first line,
      and the block, which always ends with a newline.
    """
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    first_line = 1
    carry = b""
    with opener(path, "rb") as f:
        while data := f.read(block_bytes):
            data = carry + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than the block: read on
                carry = data
                continue
            block, carry = data[:cut], data[cut:]
            yield first_line, block
            first_line += block.count(b"\n")
    if carry:
        yield first_line, carry + b"\n"


@dataclasses.dataclass
class Block:
    """A block of lines split into ``K`` fields, with its malformed lines tracked.

    Lines with the wrong number of fields are set aside at once; the others
    are rows of ``starts``/``ends``. Parsing a column marks the rows whose
    field is malformed (the first bad column of each row is kept).

    Attributes:
      data: ``uint8`` bytes of the block.
      starts: ``int64 [n, K]`` offset of each field of the well-formed lines.
      ends: ``int64 [n, K]`` offset one past each field.
      lines: ``int64 [n]`` their 1-based line numbers.
      ragged_lines: ``int64`` line numbers with a wrong number of fields.
      ragged_fields: their number of fields.
      bad_column: ``int64 [n]`` first malformed column of each row, ``K`` if none.
      problems: column -> description of what a field of it must be.
    """

    data: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    lines: np.ndarray
    ragged_lines: np.ndarray
    ragged_fields: np.ndarray
    bad_column: np.ndarray
    problems: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def num_columns(self) -> int:
        """``K``, fields of a well-formed line."""
        return self.starts.shape[1]

    def field(self, row: int, column: int) -> str:
        """The text of one field (for messages)."""
        raw = self.data[self.starts[row, column] : self.ends[row, column]].tobytes()
        return raw.decode("utf-8", "replace")

    def mark(self, columns: range, bad: np.ndarray, problems: Sequence[str]) -> None:
        """Marks malformed fields and says what a field of each column must be.

        Args:
          columns: the columns ``c`` checked.
          bad: ``bool [n, c]`` malformed fields.
          problems: one description per column.
        """
        first = np.where(bad.any(axis=1), columns.start + bad.argmax(axis=1), self.num_columns)
        self.bad_column = np.minimum(self.bad_column, first)
        self.problems.update(zip(columns, problems, strict=True))

    def _right_aligned(self, first: np.ndarray, ends: np.ndarray, width: int):
        """``uint8 [..., width]`` last ``width`` characters of each field, and which are inside."""
        pos = ends[..., None] + np.arange(-width, 0)
        inside = pos >= first[..., None]
        return self.data[np.maximum(pos, 0)], inside

    def integers(self, columns: range, names: Sequence[str], *, allow_empty: bool = False):
        """Parses columns of decimal integers (optionally negative).

        Args:
          columns: the ``c`` consecutive columns (0-based).
          names: their names, for messages.
          allow_empty: an empty field is 0 instead of malformed.

        Returns:
          ``int64 [n, c]``; malformed fields hold 0 and their rows are marked.
        """
        cols = slice(columns.start, columns.stop)
        starts, ends = self.starts[:, cols], self.ends[:, cols]
        negative = (ends > starts) & (self.data[np.minimum(starts, self.data.size - 1)] == _MINUS)
        first = starts + negative
        length = ends - first
        bad = (length > _MAX_DIGITS) | (negative & (length == 0))
        if not allow_empty:
            bad |= ends == starts
        width = min(int(length.max(initial=0)), _MAX_DIGITS)
        chars, inside = self._right_aligned(first, ends, width)
        digits = chars.astype(np.int64) - _ZERO
        bad |= (inside & ((digits < 0) | (digits > 9))).any(axis=-1)
        powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
        values = np.where(inside, digits, 0) @ powers
        values = np.where(bad, 0, np.where(negative, -values, values))
        what = "an integer" + (" or empty" if allow_empty else "")
        self.mark(
            columns,
            bad,
            [f"column {c + 1} ({n}) must be {what}" for c, n in zip(columns, names, strict=True)],
        )
        return values

    def hexadecimal(self, columns: range, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Parses columns of hexadecimal ids (up to 16 digits) or empty fields.

        Args:
          columns: the ``c`` consecutive columns (0-based).
          names: their names, for messages.

        Returns:
          ``(values, empty)``: ``uint64 [n, c]`` ids (0 where empty or
          malformed) and ``bool [n, c]`` empty fields.
        """
        cols = slice(columns.start, columns.stop)
        starts, ends = self.starts[:, cols], self.ends[:, cols]
        length = ends - starts
        bad = length > _MAX_HEX_DIGITS
        # Two digits per byte: round the width up to an even number of digits.
        width = min(int(length.max(initial=0)) + 1, _MAX_HEX_DIGITS) & ~1
        chars, inside = self._right_aligned(starts, ends, width)
        nibbles = _HEX_VALUE[chars]
        bad |= (inside & (nibbles == 255)).any(axis=-1)
        nibbles = np.where(inside, nibbles, 0)
        packed = np.zeros((*length.shape, 8), np.uint8)
        packed[..., 8 - width // 2 :] = (nibbles[..., 0::2] << 4) | (nibbles[..., 1::2] & 15)
        values = packed.view(">u8")[..., 0].astype(np.uint64)
        self.mark(
            columns,
            bad,
            [
                f"column {c + 1} ({n}) must be a hexadecimal id of at most {_MAX_HEX_DIGITS} "
                "digits, or empty"
                for c, n in zip(columns, names, strict=True)
            ],
        )
        return np.where(bad, np.uint64(0), values), length == 0

    def check(
        self, path: str | os.PathLike[str], *, skip: bool
    ) -> tuple[np.ndarray, int, list[str]]:
        """Resolves the malformed lines: raise for the first one, or drop them.

        Args:
          path: the file, for messages.
          skip: drop malformed lines instead of raising.

        Returns:
          ``(keep, dropped, examples)``: ``bool [n]`` rows to keep, the number
          of malformed lines, and the messages of the first few of them.

        Raises:
          DataFormatError: for the first malformed line, unless ``skip``.
        """
        keep = self.bad_column == self.num_columns
        dropped = len(self.ragged_lines) + int(np.count_nonzero(~keep))
        if not dropped:
            return keep, 0, []
        found: list[tuple[int, int | None, int | None]] = [
            (int(line), None, i) for i, line in enumerate(self.ragged_lines[:MAX_EXAMPLES])
        ]
        bad_rows = np.flatnonzero(~keep)[:MAX_EXAMPLES]
        found += [(int(self.lines[row]), int(row), None) for row in bad_rows]
        found.sort()
        messages = []
        for line, row, ragged in found[:MAX_EXAMPLES]:
            if row is None:
                problem = (
                    f"expected {self.num_columns} fields separated by tabs, found "
                    f"{int(self.ragged_fields[ragged])}"
                )
            else:
                column = int(self.bad_column[row])
                problem = f"{self.problems[column]}, got {self.field(row, column)!r}"
            if not skip:
                raise DataFormatError(
                    path,
                    line,
                    f"{problem}. Fix or remove the line, or build with skip_malformed=True "
                    "to drop malformed lines and count them.",
                )
            messages.append(str(DataFormatError(path, line, problem)))
        return keep, dropped, messages


def split_block(block: bytes, first_line: int, num_columns: int, separator: bytes = b"\t") -> Block:
    """Splits a block of whole lines into ``num_columns`` fields per line.

    Args:
      block: lines, each ending with a newline (a trailing ``\\r`` is dropped).
      first_line: 1-based number of the block's first line.
      num_columns: ``K``, fields of a well-formed line.
      separator: one byte between fields.

    Returns:
      The ``Block``; lines with another number of fields are set aside.
    """
    if len(separator) != 1:
        raise ValueError(f"separator must be one byte, got {separator!r}.")
    data = np.frombuffer(block, np.uint8)
    line_ends = np.flatnonzero(data == _NEWLINE)
    line_starts = np.concatenate([[0], line_ends[:-1] + 1])
    has_cr = (line_ends > line_starts) & (data[np.maximum(line_ends - 1, 0)] == _CR)
    text_ends = line_ends - has_cr
    seps = np.flatnonzero(data == separator[0])
    line_of_sep = np.searchsorted(line_ends, seps)
    fields = np.bincount(line_of_sep, minlength=line_ends.size) + 1
    good = fields == num_columns
    seps = seps[good[line_of_sep]].reshape(-1, num_columns - 1)
    starts = np.concatenate([line_starts[good, None], seps + 1], axis=1)
    ends = np.concatenate([seps, text_ends[good, None]], axis=1)
    numbers = first_line + np.arange(line_ends.size, dtype=np.int64)
    return Block(
        data=data,
        starts=starts,
        ends=ends,
        lines=numbers[good],
        ragged_lines=numbers[~good],
        ragged_fields=fields[~good],
        bad_column=np.full(starts.shape[0], num_columns, np.int64),
    )
