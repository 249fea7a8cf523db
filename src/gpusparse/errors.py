"""Errors raised for bad input.

Every problem a user can cause (a malformed file, a bad weight, a vocabulary that does
not match the index) raises :class:`InputError`, whose message is one line naming the
file, the line or record and the field. The CLI prints that line and exits non-zero;
anything else escaping is a bug in GPUSparse.
"""

from __future__ import annotations

from os import PathLike


class GPUSparseError(Exception):
    """Base class of the errors GPUSparse raises on purpose."""


class InputError(GPUSparseError, ValueError):
    """Bad user input, located as precisely as we can.

    Attributes:
        path: the file (or folder) at fault, if any.
        line: the 1-based line number (JSONL, TSV) or record number (binary), if any.
        field: the field at fault (``"vector"``, ``"id"``, ``"manifest.json"`` ...), if any.
        reason: what is wrong, in words.
    """

    def __init__(
        self,
        reason: str,
        *,
        path: str | PathLike[str] | None = None,
        line: int | None = None,
        field: str | None = None,
        record: bool = False,
    ) -> None:
        self.path = None if path is None else str(path)
        self.line = line
        self.field = field
        self.reason = reason
        self.record = record
        super().__init__(self._format())

    def _format(self) -> str:
        where = ""
        if self.path is not None:
            where = self.path
            if self.line is not None:
                where += f" record {self.line}" if self.record else f":{self.line}"
            where += ": "
        elif self.line is not None:
            where = f"record {self.line}: " if self.record else f"line {self.line}: "
        field = f"field {self.field!r}: " if self.field else ""
        return f"{where}{field}{self.reason}"


class IndexFormatError(GPUSparseError, ValueError):
    """An index folder that is missing, truncated, corrupted or from a newer version."""


class DeviceMemoryError(GPUSparseError, MemoryError):
    """A search that does not fit the device's memory (or the user's limit on it), refused
    before allocating, or an out-of-memory error of PyTorch or CuPy during a search, with the
    figures and what to change; its message is one line."""
