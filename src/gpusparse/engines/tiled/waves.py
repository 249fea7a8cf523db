"""Candidates in waves of tiles: the tiled engine's general path (one host sync per wave).

A block only knows its own tile's k-th score; the k-th of everything seen so far is a far
better threshold. So tiles go in waves of growing size (:func:`wave_plan`); after each wave
the candidates are compacted to each query's top k with the margin (:func:`compact_torch`,
or one CUDA launch), and the next wave's blocks start from the raised threshold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...kernels.compact import compact_candidates
from ...kernels.tile_candidates import SHORT_WIDTH, meta_bytes
from ...layout.tiled import TiledIndex
from ...queries import QueryBatch
from .fixed_point import FixedPoint, emission_threshold, kernel_scale

# A batch this small whose tiles may emit at most this many candidates a query (k per
# tile) runs in a single wave: the waves' host syncs cost more than the extra candidates.
SINGLE_WAVE_MAX_BATCH = 8
SINGLE_WAVE_MAX_CANDIDATES = 1 << 16
# Below this batch size the last wave's candidates go to the final selection without a
# compaction pass (its ~15 small operations cost more host time than the few extra rescorings).
FINAL_COMPACTION_MIN_BATCH = 9
# Each wave after the first is this many times the one before; for k of at least LARGE_K a
# threshold near the final one matters more (each block of the big wave emits more, and the
# compactions read it all), and waves that grow 8-fold were faster: at 8.8M on an H200 (8-bit,
# device time of the search) 4.06 against 4.16 ms at batch 256 and top-1000, 15.38 against
# 15.80 at batch 1024, equal at batch 32; at top-10 equal, or 2 % slower at batch 32
# (bench/results/2026-11-27-H200-wave-growth-1ab432c.json).
WAVE_GROWTH, WAVE_GROWTH_LARGE_K, LARGE_K = 16, 8, 256


def wave_plan(n_tiles: int, b: int, k: int, n_sm: int) -> list[tuple[int, int]]:
    """``(first tile, tiles)`` of each wave of a search (see :func:`candidates`).

    Small batches whose tiles emit few candidates run in one wave (no host sync between
    waves); otherwise the first wave fills the GPU about twice and each later one is 16
    times larger, 8 times for ``k`` of at least :data:`LARGE_K` (few waves: each costs a
    compaction and, on the host path, a sync).
    """
    if b <= SINGLE_WAVE_MAX_BATCH and k * n_tiles <= SINGLE_WAVE_MAX_CANDIDATES:
        wave = n_tiles
    else:
        wave = max(4, min(32, -(-2 * n_sm // max(b, 1))))
    growth = WAVE_GROWTH_LARGE_K if k >= LARGE_K else WAVE_GROWTH
    plan, done = [], 0
    while done < n_tiles:
        n = min(wave, n_tiles - done)
        plan.append((done, n))
        done += n
        wave = max(growth * wave, -(-4 * n_sm // max(b, 1)))
    return plan


def largest_later_wave(plan: list[tuple[int, int]]) -> int:
    """The tiles of the largest wave after the first in a :func:`wave_plan` (0 for none): the
    launches without selection, whose metadata records (8-bit levels) are sized by it."""
    return max((n for first, n in plan if first > 0), default=0)


def initial_capacity(k: int, first_wave: int) -> int:
    """Candidate slots per query for the first try (a query needing more reruns with enough).

    The first wave's blocks know no threshold but their tile's: each may emit about k.
    """
    return max(4 * k + 4096, first_wave * (k + 256), 1 << 15)


def candidates(
    layout: TiledIndex,
    batch: QueryBatch,
    fp: FixedPoint,
    k: int,
    *,
    launch: Callable[..., None],
    n_sm: int,
    acc: str = "carry",
    int_weights: bool = False,
    compact: Callable[..., None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates from ``launch`` (the CUDA kernel or :func:`~.emulation.torch_tiled_candidates`), in waves
    of tiles: ``(docs, values)`` ``[B, C]`` (``-1``/0 padded). ``n_sm``: the GPU's multiprocessors.
    ``compact``: :func:`compact_torch` (the default) or its one-launch CUDA version.

    A block only knows its own tile's k-th score; the k-th of everything seen so far is a far
    better threshold. So tiles go in waves of growing size (at least enough blocks to fill the
    GPU): after each wave the candidates are reduced to the query's top k (with the margin)
    and ``theta`` is raised to (a 16-bit lower bound of) their k-th value, which the next wave's
    blocks start from.
    Candidates then stay near k per wave instead of near k per tile.
    """
    dev = layout.seg.device
    compact = compact or compact_torch
    b = batch.padded_terms.shape[0]
    terms32 = batch.padded_terms.to(torch.int32).contiguous()
    weights = batch.padded_weights.contiguous()
    q_scale, q_shift = kernel_scale(layout, fp), fp.shift
    plan = wave_plan(layout.n_tiles, b, k, n_sm)
    cap = initial_capacity(k, plan[0][1] if plan else 1)
    most, compacted = 0, False
    while True:
        theta = torch.zeros(b, dtype=torch.int64, device=dev)
        count = torch.zeros(b, dtype=torch.int32, device=dev)
        cand_doc = torch.empty((b, cap), dtype=torch.int32, device=dev)
        cand_val = torch.empty((b, cap), dtype=torch.int64, device=dev)
        overflow = False
        for first, n in plan:
            launch(
                layout, terms32, weights, q_scale, fp.delta, k=k, tiles=(first, n), select=first == 0,
                acc=acc, int_weights=int_weights, q_shift=q_shift,
                theta=theta, cand_count=count, cand_doc=cand_doc, cand_val=cand_val,
            )  # fmt: skip
            most = int(count.max()) if b else 0
            if most > cap:
                overflow = True
                break
            compacted = first + n < layout.n_tiles or b >= FINAL_COMPACTION_MIN_BATCH
            if compacted:
                compact(theta, count, cand_doc, cand_val, most, fp, k)
        if not overflow:
            break
        cap = 2 * most  # rare: start again with room for every candidate
    # After a final compaction the counts shrank (one more sync keeps the width tight for a
    # large batch's final selection); else the last wave's maximum is the width.
    width = max(int(count.max()) if compacted and b else most, 1)
    cols = torch.arange(width, device=dev)
    present = cols[None, :] < count[:, None].to(torch.int64)
    docs = torch.where(present, cand_doc[:, :width].to(torch.int64), torch.full_like(cols[None, :], -1))
    vals = torch.where(present, cand_val[:, :width], torch.zeros_like(docs))
    return docs, vals


