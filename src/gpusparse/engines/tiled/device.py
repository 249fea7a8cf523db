"""The tiled engine's search on a GPU without host synchronisation, and its CUDA graphs.

Waves, capacities and the final width are fixed in advance; rows that outgrow them, or
whose top-k may miss scores below one fixed-point unit, are flagged on the device and
searched again the general way (:mod:`.waves`). Small batches replay a CUDA graph of these
steps, captured once per shape and kept with the index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...config import engine_config
from ...kernels import finish, rescore, tile_candidates
from ...kernels.compact import compact_candidates
from ...layout.postings import PostingLists
from ...layout.tiled import TiledIndex
from ...queries import QueryBatch
from ...topk import top_keys
from . import waves
from .fixed_point import FixedPoint, fixed_point_device, kernel_scale, match_floor
from .graphs import HostBatch, HostResults, graphed, padded_batch
from .waves import candidate_lows

# Candidate slots per query kept for the final selection on the synchronisation-free path:
# after the last compaction a row holds its k best plus the few within the margin of the k-th.
DEVICE_WIDTH_SLACK = 1024
# Batches of at most this many queries read the dense terms' postings from the index's lists
# instead of the layout's dense rows (fixed-point float32 layouts; see dense_lists). The kernel
# alone at 8.8M on an H200: 1 query -14 %, 2 -7 %, 4 +1 %, 8 +2 %
# (bench/results/2026-11-27-H200-launch-shape-lists-e2b7c14.json).
DENSE_LISTS_MAX_BATCH = 2


def device_search(
    index: PostingLists,
    layout: TiledIndex,
    batch: QueryBatch,
    fp: FixedPoint,
    k: int,
    *,
    acc: str,
    int_weights: bool,
    n_sm: int,
    cutoff: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CUDA search without host synchronisation: ``(scores, ids, redo)`` on the device.

    The waves, capacities and final width are fixed in advance (:func:`~.waves.wave_plan`,
    :func:`~.waves.initial_capacity`, ``2k +`` :data:`DEVICE_WIDTH_SLACK`); each wave's candidates are
    compacted by one kernel, turned into keys by another, and the top-k taken. A row whose
    candidates outgrew a capacity, or whose top-k may miss documents below one fixed-point
    unit (:func:`~.fixed_point.uncertain_rows`), is flagged in ``redo`` (bool ``[B]``): its results are not
    to be used, and :func:`~.engine.tiled_search` searches it again the general way.

    Batches of at most :attr:`~gpusparse.config.EngineConfig.graph_max_batch` queries replay a
    captured CUDA graph of these steps (their time is mostly the host's launching them); the graph is captured on the
    first batch of its shape and kept with the index. ``cutoff``: see :func:`~.engine.tiled_search`
    (not for those batches: a capture may fail on one process only).
    """
    dev = layout.seg.device
    lb = fp.floor if fp.floor is not None else match_floor(index, batch, dev)
    terms, weights = batch.padded_terms, batch.padded_weights
    if terms.shape[0] <= engine_config().graph_max_batch:
        cutoff = None
        out = graphed_steps(index, layout, padded_batch(*batch.host_arrays()), k, acc=acc, int_weights=int_weights,
                            n_sm=n_sm)  # fmt: skip
        if out is not None:
            return out  # type: ignore[return-value]
    return _device_steps(index, layout, terms.contiguous(), weights.contiguous(), fp, lb, k, acc, int_weights, n_sm,
                         cutoff)  # fmt: skip


