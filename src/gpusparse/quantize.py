"""Quantized impacts: weights as small integer levels times a power-of-two step.

Lucene, PISA and BMP store SPLADE weights as 8-bit impacts. Here a quantized index keeps
each document weight as ``level · step`` (``level < 2**bits``, ``step`` a power of two
shared by the collection) and each query's weights as ``level · step_q`` with the query's
own power-of-two step. The dequantized values are exact float32 numbers, so every kernel
ranks them exactly as before (the search contract is unchanged: canonical float32 scores,
ties by document number); the tiled engine then stores 8-bit levels instead of float32
weights and accumulates integers. Rounding to levels is lossy: weights below half a step
vanish (counted in :class:`QuantizeReport`), and the ranking is the quantized vectors'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .collection import SparseCollection
from .queries_native import quantized_rows

MAX_BITS = 8  # the tiled engine stores levels in one byte


@dataclass(frozen=True)
class Quantization:
    """How an index's document weights were quantized: ``weight = level · step``."""

    bits: int
    step: float  # a power of two

    def to_dict(self) -> dict[str, float | int]:
        """For the index manifest."""
        return {"bits": self.bits, "step": self.step}

    @classmethod
    def from_dict(cls, d: dict[str, float | int]) -> Quantization:
        """Inverse of :meth:`to_dict` (checked)."""
        q = cls(int(d["bits"]), float(d["step"]))
        check_bits(q.bits)
        if not (q.step > 0 and math.frexp(q.step)[0] == 0.5):
            raise ValueError(f"quantization step {q.step} is not a positive power of two")
        return q


@dataclass(frozen=True)
class QuantizeReport:
    """What quantizing a collection did: weights kept, and those that rounded to zero."""

    quantization: Quantization
    n_weights: int
    n_dropped: int


