"""Fused scatter-add scoring: the GPUSparse paper's ``_fast_scatter_add_kernel``.

One program per (query, query-term position): it walks its term's posting list in chunks
of ``BLOCK_PL`` postings and atomically adds ``w_q · w_d`` into the ``[B, W]`` float32
score buffer of the document chunk ``[d0, d0 + W)``. Work is proportional to the postings
read, but the adds land at scattered addresses, in no fixed order: the scores are
float32 sums in arbitrary order, which :func:`gpusparse.exact.select_exact_topk` then
turns into the exact top-k.
"""

from __future__ import annotations

import os

import torch

from ..layout.postings import MAX_DOCS, PostingLists, bisect_lists
from ..queries import QueryBatch
from . import TRITON_HINT

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(TRITON_HINT) from e


# CUDA limits grid axes 1 and 2 to 65535 programs.
_MAX_GRID_YZ = 65535


@triton.jit
def _scatter_add_kernel(
    terms_ptr,  # int64 [B, T]: query terms, -1 for padding
    qweights_ptr,  # float32 [B, T]: query weights
    start_ptr,  # int64 [B, T]: first posting position to read
    end_ptr,  # int64 [B, T]: one past the last
    doc_ids_ptr,  # int32 [P]: the index's flat posting arrays
    scores_ptr,  # float32 [P]
    out_ptr,  # float32 [B, W], zeroed
    d0,  # first document of the chunk
    width,  # W, documents in the chunk
    n_cols,  # T
    BLOCK_PL: tl.constexpr,
):
    """Scatter-add one query term's postings into its query's score row.

    With ``b = program_id(0)``, ``j = program_id(1)``, ``t = terms[b, j]`` and
    ``w_q = qweights[b, j]``: for every position ``p`` in ``[start[b, j], end[b, j])``
    with ``d = doc_ids[p]`` and ``d0 ≤ d < d0 + W``,

        out[b, d - d0] += w_q · scores[p]        (atomically, in float32)

    Padding terms (``t = -1``) and padding postings (``d = -1``) add nothing.
    """
    b = tl.program_id(0)
    j = tl.program_id(1)
    # int64 before multiplying: B·T is small, but B·W passes 2**31 for large chunks
    # (500 queries × 8.8M documents).
    pair = b.to(tl.int64) * n_cols + j
    term = tl.load(terms_ptr + pair)
    if term < 0:
        return
    w_q = tl.load(qweights_ptr + pair)
    start = tl.load(start_ptr + pair)
    end = tl.load(end_ptr + pair)
    out_row = out_ptr + b.to(tl.int64) * width
    # Positions are int64 (start is): the flat arrays may hold more than 2**31 postings.
    for chunk in range(start, end, BLOCK_PL):
        pos = chunk + tl.arange(0, BLOCK_PL)
        in_range = pos < end
        doc = tl.load(doc_ids_ptr + pos, mask=in_range, other=-1)
        w_d = tl.load(scores_ptr + pos, mask=in_range, other=0.0)
        col = doc - d0
        # doc >= 0 drops padding; the column test drops documents outside the chunk
        # (the whole list is walked when the chunk covers the collection).
        hit = in_range & (doc >= 0) & (col >= 0) & (col < width)
        # Only atomicity matters, not ordering against other memory: relaxed is enough.
        tl.atomic_add(out_row + col, w_q * w_d, mask=hit, sem="relaxed")


