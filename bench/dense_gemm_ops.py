"""Issue 23's dense phase as a GEMM: the operands and the exact integer arithmetic.

Used by ``bench/dense_gemm.py`` (timing on the device) and tested on the CPU
(``tests/test_bench_dense_gemm.py``). Nothing here is part of the package.

A tiled layout (:mod:`gpusparse.layout.tiled`) stores, per tile, the dense rows of its heavy
terms (one weight per document of the tile). For a group of consecutive tiles the rows are
laid out as one matrix ``D_g [K, G · 2**tile_bits]``: row ``j`` is term ``u_j`` of the
group's *union* of dense terms (sorted), holding that term's dense row in each tile of the
group and zeros in a tile where the term's segment is sparse (the sparse phase adds it
there). ``K`` is padded with zero rows to a multiple of ``pad`` (tensor-core shapes). The
batch's weights for those terms are ``Q_g [B, K]`` (0 where a query lacks the term), and
``S_g = Q_g · D_g`` is every query's dense contribution for every document of the group:
one 2-D GEMM per group, whatever the tiles' own dense counts (they differ by a few terms).

Exactness, in integers: 8-bit levels (documents' and each query's own power-of-two step)
and the fixed-point integers of float32 weights (``d = round(w · 2**b) < 2**30``, ``q =
round(w_q · mult) < 2**31``, see :mod:`gpusparse.engines.tiled.fixed_point`) are split into
*limbs* (``x = Σ_i x_i · 2**(a·i)``, each ``x_i < 2**a``); each limb pair is one GEMM
whose inputs are exact in the GEMM's input type and whose every partial sum is exact in its
accumulator:

* ``fp16``: limbs of at most 11 bits (fp16 holds integers ≤ 2048 exactly), float32
  accumulation, exact while each query's bound ``Σ_j q_i[j] · max d_l[j]`` is ≤ 2**24
  (checked per group on the operands themselves: the limb widths are the widest that pass);
  8-bit levels need one GEMM (a = b = 8) unless a query's bound exceeds 2**24;
* ``int8``: query limbs of 7 bits (non-negative int8), document limbs of 8 bits moved to
  int8 by ``d − 128``, int32 accumulation (``torch._int_mm``), then ``+ 128 · Σ_j q_i[j]``
  per query: exact while ``127 · 255 · K < 2**31``.

The result is ``X = Σ_{i,l} 2**(a·i + b·l) · P_il``: for 8-bit levels an int64 (X < 2**31),
for fixed point up to ~2**69, so :func:`combine_shift` returns the kernel's unit
``floor(X / 2**shift)`` exactly (int64) and :func:`combine_exact` the Python integers (tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP16_BITS = 11  # integers up to 2**11 are exact in fp16
FP32_EXACT = 1 << 24  # float32 sums of non-negative integers are exact up to here
INT8_Q_BITS, INT8_D_BITS = 7, 8
# How fp16 GEMMs with float32 output run: "out_dtype" (torch.mm(..., out_dtype=float32) on CUDA),
# "tf32" where that is missing (float32 inputs rounded to TF32: exact for limbs ≤ 11 bits, at
# half the fp16 rate), "cpu-float32" on a CPU. Recorded in the bench's JSON.
FP16_PATH = {"path": "out_dtype"}


# -- the layout's dense rows, grouped -------------------------------------------------


def tile_dense_rows(layout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_start, row_term)``: the dense rows of tile ``t`` are ``row_start[t]:row_start[t + 1]``
    (the layout's ``dense_start``; the build numbers them in (tile, term) order), ``row_term[r]``
    the term of row ``r``."""
    n_terms = layout.n_terms
    row_start = layout.dense_start.to(torch.int64)
    keys = torch.nonzero(layout.dense_id >= 0).flatten()  # ascending key = ascending row
    if keys.numel() and not torch.equal(layout.dense_rows(keys), torch.arange(keys.numel(), device=keys.device)):
        raise ValueError("dense rows are not numbered in (tile, term) order")
    return row_start, keys % n_terms


@dataclass(frozen=True)
class Group:
    """The dense operand of tiles ``[t0, t1)``: ``terms`` (int64 ``[K]``, the union of their dense
    terms, ascending; ``K`` real rows, then padding) and ``rows`` (``[Kp, (t1 − t0) · tile]``)."""

    t0: int
    t1: int
    terms: torch.Tensor
    rows: torch.Tensor  # the layout's weight dtype (uint8 levels or int32 fixed point)

    @property
    def k(self) -> int:
        return self.terms.numel()

    @property
    def k_padded(self) -> int:
        return self.rows.shape[0]


