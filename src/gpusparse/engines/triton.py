"""The paper's two Triton kernels as engines: fused scatter-add (``scatter``) and the
document-parallel CSR kernel (``docpar``).

Each fills approximate float32 scores for a chunk of documents
(:mod:`gpusparse.kernels.scatter`, :mod:`gpusparse.kernels.docpar`); the exact top-k of each
chunk is certified and merged by :func:`gpusparse.exact.chunked_exact_topk`. They run on a
CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

import torch

from .. import kernels
from ..exact import chunked_exact_topk
from ..kernels import triton_available
from ..layout.forward import forward_copy
from ..layout.postings import PostingLists
from ..queries import query_batch
from .base import BatchResult, SearchPlan

if TYPE_CHECKING:
    from ..collection import SparseCollection


class _TritonEngine:
    name: ClassVar[str]
    auto_rank: ClassVar[int]
    quantizes_queries: ClassVar[bool] = False

    def unavailable(self, device: torch.device, *, auto: bool = False) -> str | None:
        """Why the kernel cannot run on ``device`` (``None``: it can). Automatically only on a
        CUDA device: the interpreter is for tests."""
        if not triton_available():
            return (
                f"kernel {self.name!r} needs Triton and a CUDA device (or TRITON_INTERPRET=1 for Triton's CPU "
                "interpreter)"
            )
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not (device.type == "cpu" and interpreted and not auto):
            return (
                f"kernel {self.name!r} runs on CUDA devices (or on the CPU under TRITON_INTERPRET=1), not on {device}"
            )
        return None

    def search_batch(self, index: PostingLists, queries: SparseCollection, k: int, plan: SearchPlan) -> BatchResult:
        """Exact top-``k`` of the batch (see :func:`kernel_search`)."""
        return BatchResult(*kernel_search(index, queries, k, kernel=self.name, doc_chunk=plan.doc_chunk))


class ScatterEngine(_TritonEngine):
    """The paper's fused scatter-add kernel (one program per query term)."""

    name: ClassVar[str] = "scatter"
    auto_rank: ClassVar[int] = 20


class DocparEngine(_TritonEngine):
    """The paper's document-parallel kernel over the forward copy (never chosen by ``auto``:
    the paper measured it 5× slower than scatter-add)."""

    name: ClassVar[str] = "docpar"
    auto_rank: ClassVar[int] = 0


def kernel_search(
    index: PostingLists, queries: SparseCollection, k: int, *, kernel: str, doc_chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Triton kernel fills float32 scores chunk by chunk; each chunk's exact top-k is merged.
    (The launchers load Triton on first use: :mod:`gpusparse.kernels`.)

    Returns ``(scores, ids)`` ``[batch, k]`` on the index's device.
    """
    dev = index.device
    bq, n = len(queries), index.n_docs
    batch = query_batch(queries, dev)
    forward = forward_copy(index) if kernel == "docpar" else None
    buf = torch.empty(bq * min(doc_chunk, max(n, 1)), dtype=torch.float32, device=dev)

    def fill(d0: int, width: int) -> torch.Tensor:
        out = buf[: bq * width].view(bq, width)
        if kernel == "scatter":
            return kernels.scatter_add_scores(index, batch, d0, width, out)
        return kernels.docpar_scores(index, batch, d0, width, forward, out)

    return chunked_exact_topk(index, batch, k, doc_chunk, fill)