def scatter_add_scores(
    index: PostingLists,
    batch: QueryBatch,
    d0: int,
    width: int,
    out: torch.Tensor | None = None,
    *,
    block_pl: int = 128,
) -> torch.Tensor:
    """Scores of documents ``d0 .. d0 + width - 1`` for a query batch, by fused scatter-add.

    Args:
        index: the inverted index, on a CUDA device (or on the CPU under
            ``TRITON_INTERPRET=1``).
        batch: queries from :func:`gpusparse.queries.query_batch`, on the index's device.
        d0: first document of the chunk (``0 ≤ d0 < 2**31``).
        width: documents in the chunk; columns past the collection's end score 0.
        out: optional float32 ``[B, width]`` contiguous buffer on the index's device;
            it is zeroed, then filled.
        block_pl: postings each program reads per step, a power of two ≥ 16.

    Returns:
        ``out`` (or a new buffer): float32 ``[B, width]``, ``out[b, c]`` the float32 sum in
        arbitrary order of ``w_q · w_d`` over the terms query ``b`` shares with document
        ``d0 + c``; exactly 0 where it shares none.

    Raises:
        TypeError: wrong argument types or dtypes.
        ValueError: wrong shapes, devices or values.
    """
    check_block("block_pl", block_pl, 16)
    out = _check_launch(index, batch, d0, width, out)
    out.zero_()  # atomics add into it
    b, t = batch.padded_terms.shape
    if b == 0 or t == 0 or width == 0:
        return out
    if t > _MAX_GRID_YZ:
        raise ValueError(f"queries of {t} terms exceed the {_MAX_GRID_YZ} programs of grid axis 1")
    start, end = _posting_ranges(index, batch, d0, width)
    _scatter_add_kernel[(b, t)](
        batch.padded_terms.contiguous(),
        batch.padded_weights.contiguous(),
        start,
        end,
        index.doc_ids,
        index.scores,
        out,
        d0,
        width,
        t,
        BLOCK_PL=block_pl,
        # One posting per thread and step.
        num_warps=max(1, min(8, block_pl // 32)),
    )
    return out


def _posting_ranges(index: PostingLists, batch: QueryBatch, d0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (query, term position), the posting positions ``[start, end)`` to read, int64 ``[B, T]``.

    For a chunk covering the whole collection, a term's whole padded list (padding is
    masked by the kernel); otherwise only its postings with ``d0 ≤ doc < d0 + width``,
    found by binary search (doc ids ascend inside each list). Padding terms get an empty
    range.
    """

    terms = batch.padded_terms
    valid = terms >= 0
    safe = torch.where(valid, terms, torch.zeros_like(terms))
    zero = torch.zeros_like(terms)
    start = torch.where(valid, index.offsets[safe], zero)
    if d0 == 0 and width >= index.n_docs:
        end = start + torch.where(valid, index.padded_lengths[safe].to(torch.int64), zero)
        return start.contiguous(), end.contiguous()
    # Search the real postings only: padding (-1) would break the ascending order.
    real_end = start + torch.where(valid, index.lengths[safe].to(torch.int64), zero)
    lo = bisect_lists(index.doc_ids, start, real_end, d0)
    hi = bisect_lists(index.doc_ids, lo, real_end, d0 + width)
    return lo.contiguous(), hi.contiguous()


def check_block(name: str, value: int, minimum: int) -> None:
    """A block size must be an int and a power of two ≥ ``minimum`` (Triton block shapes are)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two ≥ {minimum} (Triton block shapes are), not {value}")


def _check_launch(
    index: PostingLists, batch: QueryBatch, d0: int, width: int, out: torch.Tensor | None
) -> torch.Tensor:
    """Validate what every score kernel takes; return ``out`` or a new float32 ``[B, width]`` buffer.

    A new buffer is uninitialised: launchers whose kernels do not write every cell zero it.
    """

    if not isinstance(index, PostingLists):
        raise TypeError(f"index must be a gpusparse.Index, not {type(index).__name__}")
    if not isinstance(batch, QueryBatch):
        raise TypeError(f"batch must be a QueryBatch (gpusparse.queries.query_batch), not {type(batch).__name__}")
    for name, value in (("d0", d0), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= d0 <= MAX_DOCS:
        raise ValueError(f"d0 must be in [0, {MAX_DOCS}], not {d0}")
    if width < 0:
        raise ValueError(f"width must be ≥ 0, not {width}")
    dev = index.device
    for name, want in (
        ("doc_ids", torch.int32),
        ("scores", torch.float32),
        ("offsets", torch.int64),
        ("lengths", torch.int32),
        ("padded_lengths", torch.int32),
    ):
        arr = getattr(index, name)
        if arr.dtype != want:
            raise TypeError(f"index.{name} must be {want}, not {arr.dtype}")
        if not arr.is_contiguous():
            raise ValueError(f"index.{name} must be contiguous")
        if arr.device != dev:
            raise ValueError(f"index.{name} is on {arr.device}, the index's doc_ids on {dev}")
    terms, weights = batch.padded_terms, batch.padded_weights
    if terms.dim() != 2 or weights.shape != terms.shape:
        raise ValueError(
            f"padded_terms and padded_weights must both be [B, T], not {tuple(terms.shape)} and {tuple(weights.shape)}"
        )
    if terms.dtype != torch.int64:
        raise TypeError(f"padded_terms must be int64, not {terms.dtype}")
    if weights.dtype != torch.float32:
        raise TypeError(f"padded_weights must be float32, not {weights.dtype}")
    if batch.n_terms.shape != terms.shape[:1]:
        raise ValueError(f"n_terms must be [B] = [{terms.shape[0]}], not {list(batch.n_terms.shape)}")
    for name in ("padded_terms", "padded_weights", "n_terms"):
        if getattr(batch, name).device != dev:
            raise ValueError(f"batch.{name} is on {getattr(batch, name).device} but the index on {dev}")
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the index is on {dev}: the Triton kernels need a CUDA device (index.to('cuda')), "
            "or TRITON_INTERPRET=1 set before Triton is imported"
        )
    shape = (terms.shape[0], width)
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=dev)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, not {type(out).__name__}")
    if out.dtype != torch.float32:
        raise TypeError(f"out must be float32, not {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {list(shape)} ([B, width]), not {list(out.shape)}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.device != dev:
        raise ValueError(f"out is on {out.device} but the index on {dev}")
    return out
