"""Launchers of bench/shared_batch.cu (issue 23, fifth session): one block per document chunk for the
whole batch, kernel "flat" (pairs split evenly over a block's threads) or "warp" (a warp per run).

Compiled through :func:`gpusparse.kernels.cupy_launch.get_kernel` (CuPy, NVRTC) with the batch's
shape as ``-D`` defines, launched on PyTorch's current stream with raw pointers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpusparse.kernels.cupy_launch import check_tensors, device_index, get_kernel, launch, pointer
from shared_batch_ops import BatchTerms, ChunkLayout, row_stride

SOURCE = Path(__file__).with_name("shared_batch.cu")
KERNELS = {"flat": "chunk_batch_flat", "warp": "chunk_batch_warp"}
THREADS = 1024


@functools.cache
def source() -> str:
    """The kernels' source text (read once: the compile cache is keyed by it)."""
    return SOURCE.read_text()


def smem_bytes(n_queries: int, chunk: int, threads: int, items: int, n_pairs: int) -> int:
    """Dynamic shared memory of one block (the layout the .cu file's header states)."""
    w = threads * items
    words = chunk * row_stride(n_queries) + 3 * w + 1 + n_queries
    return ((4 * words + 7) & ~7) + 8 * (threads // 32) + 2 * n_pairs


def smem_limit(dev: torch.device) -> int:
    """The most dynamic shared memory a block may opt in to on ``dev``."""
    props = torch.cuda.get_device_properties(dev)
    return int(getattr(props, "shared_memory_per_block_optin", 227 * 1024))


def choose_items(n_queries: int, chunk: int, threads: int, n_pairs: int, limit: int) -> int:
    """Postings a thread loads per window: 4, else 2, else 1, the first whose block fits ``limit``."""
    for items in (4, 2, 1):
        if smem_bytes(n_queries, chunk, threads, items, n_pairs) <= limit:
            return items
    raise ValueError(
        f"{n_queries} queries × {chunk} documents of accumulators and a qlist of {n_pairs} entries do not fit "
        f"{limit} bytes of shared memory: lower --chunk"
    )


@dataclass
class Outputs:
    """The kernels' outputs: per-query maxima, candidate counts (may exceed ``cap``: overflow),
    candidate documents and values ``[B, cap]``."""

    qmax: torch.Tensor
    count: torch.Tensor
    cand_doc: torch.Tensor
    cand_val: torch.Tensor

    @classmethod
    def allocate(cls, n_queries: int, cap: int, dev: torch.device, poison: bool = True) -> Outputs:
        out = cls(
            torch.zeros(n_queries, dtype=torch.int32, device=dev),
            torch.zeros(n_queries, dtype=torch.int32, device=dev),
            torch.empty((n_queries, max(cap, 1)), dtype=torch.int32, device=dev),
            torch.empty((n_queries, max(cap, 1)), dtype=torch.int32, device=dev),
        )
        if poison:
            out.cand_doc.fill_(-7)
            out.cand_val.fill_(-7)
        return out

    @property
    def cap(self) -> int:
        return self.cand_doc.shape[1]

    def overflow(self) -> torch.Tensor:
        return (self.count - self.cap).clamp_min(0)

    def candidates(self, q: int) -> tuple[np.ndarray, np.ndarray]:
        """Query ``q``'s candidate documents (ascending) and their values, on the host."""
        n = min(int(self.count[q]), self.cap)
        doc, order = torch.sort(self.cand_doc[q, :n])  # on the device: up to every document of the collection
        return doc.cpu().numpy(), self.cand_val[q, :n][order].cpu().numpy()


def run(
    variant: str,
    layout: ChunkLayout,
    bt: BatchTerms,
    theta: torch.Tensor,
    out: Outputs,
    *,
    emit: bool = True,
    threads: int = THREADS,
    blocks: int | None = None,
    reset: bool = True,
) -> None:
    """One launch over every chunk: ``out.qmax`` and ``out.count`` zeroed first (``reset``), then the
    kernel ``variant`` with candidates ``acc ≥ theta[q]`` (int32 ``[B]``; none where ``theta ≤ 0``)
    when ``emit``. ``blocks``: persistent blocks (default: one per multiprocessor)."""
    if variant not in KERNELS:
        raise ValueError(f"variant must be one of {sorted(KERNELS)}, not {variant!r}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in 32..1024, not {threads}")
    dev = layout.post.device
    b = bt.n_queries
    check_tensors(
        {
            "post": (layout.post, torch.int32),
            "chunk_start": (layout.chunk_start, torch.int64),
            "tinfo": (bt.tinfo, torch.int32),
            "qlist": (bt.qlist, torch.int16),
            "theta": (theta, torch.int32),
            "qmax": (out.qmax, torch.int32),
            "count": (out.count, torch.int32),
            "cand_doc": (out.cand_doc, torch.int32),
            "cand_val": (out.cand_val, torch.int32),
        },
        dev,
    )
    if theta.numel() != b or out.qmax.numel() != b or out.cand_doc.shape[0] != b:
        raise ValueError(f"theta and the outputs must have the batch's {b} queries")
    if bt.tinfo.numel() != layout.n_terms:
        raise ValueError("the batch's term table and the layout have different vocabularies")
    limit = smem_limit(dev)
    items = choose_items(b, layout.chunk, threads, bt.n_pairs, limit)
    options = (
        f"-DTHREADS={threads}",
        f"-DITEMS={items}",
        f"-DCHUNK={layout.chunk}",
        f"-DNQ={b}",
        f"-DSTRIDE={row_stride(b)}",
    )
    kernel = get_kernel(source(), KERNELS[variant], options=options, device=device_index(dev), max_dynamic_shared=limit)
    if reset:
        out.qmax.zero_()
        out.count.zero_()
    n_chunks = layout.n_chunks
    if n_chunks == 0:
        return
    if blocks is None:
        blocks = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = (max(1, min(blocks, n_chunks)),)
    args = (
        pointer(layout.post),
        pointer(layout.chunk_start),
        np.int32(n_chunks),
        np.int32(layout.n_docs),
        pointer(bt.tinfo),
        pointer(bt.qlist),
        np.int32(bt.n_pairs),
        pointer(theta),
        np.int32(1 if emit else 0),
        pointer(out.qmax),
        pointer(out.count),
        pointer(out.cand_doc),
        pointer(out.cand_val),
        np.int32(out.cap),
    )
    shared = smem_bytes(b, layout.chunk, threads, items, bt.n_pairs)
    launch(kernel, grid, (threads,), args, device=dev, shared_mem=shared)
