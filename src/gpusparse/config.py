"""The engines' tunable settings: one frozen :class:`EngineConfig`, scoped per context.

Settings that benchmarks and tests vary (fixed-point weights, the accumulator, CUDA-graph
limits, page-locked results, the shards' lower-bound exchange) live here instead of in
module globals. :func:`engine_config` returns the settings in force; :func:`override_config`
changes some of them for a ``with`` block only. The override is held in a
:class:`contextvars.ContextVar`, so it applies to the current thread (or asyncio task) alone:
a test or benchmark that overrides a setting does not change what a server's worker thread
sees. Benchmarks write :meth:`EngineConfig.as_dict` into every result.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

RESIDENT_MODES = ("tiled", "lists")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the search engines; the defaults are the measured best (bench/NOTES.md).

    Attributes:
        fixed_point: the tiled engine stores float32 weights as 30-bit fixed-point integers
            (integer products: -15% at k = 1000 on an H200) where every query's margin allows.
        accumulator: the tiled CUDA kernel's accumulator, ``"u32"`` (fastest) or ``"carry"``
            (2**61 units: fewer rescored candidates, slower).
        forward_rescoring: a tiled layout built on a GPU keeps the index's document-major
            copy, which rescoring reads instead of binary-searching the inverted lists
            (8 bytes a posting more on the GPU).
        resident: what the tiled engine keeps on a GPU: ``"tiled"``, the tiled layout alone
            (the padded lists stay on the host, rescoring reads the layout), or ``"lists"``
            (the default), the padded lists, the forward copy (see ``forward_rescoring``) and
            the layout.
        dense_min: the tiled layout stores a (tile, term) segment holding at least this
            share of the tile's documents as a dense row (bitmap and weights), ``None``: no
            dense rows; ``"auto"``: the measured best for the weight type
            (:data:`gpusparse.layout.tiled.DEFAULT_LAYOUT`).
        doc_order: the order of documents in the tiled layout beside resident lists:
            ``"cluster"``, grouped by spherical k-means over their weights
            (:func:`gpusparse.layout.order.cluster_order`: fewer dense rows and sparse
            postings per (query, tile): -20 % kernel time at 8.8M x 256 on an H200, synthetic), ``"none"``
            (collection order), or ``"auto"``: ``"cluster"`` from
            :data:`gpusparse.layout.order.ORDER_MIN_TILES` tiles on, for a layout that keeps
            the forward copy (on a GPU, see ``forward_rescoring``). Results do not depend on
            it (ties still break by document number).
        order_clusters: clusters of ``"cluster"``.
        graph_max_batch: batches of at most this many queries replay a captured CUDA graph.
        graph_repeat_batch: larger batches, up to this many queries, replay a captured CUDA
            graph from the second batch of their shape on (a search of many batches of one
            size; a shape seen once is searched without capture, which costs about two
            searches; not under a ``device_memory_limit``, as their buffers stay allocated).
            0: only ``graph_max_batch``.
        graph_cache: batch shapes whose captured graphs an index keeps (up to two captures a
            shape; least recently used dropped first).
        graph_cache_bytes: device bytes the captured graphs of an index may hold (their
            candidate buffers, estimated by :func:`gpusparse.engines.tiled.waves.search_bytes`;
            least recently used dropped first). They stay allocated between searches.
        pinned_results: results come back from a GPU through page-locked host memory
            (-0.8 ms at 8.8M x 256, k = 1000).
        pinned_output_max: a search of several batches writes straight into one page-locked
            output when it takes at most this many bytes.
        shard_lower_bounds: shards exchange their candidates' lower bounds before rescoring
            (one all-reduce and a host sync per call; off: it costs more than it saves since
            rescoring reads the forward copy).
        device_memory_limit: bytes of GPU memory a search may take over every allocator
            (``None``: no limit). Before the first search on a device the need is predicted
            (:mod:`gpusparse.footprint`); a mode that does not fit gives way to one that does,
            with a warning, or the search is refused (:mod:`gpusparse.device_memory`).
    """

    fixed_point: bool = True
    accumulator: str = "u32"
    forward_rescoring: bool = True
    # "lists" until "tiled" has run on a GPU (its CUDA rescoring is new): see bench/NOTES.md.
    resident: str = "lists"
    dense_min: float | str | None = "auto"
    doc_order: str = "auto"
    order_clusters: int = 16
    graph_max_batch: int = 8
    graph_repeat_batch: int = 1024
    graph_cache: int = 8
    graph_cache_bytes: int = 1 << 30
    pinned_results: bool = True
    pinned_output_max: int = 1 << 28
    shard_lower_bounds: bool = False
    device_memory_limit: int | None = None

    def __post_init__(self) -> None:
        if self.accumulator not in ("u32", "carry"):
            raise ValueError(f"accumulator must be 'u32' or 'carry', not {self.accumulator!r}")
        if self.resident not in RESIDENT_MODES:
            raise ValueError(f"resident must be one of {', '.join(map(repr, RESIDENT_MODES))}, not {self.resident!r}")
        if not (self.dense_min is None or self.dense_min == "auto" or 0 < _number(self.dense_min) <= 1):
            raise ValueError(f"dense_min must be 'auto', None or a share in (0, 1], not {self.dense_min!r}")
        if self.doc_order not in ("auto", "cluster", "none"):
            raise ValueError(f"doc_order must be 'auto', 'cluster' or 'none', not {self.doc_order!r}")
        for name in (
            "order_clusters",
            "graph_max_batch",
            "graph_repeat_batch",
            "graph_cache",
            "graph_cache_bytes",
            "pinned_output_max",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
        limit = self.device_memory_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"device_memory_limit must be a positive number of bytes or None, not {limit!r}")

    def as_dict(self) -> dict[str, Any]:
        """The settings by name (for benchmark results)."""
        return dataclasses.asdict(self)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else -1.0


_DEFAULT = EngineConfig()
_CURRENT: ContextVar[EngineConfig | None] = ContextVar("gpusparse_engine_config", default=None)


def engine_config() -> EngineConfig:
    """The settings in force in this thread or task."""
    return _CURRENT.get() or _DEFAULT


@contextlib.contextmanager
def override_config(**changes: Any) -> Iterator[EngineConfig]:
    """Change some settings for the ``with`` block (this thread or task only)::

        with override_config(fixed_point=False):
            index.search(queries)

    Unknown names raise :class:`TypeError`; the block gets the new :class:`EngineConfig`.
    """
    config = dataclasses.replace(engine_config(), **changes)
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)
