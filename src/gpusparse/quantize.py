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
    lev = levels(values, step, bits)
    keep = lev > 0
    rows = torch.repeat_interleave(torch.arange(indptr.numel() - 1, device=indptr.device), torch.diff(indptr))
    counts = torch.bincount(rows[keep], minlength=indptr.numel() - 1)
    new_indptr = torch.zeros_like(indptr)
    torch.cumsum(counts, 0, out=new_indptr[1:])
    new_values = (lev[keep].to(torch.float64) * step).to(torch.float32)
    report = QuantizeReport(Quantization(bits, step), int(values.numel()), int((~keep).sum()))
    return (new_indptr, indices[keep], new_values), report


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


def quantize_queries(queries: SparseCollection, bits: int) -> SparseCollection:
    """Each query quantized with its own power-of-two step, so its result never depends on
    the other queries of a batch. Terms rounding to zero are dropped."""
    check_bits(bits)
    indptr = queries.indptr.astype(np.int64)
    values = queries.values.astype(np.float64)
    lens = np.diff(indptr)
    row_max = np.zeros(len(lens))
    nonempty = lens > 0
    row_max[nonempty] = np.maximum.reduceat(values, indptr[:-1][nonempty]) if values.size else 0.0
    steps = np.array([power_of_two_step(float(m), bits) for m in row_max])
    per_value = np.repeat(steps, lens)
    lev = np.clip(np.rint(values / per_value), 0, (1 << bits) - 1)
    keep = lev > 0
    counts = np.bincount(np.repeat(np.arange(len(lens)), lens)[keep], minlength=len(lens))
    new_indptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_indptr[1:])
    new_values = (lev[keep] * per_value[keep]).astype(np.float32)
    return SparseCollection(new_indptr, queries.indices[keep], new_values, vocab=queries.vocab, ids=list(queries.ids))
