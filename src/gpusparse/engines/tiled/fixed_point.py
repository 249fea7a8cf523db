"""The tiled engine's fixed-point arithmetic: per-query scales and error margins, and the
checks that say when a row's fixed-point top-k cannot be trusted.

Each query's scores are accumulated as integers ``≈ score · scale`` (``scale`` a power of
two chosen so the query's largest possible score fits the accumulator); candidates within
a margin ``delta`` of the running k-th value are kept, so the exact top-k is always among
them (see :func:`fixed_point` for the bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ...config import engine_config
from ...kernels.query_params import query_params
from ...kernels.tile_candidates import ACC_MODES, ACC_TOP
from ...layout.postings import PostingLists
from ...layout.statistics import max_score, max_scores_host, max_scores_on, min_weight
from ...layout.tiled import TiledIndex
from ...queries import QueryBatch
from ...transfer import to_device

FIXED_MAX_DELTA = 1 << 16
# Batches of at most this many queries take their host fixed-point parameters from Python floats,
# row by row (the general path's; a CUDA graph computes its own on the device): on a CPU dev box
# ~2 µs a row, against ~20-30 µs for numpy's ~50 calls on [B] arrays (bench/host_prep.py; equal
# near 8 rows with fixed-point weights, 12 without).
SCALAR_ROWS = 8


@dataclass(frozen=True)
class FixedPoint:
    """Per-query fixed-point parameters: ``scale`` (a power of two) and the margin ``delta``;
    with fixed-point weights also each query weight's multiplier and each product's shift."""

    scale: torch.Tensor  # float64 [B]
    delta: torch.Tensor  # int64 [B], in units
    mult: torch.Tensor | None = None  # float64 [B]: q = round(w_q · mult), mult = scale · 2**c
    shift: torch.Tensor | None = None  # int32 [B]: b + c, product = (q · d) >> shift
    scale_host: np.ndarray | None = None  # float64 [B]: ``scale`` on the host (no copy back)
    floor: torch.Tensor | None = None  # float64 [B]: :func:`match_floor`, moved in the same copy


def choose_acc(acc: str | None) -> str:
    """The accumulator mode: ``acc``, checked, or the configured one
    (:attr:`~gpusparse.config.EngineConfig.accumulator`)."""
    acc = acc or engine_config().accumulator
    if acc not in ACC_MODES:
        raise ValueError(f"acc must be one of {sorted(ACC_MODES)}, got {acc!r}")
    return acc


def integer_weights(layout: TiledIndex, batch: QueryBatch, fp: FixedPoint, acc: str) -> bool:
    """Whether the kernel may multiply integers: 8-bit levels, "u32", and every scaled query
    weight an integer (true for quantized queries: their step times the scale is a power of
    two of at least 1). Checked on the host copies: no device work."""
    _, weights, _ = batch.host_arrays()
    scale = fp.scale_host if fp.scale_host is not None else fp.scale.cpu().numpy()
    return integer_weights_host(layout, weights, scale, acc)


def integer_weights_host(layout: TiledIndex, weights: np.ndarray, scale: np.ndarray, acc: str) -> bool:
    """:func:`integer_weights` from the padded weights and the scales on the host."""
    if not layout.quantized or acc != "u32":
        return False
    w = weights * (scale * layout.step)[:, None]  # float64: float32 weights converted exactly
    return bool((w == np.round(w)).all())


def fixed_point(
    index: PostingLists, batch: QueryBatch, acc: str = "carry", weight_bits: int | None = None
) -> FixedPoint:
    """Choose each query's scale so its largest possible score fits, and its error margin.

    ``ub = Σ w_q[t] · max_scores[t]`` bounds every score; ``scale`` is the largest power of
    two with ``ub · scale ≤ top``, the accumulator mode's limit (``2**61`` for "carry",
    ``2**31`` for "u32"; exact, from the binary exponent of ``ub``).
    The integer sum ``F`` is within ``n/2`` units of ``scale · S`` (S the exact score): each
    product is rounded once to the unit (or, in the "u32" kernel's dense phase, m exact
    products are summed in float64 below 2**32, error at most (m−1)·2**-21, then rounded
    once: at most m/2 again). The canonical float64 sum is within
    ``2·(n+1)·2**-53 · scale · S``; twice their sum, plus slack, is the margin between any
    two of them. Computed on the host (a batch is small) and moved in one copy.

    ``weight_bits`` (fixed-point document weights ``d = round(w_d · 2**b)``, "u32"): each
    query weight becomes ``q = round(w_q · scale · 2**c)`` (``c`` the largest with every
    ``q < 2**31``) and a product ``(q · d) >> (b + c)``. Against ``P = w_q · scale · w_d``
    that product errs by less than ``1`` (the shift truncates) ``+ |q − w_q·scale·2**c| ·
    w_d · 2**-c + |d − w_d·2**b| · w_q·scale · 2**-b`` (+ their product), so ``n/2`` above
    becomes ``E = n + n·max_w·2**-(c+1) + Σ w_q·scale·2**-(b+1) + n·2**-(b+c+2)``.
    """
    terms, weights, n_terms = batch.host_arrays()
    return fixed_point_on(fixed_point_host(index, terms, weights, n_terms, acc, weight_bits), batch.padded_terms.device)


def fixed_point_on(host: dict[str, np.ndarray], device: torch.device) -> FixedPoint:
    """:func:`fixed_point_host`'s arrays as a :class:`FixedPoint` on ``device`` (one copy)."""
    names = [n for n in ("scale", "delta", "mult", "shift", "lb") if n in host]
    moved = dict(zip(names, to_device([host[n] for n in names], device), strict=True))
    return FixedPoint(moved["scale"], moved["delta"], moved.get("mult"), moved.get("shift"), scale_host=host["scale"],
                      floor=moved["lb"])  # fmt: skip