def _device_steps(
    index: PostingLists,
    layout: TiledIndex,
    terms: torch.Tensor,
    weights: torch.Tensor,
    fp: FixedPoint,
    lb: torch.Tensor,
    k: int,
    acc: str,
    int_weights: bool,
    n_sm: int,
    cutoff: Callable[[torch.Tensor], torch.Tensor] | None = None,
    redo: torch.Tensor | None = None,
    terms32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`device_search`'s device work, from tensors only (so that it can be captured);
    ``redo``: rows flagged already (bool ``[B]``; written, and included in the flags returned);
    ``terms32``: ``terms`` as int32 where the caller has them."""
    dev = layout.seg.device
    b = terms.shape[0]
    terms32 = terms.to(torch.int32) if terms32 is None else terms32
    q_scale = kernel_scale(layout, fp)
    plan = waves.wave_plan(layout.n_tiles, b, k, n_sm)
    cap = waves.initial_capacity(k, plan[0][1] if plan else 1)
    # theta and the counts zeroed by one operation (a CUDA graph's node each otherwise)
    state = torch.zeros(2 * b, dtype=torch.int64, device=dev)
    theta, count = state[:b], state[b:].view(torch.int32)[:b]
    cand_doc = torch.empty((b, cap), dtype=torch.int32, device=dev)
    cand_val = torch.empty((b, cap), dtype=torch.int64, device=dev)
    redo = torch.zeros(b, dtype=torch.bool, device=dev) if redo is None else redo
    dense_from = dense_lists(index, layout, b)  # None: the dense rows
    # the waves after the first read their blocks' term metadata from records (8-bit levels)
    meta = tile_candidates.meta_scratch(layout, terms32, waves.largest_later_wave(plan), acc=acc,
                                        int_weights=int_weights, dense_lists=dense_from is not None)  # fmt: skip
    for first, n in plan:
        tile_candidates.tiled_candidates(
            layout, terms32, weights, q_scale, fp.delta, k=k, tiles=(first, n), select=first == 0,
            acc=acc, int_weights=int_weights, q_shift=fp.shift,
            theta=theta, cand_count=count, cand_doc=cand_doc, cand_val=cand_val, lists=dense_from, meta=meta,
        )  # fmt: skip
        # rows whose candidates past the capacity were counted, not stored, flagged in redo
        compact_candidates(theta, count, cand_doc, cand_val, fp.delta, k, cap, overflow=redo)
    width = min(cap, 2 * k + DEVICE_WIDTH_SLACK)
    floor = cutoff(candidate_lows(cand_val, count, fp.delta, fp.scale, width)) if cutoff is not None else None
    # rescoring reads the forward copy, the lists, or (their not being on the device) the layout
    lists = (index.doc_ids, index.scores, index.offsets, index.lengths) if index.lists_resident else (None,) * 4
    tiled = None if index.lists_resident else layout
    keys = rescore.candidate_keys_cuda(
        *lists, terms, weights, cand_doc, cand_val,
        fp.delta, fp.scale, width=width, count=count, list_pos=layout.list_pos if tiled is None else None,
        tile_bits=layout.tile_bits, floor=floor, forward=layout.forward, tiled=tiled, lanes=int_weights,
    )  # fmt: skip
    top = top_keys(keys, k, count) if width else None
    # padded results and the rows to search again (uncertain_rows's rule; more candidates than
    # the keys held), in one launch; in one buffer, which a graph copies to the host in one copy
    return finish.finish_rows(top, k, fp.delta, fp.scale, lb, floor, redo, count=count, width=width, packed=True)


def dense_lists(
    index: PostingLists, layout: TiledIndex, b: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The lists the kernel reads a small batch's dense terms from (``lists`` of
    :func:`~gpusparse.kernels.tile_candidates.tiled_candidates`), or ``None`` (the dense rows).

    A dense row holds a slot for every document of its tile, about three quarters of them 0 at
    the default threshold; its list holds only the postings (8 bytes each). Rows read by many
    queries of a batch are shared through the cache; a batch of a few queries reads each once,
    and the rows were then most of its bytes (batch 1 at 8.8M: 247 of 267 MB). Only for a
    fixed-point float32 layout with list positions whose lists are on the device."""
    if b > DENSE_LISTS_MAX_BATCH or not index.lists_resident or layout.list_pos is None:
        return None
    if layout.weight_bits is None or layout.quantized or index.scores.dtype != torch.float32:
        return None
    return index.doc_ids, index.scores, index.offsets, index.lengths


def graphed_steps(
    index: PostingLists,
    layout: TiledIndex,
    batch: HostBatch,
    k: int,
    *,
    acc: str,
    int_weights: bool,
    n_sm: int,
    to_host: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | HostResults | None:
    """:func:`_device_steps` by the CUDA graph of this shape (:mod:`.graphs`), from the batch on
    the host (:class:`~.graphs.HostBatch`: written padded into the graph's staging buffer); the
    fixed-point parameters are computed in the graph
    (:func:`~.fixed_point.fixed_point_device`; rows it cannot serve are flagged in ``redo``,
    as are, with ``int_weights``, rows whose weights are not integers at their scale).
    ``None`` where it could not be captured (the caller runs the steps themselves).
    ``to_host``: ``(scores, ids, redo)`` delivered to the host by the graph where they are small
    enough (:func:`~.graphs.graphed`; ``redo`` ``None`` there when no row is flagged), else on
    the device as without it."""
    key = (id(layout), k, acc, int_weights)
    kept = index.derived.graph_steps.get((*key, n_sm))  # the steps of these arguments, made once
    if kept is None or kept[0] is not layout:
        kept = (layout, *_graph_steps(index, layout, k, acc, int_weights, n_sm))
        index.derived.graph_steps[(*key, n_sm)] = kept  # (the layout held: its id is not taken again)
    _, steps, nbytes = kept
    return graphed(index.derived.graphs, key, steps, batch, layout.seg.device, nbytes,  # type: ignore[return-value]
                   to_host=to_host, flag=2)  # fmt: skip


def _graph_steps(
    index: PostingLists, layout: TiledIndex, k: int, acc: str, int_weights: bool, n_sm: int
) -> tuple[Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]], Callable[[int], int]]:
    """:func:`graphed_steps`' steps (the fixed-point parameters, then :func:`_device_steps`) and
    the device bytes they allocate for a batch of ``rows`` queries."""
    step = layout.step if int_weights else None

    def steps(inp):
        fp, lb, redo = fixed_point_device(index, inp["terms"], inp["weights"], acc, layout.weight_bits, step)
        return _device_steps(index, layout, inp["terms"], inp["weights"], fp, lb, k, acc, int_weights, n_sm, redo=redo,
                             terms32=inp["terms32"])  # fmt: skip

    def nbytes(rows: int) -> int:
        return waves.search_bytes(layout.n_tiles, rows, k, n_sm, levels=layout.quantized)

    return steps, nbytes
