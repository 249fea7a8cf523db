"""Document-parallel CSR scoring: the GPUSparse paper's contrast kernel.

A document-major (CSR) copy of the collection is walked one block of ``BLOCK_D``
documents per program, one program per (query, block); each document's terms look their
query weights up in a dense ``[B, V]`` query matrix. No atomics and each score is stored
once, but every query reads every document of the chunk, whatever its terms: the paper
measured it 5× slower than scatter-add.
"""

from __future__ import annotations

import torch

from ..layout.postings import PostingLists
from ..queries import QueryBatch
from . import TRITON_HINT
from .scatter import _check_launch, check_block  # the output contract is scatter's

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - scatter's import fails first
    raise ImportError(TRITON_HINT) from e


# Terms of one document read per step: one 128-byte row of int32 term ids per document.
# SPLADE passages hold ~120 terms, so about four steps.
_BLOCK_T = 32
_MAX_GRID_X = 2**31 - 1


@triton.jit
def _docpar_kernel(
    indptr_ptr,  # int64 [N + 1]: document d's terms are at indptr[d] .. indptr[d + 1]
    terms_ptr,  # int32 [nnz]: term ids, ascending inside each document
    weights_ptr,  # float32 [nnz]: document weights
    qmat_ptr,  # float32 [B, q_stride]: dense query weights, 0 for absent terms
    out_ptr,  # float32 [B, W]
    n_queries,  # B
    n_docs,  # N
    q_stride,  # row stride of qmat (≥ V)
    d0,  # first document of the chunk
    width,  # W, documents in the chunk
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Score one block of documents for one query.

    With ``b = pid mod B`` and columns ``c`` of block ``pid div B``:

        out[b, c] = Σ_{i ∈ [indptr[d], indptr[d + 1])} Q[b, terms[i]] · weights[i],  d = d0 + c

    accumulated in float32 registers and stored once; 0 for documents past the
    collection's end. Columns ``c ≥ W`` are not written.
    """
    pid = tl.program_id(0)
    # Queries vary fastest: programs running together read the same documents, which are
    # then fetched from DRAM about once and served to the other queries from L2.
    b = pid % n_queries
    blk = pid // n_queries
    # int64: d0 + c and b·W can pass 2**31.
    col = blk.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    doc = d0 + col
    live = (col < width) & (doc < n_docs)
    lo = tl.load(indptr_ptr + doc, mask=live, other=0)
    hi = tl.load(indptr_ptr + doc + 1, mask=live, other=0)
    n = hi - lo  # 0 for columns without a document
    q_row = qmat_ptr + b.to(tl.int64) * q_stride
    acc = tl.zeros((BLOCK_D, BLOCK_T), dtype=tl.float32)
    # Each row of the tile walks one document; the block steps until its longest is done.
    for k0 in range(0, tl.max(n, axis=0), BLOCK_T):
        k = k0 + tl.arange(0, BLOCK_T)
        m = k[None, :] < n[:, None]
        pos = lo[:, None] + k[None, :]
        t = tl.load(terms_ptr + pos, mask=m, other=0)
        w_d = tl.load(weights_ptr + pos, mask=m, other=0.0)
        w_q = tl.load(q_row + t, mask=m, other=0.0)
        acc += w_q * w_d
    score = tl.sum(acc, axis=1)
    tl.store(out_ptr + b.to(tl.int64) * width + col, score, mask=col < width)


def docpar_scores(
    index: PostingLists,
    batch: QueryBatch,
    d0: int,
    width: int,
    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    block_d: int = 32,
) -> torch.Tensor:
    """Scores of documents ``d0 .. d0 + width - 1`` for a query batch, document-parallel.

    Args:
        index: the inverted index (for its size, vocabulary and device), on a CUDA device
            (or on the CPU under ``TRITON_INTERPRET=1``).
        batch: queries from :func:`gpusparse.queries.query_batch`, on the index's device.
        d0: first document of the chunk (``0 ≤ d0 < 2**31``).
        width: documents in the chunk; columns past the collection's end score 0.
        forward: :func:`~gpusparse.layout.forward.forward_index` of ``index``, on the same device.
        out: optional float32 ``[B, width]`` contiguous buffer on the index's device;
            every cell is overwritten.
        block_d: documents per program, a power of two ≥ 1.

    Returns:
        ``out`` (or a new buffer): float32 ``[B, width]``, ``out[b, c]`` the float32 sum in
        arbitrary order of ``w_q · w_d`` over the terms query ``b`` shares with document
        ``d0 + c``; exactly 0 where it shares none.

    Raises:
        TypeError: wrong argument types or dtypes.
        ValueError: wrong shapes, devices or values.
    """
    check_block("block_d", block_d, 1)
    # The kernel stores every cell of out (0 where nothing matches): no zeroing needed.
    out = _check_launch(index, batch, d0, width, out)
    indptr, terms, weights = _check_forward(index, forward)
    b = batch.padded_terms.shape[0]
    if b == 0 or width == 0:
        return out
    n_blocks = triton.cdiv(width, block_d)
    if b * n_blocks > _MAX_GRID_X:
        raise ValueError(f"{b} queries × {n_blocks} document blocks exceed {_MAX_GRID_X} programs: lower width")
    # Dense query weights, one spare column V where padding terms (-1) write their 0.
    n_terms = index.offsets.numel()
    qmat = torch.zeros((b, n_terms + 1), dtype=torch.float32, device=out.device)
    cols = batch.padded_terms
    qmat.scatter_(1, torch.where(cols >= 0, cols, torch.full_like(cols, n_terms)), batch.padded_weights)
    _docpar_kernel[(b * n_blocks,)](
        indptr,
        terms,
        weights,
        qmat,
        out,
        b,
        index.n_docs,
        n_terms + 1,
        d0,
        width,
        BLOCK_D=block_d,
        BLOCK_T=_BLOCK_T,
        # About eight tile elements per thread.
        num_warps=max(1, min(8, block_d * _BLOCK_T // 256)),
    )
    return out


def _check_forward(
    index: PostingLists, forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate a :func:`~gpusparse.layout.forward.forward_index` triple against ``index`` (shapes, dtypes, device)."""
    if not (isinstance(forward, tuple | list) and len(forward) == 3):
        raise TypeError("forward must be the (indptr, terms, weights) triple of forward_index(index)")
    indptr, terms, weights = forward
    for name, arr, want in (
        ("indptr", indptr, torch.int64),
        ("terms", terms, torch.int32),
        ("weights", weights, torch.float32),
    ):
        if not isinstance(arr, torch.Tensor):
            raise TypeError(f"forward {name} must be a torch.Tensor, not {type(arr).__name__}")
        if arr.dtype != want:
            raise TypeError(f"forward {name} must be {want}, not {arr.dtype}")
        if arr.dim() != 1 or not arr.is_contiguous():
            raise ValueError(f"forward {name} must be a contiguous 1-D tensor")
        if arr.device != index.device:
            raise ValueError(f"forward {name} is on {arr.device} but the index on {index.device}")
    if indptr.numel() != index.n_docs + 1:
        raise ValueError(f"forward indptr has {indptr.numel()} entries, not n_docs + 1 = {index.n_docs + 1}")
    if terms.shape != weights.shape:
        raise ValueError(f"forward terms and weights differ in length: {terms.numel()} and {weights.numel()}")
    return indptr, terms, weights