def fixed_point_host(
    index: PostingLists,
    terms: np.ndarray,
    weights: np.ndarray,
    n_terms: np.ndarray,
    acc: str = "carry",
    weight_bits: int | None = None,
) -> dict[str, np.ndarray]:
    """:func:`fixed_point` on the host, from the padded batch: ``scale`` (float64), ``delta``
    (int64), with ``weight_bits`` also ``mult`` (float64) and ``shift`` (int32), and ``lb``
    (float64, :func:`match_floor`), each ``[B]``. Raises ``ValueError`` where fixed-point
    products are out of range.

    This runs before a small batch's launch: its row reductions are numpy calls over the
    padded ``[B, T]`` (padding, term -1 and weight 0, adds 0), and the per-query arithmetic
    (:func:`_parameters`) is numpy's over ``[B]`` arrays, or for at most :data:`SCALAR_ROWS`
    queries Python's over each row's floats (the same IEEE operations in the same order:
    bit-identical, tested)."""
    max_scores = max_scores_host(index)
    b, width = terms.shape
    w64 = weights.astype(np.float64)
    ub = np.einsum("ij,ij->i", w64, max_scores[terms]) if width else np.zeros(b)
    qmin = _query_minima(terms, weights)
    qmax = qsum = np.zeros(b)  # read with weight_bits only
    if weight_bits is not None:  # max and sum of w_q (times scale: a power of two, exact after)
        qmax = np.maximum.reduce(weights, 1) if width else np.zeros(b, dtype=np.float32)
        qsum = np.add.reduce(w64, 1)
    consts = (int(math.log2(ACC_TOP[acc])), min_weight(index), max_score(index), weight_bits)
    if 0 < b <= SCALAR_ROWS:
        cols = zip(ub.tolist(), map(float, n_terms.tolist()), qmin.tolist(), qmax.tolist(), qsum.tolist(), strict=True)
        rows = [_parameters(_SCALAR, *row, *consts) for row in cols]
        return {name: np.array([r[name] for r in rows], dtype=_DTYPES[name]) for name in rows[0]}
    return _parameters(np, ub, n_terms.astype(np.float64), qmin.astype(np.float64), qmax, qsum, *consts)


_DTYPES = {"scale": np.float64, "delta": np.int64, "mult": np.float64, "shift": np.int32, "lb": np.float64}


class _Scalar:
    """The numpy functions :func:`_parameters` calls, on Python floats and ints (for a few
    queries: a numpy call on a small array costs about a microsecond, these tens of nanoseconds).
    Each gives numpy's float64 result: ``frexp``/``ldexp``/``ceil`` are exact (``ldexp``
    overflows to ``inf`` as numpy's does), ``where``/``clip``/``any`` select."""

    frexp = staticmethod(math.frexp)
    clip = staticmethod(lambda x, lo, hi: min(max(x, lo), hi))
    any = staticmethod(bool)

    @staticmethod
    def ldexp(x: float, e: int) -> float:
        try:
            return math.ldexp(x, e)
        except OverflowError:
            return math.copysign(math.inf, x)

    @staticmethod
    def ceil(x: float) -> float:
        return float(math.ceil(x)) if math.isfinite(x) else x

    @staticmethod
    def where(cond: bool, a: float, b: float) -> float:
        return a if cond else b


