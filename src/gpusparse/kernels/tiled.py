"""Transitional: the names the engine modules (``gpusparse.tiled``, ``gpusparse.search``) still
import from here. The tiled kernel's launcher is :mod:`.tile_candidates`, the compaction's
:mod:`.compact`, ``available`` :mod:`.cupy_launch`'s; delete this module once those imports point
at them (it shares its name with the engine module ``gpusparse.tiled``).
"""

from __future__ import annotations

from .compact import compact_candidates
from .cupy_launch import available
from .tile_candidates import ACC_MODES, ACC_TOP, launch_shape, shared_bytes, tiled_candidates

__all__ = [
    "ACC_MODES",
    "ACC_TOP",
    "available",
    "compact_candidates",
    "launch_shape",
    "shared_bytes",
    "tiled_candidates",
]
