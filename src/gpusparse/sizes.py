"""Byte sizes as people write them: ``"1GiB"``, ``"512MB"``, ``"1048576"`` (for ``--memory-budget`` and kin)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20}
_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512MB"``, ``"1048576"`` → bytes; ``ValueError`` for anything else."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 512MiB, 2GB or 1073741824")
    return int(float(m.group(1)) * _UNITS[unit])