_SCALAR = _Scalar()


def _parameters(
    xp, ub, n, qmin, qmax, qsum, top_bits: int, min_w: float, max_w: float, weight_bits: int | None
) -> dict:
    """:func:`fixed_point_host`'s per-query arithmetic, written once for both kinds of operand:
    ``xp`` is numpy (``[B]`` float64 arrays; ``qmax`` float32) or :data:`_SCALAR` (one query's
    Python floats). ``ub``: the score bound; ``n``: the query's terms; ``qmin``/``qmax``/``qsum``:
    its smallest and largest weight and their sum; ``top_bits``: log2 of the accumulator's limit;
    ``min_w``/``max_w``: the index's smallest and largest weight. Returns the parameters by name
    (arrays, or one query's floats and ints)."""
    mant, expo = xp.frexp(ub)  # ub = mant · 2**expo, mant in [0.5, 1)
    e = top_bits - expo + (mant == 0.5)
    scale = xp.where(ub > 0, xp.ldexp(1.0, xp.clip(e, -1000, 1000)), 1.0)
    canon = (ub * scale) * 2 * (n + 1) * 2.0**-53
    floor = qmin * min_w
    if weight_bits is None:
        delta = xp.ceil(2 * (n / 2 + 1) + 2 * canon + 2)
        return {"scale": scale, "delta": _ints(delta), "lb": floor}
    qmax = qmax * scale
    qsum = qsum * scale
    _, qexpo = xp.frexp(qmax)
    c = xp.where(qmax > 0, 31 - qexpo, 0)  # qmax · 2**c < 2**31
    err = n + n * max_w * xp.ldexp(0.5, -c) + qsum * 2.0 ** -(weight_bits + 1)
    err += n * xp.ldexp(0.25, -(weight_bits + c))
    delta = xp.ceil(2 * (err + 1) + 2 * canon + 2)
    shift = weight_bits + c
    # Out of range when one document weight dwarfs the query's own terms' (b then leaves
    # ordinary weights few bits): the margin would admit most documents. The caller falls
    # back to float64 products.
    if xp.any((shift < 0) | (shift > 62) | (delta > FIXED_MAX_DELTA)):
        raise ValueError("weights outside the fixed-point range")
    return {"scale": scale, "delta": _ints(delta), "mult": xp.ldexp(scale, c), "shift": _int32(shift), "lb": floor}


def _ints(delta):
    return delta.astype(np.int64) if isinstance(delta, np.ndarray) else int(delta)


def _int32(shift):
    return shift.astype(np.int32) if isinstance(shift, np.ndarray) else shift


def fixed_point_device(
    index: PostingLists,
    terms: torch.Tensor,
    weights: torch.Tensor,
    acc: str,
    weight_bits: int | None,
    step: float | None,
) -> tuple[FixedPoint, torch.Tensor, torch.Tensor]:
    """:func:`fixed_point_host` on the device, inside a search's CUDA graph: ``(fixed point,
    match floor, redo)`` from the padded batch there (:func:`gpusparse.kernels.query_params.query_params`,
    the same arithmetic; its bound and sum may differ in the last bit, either being valid).
    ``redo`` (bool ``[B]``) flags the rows :func:`fixed_point_host` would refuse, and, with
    ``step`` (the 8-bit layout's, where the kernel multiplies integers), the rows whose weights
    are not integers at that scale (:func:`integer_weights`'s check, per row): the general path
    searches them. With ``step``, the margin is 0 (:func:`exact_margin`)."""
    p = query_params(
        terms, weights, max_scores_on(index, terms.device), top_bits=int(math.log2(ACC_TOP[acc])),
        min_w=min_weight(index), max_w=max_score(index), weight_bits=weight_bits, step=step, max_delta=FIXED_MAX_DELTA,
    )  # fmt: skip
    return FixedPoint(p["scale"], p["delta"], p.get("mult"), p.get("shift")), p["lb"], p["redo"]