def check_bits(bits: int) -> None:
    """Refuse level widths the engine cannot store."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"quantization bits must be an integer in 1..{MAX_BITS}, got {bits!r}")


def power_of_two_step(max_weight: float, bits: int) -> float:
    """The smallest power of two ``step`` with ``max_weight / step ≤ 2**bits − 1``."""
    check_bits(bits)
    if not max_weight > 0:
        return 1.0
    step = 2.0 ** math.ceil(math.log2(max_weight / ((1 << bits) - 1)))
    while max_weight / step > (1 << bits) - 1:  # guard log2's rounding
        step *= 2
    return step


def power_of_two_steps(max_weights: np.ndarray, bits: int) -> np.ndarray:
    """:func:`power_of_two_step` of each of ``max_weights`` (float64), vectorised (a batch's
    queries each have their own step).

    Exact, from the binary exponent: with ``m = f · 2**x`` (``f`` in [0.5, 1)) and
    ``top = 2**bits − 1`` in ``[2**(bits−1), 2**bits)``, the smallest ``e`` with
    ``m ≤ top · 2**e`` is ``x − bits`` or one more (both sides exact: ``top · 2**e`` is a
    float64). :func:`power_of_two_step` finds the same with ``log2`` and its guard (tested, at
    the boundaries too)."""
    check_bits(bits)
    m = np.asarray(max_weights, dtype=np.float64)
    _, e = np.frexp(m)
    e -= bits
    e += m > np.ldexp(float((1 << bits) - 1), e)
    return np.where(m > 0, np.ldexp(1.0, e), 1.0)


def levels(values: torch.Tensor, step: float | torch.Tensor, bits: int) -> torch.Tensor:
    """``round(values / step)`` (half to even) as int64, clipped to the ``bits`` range."""
    return torch.round(values.to(torch.float64) / step).clamp_(0, (1 << bits) - 1).to(torch.int64)


def quantize_csr(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    bits: int,
    step: float | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], QuantizeReport]:
    """Quantize CSR rows with one shared step (default: from the largest weight).

    Returns the rows with dequantized float32 weights (``level · step``, exact) and zero
    levels removed, and a report. Works on the tensors' device.
    """
    check_bits(bits)
    if step is None:
        step = power_of_two_step(float(values.max()) if values.numel() else 0.0, bits)
    csr, n_dropped = _to_levels(indptr, indices, values, step, bits)
    return csr, QuantizeReport(Quantization(bits, step), int(values.numel()), n_dropped)


def _to_levels(
    indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, step: float | torch.Tensor, bits: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """Rows as ``level · step`` (``step`` shared, or one per value), zero levels removed;
    and how many were removed."""
    lev = levels(values, step, bits)
    keep = lev > 0
    rows = torch.repeat_interleave(torch.arange(indptr.numel() - 1, device=indptr.device), torch.diff(indptr))
    counts = torch.bincount(rows[keep], minlength=indptr.numel() - 1)
    new_indptr = torch.zeros_like(indptr)
    torch.cumsum(counts, 0, out=new_indptr[1:])
    kept_step = step[keep] if isinstance(step, torch.Tensor) else step
    new_values = (lev[keep].to(torch.float64) * kept_step).to(torch.float32)
    return (new_indptr, indices[keep], new_values), int((~keep).sum())


def quantize_collection(
    collection: SparseCollection, bits: int, step: float | None = None
) -> tuple[SparseCollection, QuantizeReport]:
    """A :class:`SparseCollection` quantized with one shared step (see :func:`quantize_csr`)."""
    (indptr, indices, values), report = quantize_csr(
        torch.from_numpy(collection.indptr.astype(np.int64)),
        torch.from_numpy(collection.indices),
        torch.from_numpy(collection.values),
        bits,
        step,
    )
    out = SparseCollection(
        indptr.numpy(), indices.numpy(), values.numpy(), vocab=collection.vocab, ids=list(collection.ids)
    )
    return out, report


def quantize_to(
    collection: SparseCollection, quantization: Quantization, *, clip: bool = False
) -> tuple[SparseCollection, QuantizeReport]:
    """``collection`` quantized with an existing index's ``quantization`` (same bits, same step),
    as documents added to that index must be, so that they score as in a fresh build.

    A weight whose level would exceed ``2**bits - 1`` (above ``(2**bits - 1) · step`` by half
    a step or more) cannot be stored at that scale: it is refused with :class:`InputError`
    naming the document, unless ``clip``, which stores it as the largest level (what a fresh
    build with that step does). Weights below half a step are dropped, as in any build.
    """
    from .errors import InputError

    top = (1 << quantization.bits) - 1
    values = collection.values
    if not clip and values.size:
        at = int(np.argmax(values))
        w = float(values[at])
        if round(w / quantization.step) > top:  # Python's round is half to even, as levels()
            row = int(np.searchsorted(collection.indptr, at, side="right")) - 1
            term = collection.vocab.token(int(collection.indices[at]))
            limit = top * quantization.step
            raise InputError(
                f"document {collection.ids[row]!r} has weight {w:g} for term {term!r}, above {limit:g}, the largest "
                f"the index's {quantization.bits}-bit impacts store (step {quantization.step:g}); clip the weights "
                f"to {limit:g} (SegmentedIndex.add(..., clip=True) does), or rebuild the index from all documents "
                f"with gpusparse index --quantize {quantization.bits} (a new step)",
                field="vector",
            )
    return quantize_collection(collection, quantization.bits, quantization.step)


def quantize_queries(queries: SparseCollection, bits: int) -> SparseCollection:
    """Each query quantized with its own power-of-two step, so its result never depends on
    the other queries of a batch. Terms rounding to zero are dropped.

    In one C pass (:func:`~gpusparse.queries_native.quantized_rows`), else numpy (the
    rounding of :func:`levels`: half to even; no clipping is needed, as no weight exceeds its
    row's largest, ``≤ (2**bits − 1) · step``): every search of a quantized index passes here,
    before its batch's launch. Numpy takes one query's step from a Python float
    (:func:`power_of_two_step`, equal to :func:`power_of_two_steps`: tested). The result is
    built from canonical arrays without the constructor's checks
    (:meth:`SparseCollection.from_canonical`); on the numpy path the arrays are shared with
    ``queries`` where no term is dropped. A weight near float32's largest can round up to a
    level whose ``level · step`` is ``inf``: :func:`~gpusparse.queries.check_score_bound` then
    refuses the query."""
    check_bits(bits)
    n = len(queries)
    indptr = queries.indptr
    native = quantized_rows(indptr, queries.indices, queries.values, bits)  # one C pass: the same arrays
    if native is not None:
        indptr, indices, new_values = native
        return SparseCollection.from_canonical(indptr, indices, new_values, queries.ids, queries.vocab)
    values = queries.values.astype(np.float64)
    if n == 1:
        step_of: float | np.ndarray = power_of_two_step(float(values.max()) if values.size else 0.0, bits)
    else:
        lens = indptr[1:] - indptr[:-1]
        nonempty = lens > 0
        row_max = np.zeros(n)
        if values.size:
            row_max[nonempty] = np.maximum.reduceat(values, indptr[:-1][nonempty])
        step_of = np.repeat(power_of_two_steps(row_max, bits), lens)
    new_values = (np.round(values / step_of) * step_of).astype(np.float32)
    keep = new_values > 0  # level 0 (level · step is a float32 exactly: 0 only then)
    indices = queries.indices
    if not keep.all():
        counts = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(keep, out=counts[1:])
        indptr = counts[indptr]
        indices, new_values = indices[keep], new_values[keep]
    # the ids were checked when ``queries`` was made (checking them again cost ~2 µs a query)
    return SparseCollection.from_canonical(indptr, indices, new_values, queries.ids, queries.vocab)