def group_operand(
    dense: torch.Tensor, row_start: torch.Tensor, row_term: torch.Tensor, t0: int, t1: int, pad: int = 16
) -> Group:
    """:class:`Group` of tiles ``[t0, t1)`` from the layout's ``dense`` rows (see the module docstring)."""
    tile = dense.shape[1]
    lo, hi = int(row_start[t0]), int(row_start[t1])
    dev = dense.device
    terms = row_term[lo:hi]
    tiles = torch.repeat_interleave(torch.arange(t0, t1, device=dev), torch.diff(row_start[t0 : t1 + 1])) - t0
    union, where = torch.unique(terms, return_inverse=True)
    kp = max(pad, -(-union.numel() // pad) * pad)
    rows = torch.zeros((kp, t1 - t0, tile), dtype=dense.dtype, device=dev)
    rows[where, tiles] = dense[lo:hi]
    return Group(t0, t1, union, rows.view(kp, (t1 - t0) * tile))


def groups(n_tiles: int, size: int) -> list[tuple[int, int]]:
    """Consecutive tiles in groups of ``size`` (the last may be smaller)."""
    return [(t, min(t + size, n_tiles)) for t in range(0, n_tiles, size)]


def query_matrix(terms: torch.Tensor, values: torch.Tensor, n_terms: int) -> torch.Tensor:
    """``[B, n_terms + 1]`` int64 from padded ``[B, T]`` term ids (-1 padding) and integer
    weights; the last column stays 0 (padding's slot)."""
    b = terms.shape[0]
    out = torch.zeros((b, n_terms + 1), dtype=torch.int64, device=terms.device)
    col = torch.where(terms >= 0, terms.to(torch.int64), n_terms)
    out.scatter_add_(1, col, torch.where(terms >= 0, values, torch.zeros_like(values)).to(torch.int64))
    out[:, n_terms] = 0
    return out


def group_queries(q: torch.Tensor, group: Group) -> torch.Tensor:
    """``Q_g [B, Kp]`` int64: the queries' integers for the group's terms, 0 in the padding."""
    out = torch.zeros((q.shape[0], group.k_padded), dtype=torch.int64, device=q.device)
    out[:, : group.k] = q[:, group.terms]
    return out


# -- query integers -----------------------------------------------------------------


def query_levels(weights: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(levels, step)``: each query's weights (dequantized 8-bit levels, ``[B, T]``, 0 padding)
    as integer levels of its own power-of-two step (the smallest that keeps levels < 2**bits).
    Raises if a weight is not such a level (queries not quantized)."""
    w = weights.to(torch.float64)
    top = w.max(1).values.clamp_min(torch.finfo(torch.float64).tiny)
    # the smallest power of two >= top / (2**bits - 1), from the binary exponent (exact; log2 on a GPU
    # could round across an integer and double the step)
    mant, expo = torch.frexp(top / ((1 << bits) - 1))
    step = torch.ldexp(torch.ones_like(top), expo - (mant == 0.5).to(expo.dtype))
    step = torch.where(top / step > (1 << bits) - 1, step * 2, step)  # guard the quotient's rounding
    lev = w / step[:, None]
    if not torch.equal(lev, torch.round(lev)) or bool((lev >= 1 << bits).any()):
        raise ValueError("query weights are not levels of a power-of-two step (quantize the queries)")
    return lev.to(torch.int64), step


def fixed_query_ints(weights: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """The kernel's query integers ``round(w · mult)`` (half to even, as ``__double2uint_rn``), int64."""
    return torch.round(weights.to(torch.float64) * mult.to(torch.float64)[:, None]).to(torch.int64)


def fixed_doc_ints(rows: torch.Tensor, weight_bits: int) -> torch.Tensor:
    """A fixed-point layout's document integers: stored (int32) or ``round(w · 2**b)`` of float32."""
    if rows.dtype == torch.float32:
        return torch.round(rows.to(torch.float64) * 2.0**weight_bits).to(torch.int64)
    return rows.to(torch.int64)


# -- limbs and exact GEMMs -------------------------------------------------------------


def bit_width(x: torch.Tensor) -> int:
    """Bits of the largest (non-negative) value, at least 1."""
    top = int(x.max()) if x.numel() else 0
    return max(1, top.bit_length())


def limbs(x: torch.Tensor, bits: int, n: int) -> list[torch.Tensor]:
    """``x = Σ_i limbs[i] · 2**(bits · i)``, each ``0 ≤ limbs[i] < 2**bits`` (int64, ``x ≥ 0``)."""
    mask = (1 << bits) - 1
    return [(x >> (bits * i)) & mask for i in range(n)]


@dataclass(frozen=True)
class Plan:
    """A limb split: query limbs of ``a`` bits (``n_q`` of them), document limbs of ``b`` bits."""

    kind: str  # "fp16" or "int8"
    a: int
    n_q: int
    b: int
    n_d: int

    @property
    def gemms(self) -> int:
        return self.n_q * self.n_d


def plan_fp16(q: torch.Tensor, d: torch.Tensor, limit: int = FP32_EXACT) -> Plan:
    """The fp16 split with the fewest GEMMs whose every partial sum stays ≤ ``limit``: for each
    limb pair, per query ``Σ_j q_i[j] · bound_l[j]`` (float64, exact below 2**53), where
    ``bound_l[j]`` bounds row ``j``'s document limb ``l`` (from the row's largest value)."""
    qb, db = bit_width(q), bit_width(d)
    row_max = d.max(1).values if d.shape[1] else torch.zeros(d.shape[0], dtype=torch.int64, device=d.device)
    splits = sorted(
        (math.ceil(qb / a) * math.ceil(db / b), -(a + b), a, b)
        for a in range(1, min(qb, FP16_BITS) + 1)
        for b in range(1, min(db, FP16_BITS) + 1)
    )
    for _, _, a, b in splits:
        n_q, n_d = math.ceil(qb / a), math.ceil(db / b)
        d_bounds = [torch.clamp(row_max >> (b * j), max=(1 << b) - 1) for j in range(n_d)]
        if _fits(limbs(q, a, n_q), d_bounds, limit):
            return Plan("fp16", a, n_q, b, n_d)
    raise ValueError("no fp16 limb split is exact for these operands")


def _fits(q_limbs: list[torch.Tensor], d_bounds: list[torch.Tensor], limit: int) -> bool:
    if not q_limbs[0].numel():
        return True
    qs = torch.cat(q_limbs).to(torch.float64)  # [n_q · B, K]
    return float((qs @ torch.stack(d_bounds, 1).to(torch.float64)).max()) <= limit


def plan_int8(q: torch.Tensor, d: torch.Tensor) -> Plan:
    """Query limbs of 7 bits, document limbs of 8 (offset by −128): exact in int32 for K < 66,000."""
    if q.shape[1] * 127 * 255 >= 1 << 31:
        raise ValueError("K too large for int32 accumulation")
    qb, db = bit_width(q), bit_width(d)
    return Plan("int8", INT8_Q_BITS, math.ceil(qb / INT8_Q_BITS), INT8_D_BITS, math.ceil(db / INT8_D_BITS))


@dataclass
class Prepared:
    """A plan's GEMM inputs on the device: query limbs stacked along M (``[n_q · B, Kp]``), one
    document limb matrix per ``l``; :meth:`run` issues only the GEMMs (what the bench times)."""

    plan: Plan
    q_stack: torch.Tensor
    d_limbs: list[torch.Tensor]
    q_sums: torch.Tensor | None  # int8: Σ_j q_i[j] per stacked row (the offset's correction)
    batch: int

    def run(self) -> list[torch.Tensor]:
        """One GEMM per document limb: ``[n_q · B, N]`` partials (float32 or int32)."""
        if self.plan.kind == "int8":
            return [torch._int_mm(self.q_stack, dl) for dl in self.d_limbs]
        if self.q_stack.is_cuda and FP16_PATH["path"] == "out_dtype":
            try:
                return [torch.mm(self.q_stack, dl, out_dtype=torch.float32) for dl in self.d_limbs]
            except (TypeError, RuntimeError):  # a torch without mm's out_dtype
                FP16_PATH["path"] = "tf32"
        if self.q_stack.is_cuda:
            before = torch.backends.cuda.matmul.allow_tf32  # a process-wide switch: put it back after
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                return [torch.mm(self.q_stack.float(), dl.float()) for dl in self.d_limbs]
            finally:
                torch.backends.cuda.matmul.allow_tf32 = before
        # the CPU has no fp16 GEMM with float32 output: the same values in float32 (exact below 2**24 in any order)
        FP16_PATH["path"] = "cpu-float32"
        return [torch.mm(self.q_stack.float(), dl.float()) for dl in self.d_limbs]

    def partials(self, outs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``P[i][l]`` exact int64 ``[B, N]`` from :meth:`run`'s outputs (the int8 offset undone)."""
        b = self.batch
        out = []
        for i in range(self.plan.n_q):
            row = []
            for o in outs:
                p = o[i * b : (i + 1) * b].to(torch.int64)
                if self.q_sums is not None:
                    p = p + (self.q_sums[i * b : (i + 1) * b, None] << 7)  # + 128 · Σ_j q_i[j]
                row.append(p)
            out.append(row)
        return out


def prepare(plan: Plan, q: torch.Tensor, d: torch.Tensor) -> Prepared:
    """The plan's inputs from int64 ``q [B, Kp]`` and ``d [Kp, N]`` (non-negative integers)."""
    q_limbs = limbs(q, plan.a, plan.n_q)
    d_limbs = limbs(d, plan.b, plan.n_d)
    if plan.kind == "int8":
        q_stack = torch.cat(q_limbs).to(torch.int8).contiguous()
        sums = torch.cat(q_limbs).sum(1)
        return Prepared(plan, q_stack, [(dl - 128).to(torch.int8).contiguous() for dl in d_limbs], sums, q.shape[0])
    return Prepared(plan, torch.cat(q_limbs).to(torch.float16), [dl.to(torch.float16) for dl in d_limbs], None,
                    q.shape[0])  # fmt: skip


def combine_int64(plan: Plan, p: list[list[torch.Tensor]]) -> torch.Tensor:
    """``X = Σ 2**(a·i + b·l) · P_il`` as int64 (refused where it could overflow: use :func:`combine_shift`)."""
    top = plan.a * plan.n_q + plan.b * plan.n_d + 32  # ≥ bits of X (K < 2**32)
    if top > 63:
        raise ValueError("X may exceed int64: combine_shift")
    x = torch.zeros_like(p[0][0])
    for i, row in enumerate(p):
        for j, pij in enumerate(row):
            x += pij << (plan.a * i + plan.b * j)
    return x


def combine_shift(plan: Plan, p: list[list[torch.Tensor]], shift: torch.Tensor) -> torch.Tensor:
    """``floor(X / 2**shift[q])`` exactly, int64 ``[B, N]`` (``shift`` int ``[B]``, 0..61; the
    result must fit int64). Each term ``P · 2**e`` (``0 ≤ P < 2**31``) is cut into its whole
    units and a remainder below ``2**shift``; the remainders are added with a carry, so no sum
    reaches ``2**63``."""
    sh = shift.to(torch.int64)[:, None]
    if bool((sh < 0).any()) or bool((sh > 61).any()):
        raise ValueError("shift must be in 0..61")
    units = torch.zeros_like(p[0][0])
    rem = torch.zeros_like(units)
    low = (torch.ones_like(sh) << sh) - 1
    for i, row in enumerate(p):
        for j, pij in enumerate(row):
            e = plan.a * i + plan.b * j
            up = e - sh  # ≥ 0: P · 2**up whole units; < 0: P >> −up units, the cut bits a remainder
            down = (-up).clamp(0, 62)
            whole = torch.where(up >= 0, pij << up.clamp(0, 62), pij >> down)
            cut = torch.where(up >= 0, torch.zeros_like(pij), (pij & ((torch.ones_like(down) << down) - 1)) << e)
            units += whole
            rem += cut  # both < 2**shift ≤ 2**61
            units += rem >> sh
            rem &= low
    return units


def combine_exact(plan: Plan, p: list[list[torch.Tensor]]) -> list[list[int]]:
    """``X`` as Python integers (tests: no overflow anywhere)."""
    rows, cols = p[0][0].shape
    out = [[0] * cols for _ in range(rows)]
    for i, row in enumerate(p):
        for j, pij in enumerate(row):
            e = plan.a * i + plan.b * j
            vals = pij.tolist()
            for r in range(rows):
                for c in range(cols):
                    out[r][c] += vals[r][c] << e
    return out


def exact_dense_gemm(q: torch.Tensor, d: torch.Tensor, kind: str, limit: int = FP32_EXACT) -> tuple[Plan, list]:
    """Plan, prepare and run one group's GEMM: ``(plan, P[i][l])`` (exact int64 partials)."""
    plan = plan_fp16(q, d, limit) if kind == "fp16" else plan_int8(q, d)
    prep = prepare(plan, q, d)
    return plan, prep.partials(prep.run())