def exact_margin(fp: FixedPoint) -> FixedPoint:
    """``fp`` with a margin of 0, for a batch whose products the kernel multiplies as integers
    (:func:`integer_weights`: 8-bit levels times prepared queries' weights, "u32").

    Every product ``w_q · w_d`` is then an integer number of units (``1 / scale``): ``w_q · scale ·
    step`` is an integer and ``w_d`` a level times ``step``. Every partial sum stays below the score
    bound, at most ``2**31`` units, so the kernel's 32-bit sums are the scores times the scale
    exactly, and so is the canonical float64 sum (float64 holds integers to ``2**53``): a candidate's
    float32 score is its sum over the scale, rounded once. What stays is the emission's float32 ulp
    (``theta >> 22``), which keeps the documents that tie the k-th score after rounding."""
    return replace(fp, delta=torch.zeros_like(fp.delta))


def kernel_scale(layout: TiledIndex, fp: FixedPoint) -> torch.Tensor:
    """The kernel's ``q_scale``: the fixed-point scale per stored weight unit (exact: both
    are powers of two), or with fixed-point weights the multiplier of each query weight."""
    return fp.mult if layout.weight_bits is not None else fp.scale * layout.step


def emission_threshold(theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Smallest value a candidate needs: ``theta`` less the margin and one float32 ulp, at least 1.

    The CUDA kernel applies the same rule (see :mod:`gpusparse.kernels.tile_candidates`).
    """
    d = delta + (theta >> 22)
    return torch.where(theta > d, theta - d, torch.ones_like(theta)).clamp_min(1)


def match_floor(index: PostingLists, batch: QueryBatch, dev: torch.device) -> torch.Tensor:
    """float64 ``[B]``: no document matching a query scores below this (its smallest weight
    times the index's smallest weight; inf for a query without terms: nothing to miss)."""
    terms, weights, _ = batch.host_arrays()
    return torch.from_numpy(_match_floor_host(index, terms, weights)).to(dev)


def _match_floor_host(index: PostingLists, terms: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return _query_minima(terms, weights).astype(np.float64) * min_weight(index)


def _query_minima(terms: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """float32 ``[B]``: each query's smallest weight over its terms (inf without terms)."""
    if terms.shape[1]:
        return np.minimum.reduce(weights, 1, where=terms >= 0, initial=np.inf)
    return np.full(terms.shape[0], np.inf, dtype=np.float32)


def uncertain_rows(
    index: PostingLists,
    batch: QueryBatch | None,
    fp: FixedPoint,
    scores: torch.Tensor,
    k: int,
    lb: torch.Tensor | None = None,
    floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`out_of_range` as a bool ``[B]`` tensor on the device, without a host sync;
    ``lb``: :func:`match_floor`'s tensor, if already on the device (then ``batch`` is not read)."""
    b = scores.shape[0]
    if b == 0 or k == 0:
        return torch.zeros(b, dtype=torch.bool, device=scores.device)
    if lb is None:
        if batch is None:
            raise ValueError("uncertain_rows needs the batch or its match floor")
        lb = match_floor(index, batch, scores.device)
    delta = fp.delta.to(torch.float64)
    kth = scores[:, k - 1] if floor is None else torch.maximum(scores[:, k - 1], floor)
    kth = kth.to(torch.float64) * fp.scale * (1 - 2.0**-22)  # float32 rounding
    return ~((kth > delta) | (lb * fp.scale >= delta / 2 + 1))


def out_of_range(
    index: PostingLists,
    batch: QueryBatch,
    fp: FixedPoint,
    scores: torch.Tensor,
    k: int,
    floor: torch.Tensor | None = None,
) -> np.ndarray:
    """Rows whose top-k may miss documents that scored below one fixed-point unit.

    Candidates are emitted from integer sums of at least 1, so a matching document whose
    sum rounded to 0 (its score more than ~2**31 times, "u32", or 2**61 times, "carry",
    below the query's bound) is never seen. That matters only where the k-th result is
    within the margin of 0 (fewer than k results above it): a row is certain when its k-th
    score exceeds the margin, or when every matching document provably sums to at least 1
    (the smallest query weight times the index's smallest weight, less half the margin).
    ``floor``: a bound the k-th score reaches (a ``cutoff``'s, see :func:`~.engine.tiled_search`), used
    where it exceeds the row's own k-th. One host sync.
    """
    return uncertain_rows(index, batch, fp, scores, k, None, floor).nonzero().flatten().cpu().numpy()