def top_bit(x: torch.Tensor) -> torch.Tensor:
    """The index of each value's highest set bit (int64 ``x`` >= 0; 0 for 0), by integer steps."""
    x = x.clone()
    bit = torch.zeros_like(x)
    for s in (32, 16, 8, 4, 2, 1):
        up = (x >> s) > 0
        bit += up * s
        x = torch.where(up, x >> s, x)
    return bit


def compact_torch(
    theta: torch.Tensor,
    count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
    most: int,
    fp: FixedPoint,
    k: int,
) -> None:
    """Raise ``theta`` to a lower bound of the k-th candidate value and drop candidates below its
    margin, in place. The bound is the k-th value's leading 16 bits, counted from the byte that
    holds the top bit of the row's largest value (the bits below cleared: within 2**-8 of the
    k-th value), as the CUDA kernel's two radix passes find it."""
    if most == 0:
        return
    cols = torch.arange(most, device=theta.device)
    present = cols[None, :] < count[:, None].to(torch.int64)
    vals = torch.where(present, cand_val[:, :most], torch.zeros_like(cand_val[:, :most]))
    if most >= k:
        kth = torch.topk(vals, k, dim=1, sorted=False).values.min(dim=1).values
        low = (top_bit(vals.max(dim=1).values) // 8 * 8 - 8).clamp_(min=0)
        theta.copy_(torch.maximum(theta, kth >> low << low))
    keep = present & (vals >= emission_threshold(theta, fp.delta)[:, None])
    new_count = keep.sum(1)
    dest = torch.cumsum(keep, 1) - 1  # slot of each kept candidate
    r, c = keep.nonzero(as_tuple=True)
    docs = cand_doc[r, c]
    kept_vals = cand_val[r, c]
    cand_doc[r, dest[r, c]] = docs
    cand_val[r, dest[r, c]] = kept_vals
    count.copy_(new_count.to(torch.int32))


def compact_cuda(
    theta: torch.Tensor,
    count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
    most: int,
    fp: FixedPoint,
    k: int,
) -> None:
    """:func:`compact_torch` by the CUDA kernel (one launch instead of ~20 small operations)."""
    compact_candidates(theta, count, cand_doc, cand_val, fp.delta, k, most)


def candidate_lows(
    cand_val: torch.Tensor, count: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, width: int
) -> torch.Tensor:
    """float32 ``[B, width]``: for the first ``width`` candidate slots of each row (the first
    ``count`` hold candidates, the rest 0), a value the candidate's float32 score reaches:
    the ``low`` of :func:`~.ranking.rank_candidates`, by the same float64 operations. The k-th
    largest of all these over the searches of a merge is a bound the merged k-th score
    reaches (k distinct documents reach it)."""
    v = cand_val[:, :width].to(torch.float64)
    margin = delta[:, None].to(torch.float64) + v * 2.0**-50
    low = ((v - margin).clamp_min(0) / scale[:, None]).to(torch.float32)
    present = torch.arange(width, device=v.device)[None, :] < count[:, None]
    return torch.where(present, low, torch.zeros_like(low))


def search_bytes(n_tiles: int, b: int, k: int, n_sm: int, *, levels: bool = False) -> int:
    """Device bytes a batch of ``b`` queries at ``k`` allocates on the synchronisation-free
    path beyond the layout (:func:`~.device.device_search`): candidate slots (int32 doc +
    int64 value each) at the first wave's capacity, the ranking keys and their top-k, and
    the results; an estimate within a few percent (per-row scalars left out). ``levels``: a
    layout of 8-bit levels, whose later waves may also hold their blocks' metadata records
    (:func:`~gpusparse.kernels.tile_candidates.meta_bytes`, queries of the graphs' widest
    padding counted)."""
    plan = wave_plan(n_tiles, b, k, n_sm)
    cap = initial_capacity(k, plan[0][1] if plan else 1)
    width = min(cap, 2 * k + 1024)
    records = meta_bytes(b, SHORT_WIDTH, largest_later_wave(plan)) if levels else 0
    return b * (cap * 12 + width * 8 * 2 + k * 12 * 2) + records
