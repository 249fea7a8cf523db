"""A query batch's rows padded (and quantized) on the device (``cuda/query_rows.cu``).

The tiled engine's CUDA graph reads a batch as padded ``[B, W]`` terms and weights. Laying it
out on the host (:func:`gpusparse.queries.padded_host`'s padding, after :func:`gpusparse.quantize.quantize_queries`
for a quantized index) took ~50 µs of an H200 host's time at batch 256 before each launch, and
its copy moved the padding too; from the rows (CSR) the host only copies the batch's terms and
weights, and this kernel, the graph's first, does the rest.
"""

from __future__ import annotations

import numpy as np
import torch

from .cupy_launch import device_index, launch, load_kernel, pointer

__all__ = ["SOURCE", "csr_fields", "query_rows"]

SOURCE = "query_rows.cu"  # in kernels/cuda/
THREADS = 128  # a block (one row), THREADS in the CUDA source


def csr_fields(rows: int, cap: int) -> tuple[dict[str, tuple[int, int, np.dtype, tuple[int, ...]]], int]:
    """Where a batch's rows lie in one buffer: ``{name: (byte offset, bytes, dtype, shape)}`` of
    ``indptr`` (int32 ``[rows + 1]``, from 0), ``indices`` (int32 ``[cap]``) and ``values``
    (float32 ``[cap]``), each 8-byte aligned; and the buffer's size."""
    out, total = {}, 0
    for name, dtype, n in (("indptr", np.int32, rows + 1), ("indices", np.int32, cap), ("values", np.float32, cap)):
        nbytes = n * 4
        out[name] = (total, nbytes, np.dtype(dtype), (n,))
        total += -(-nbytes // 8) * 8
    return out, max(total, 8)


def query_rows(
    source: torch.Tensor | int, rows: int, cap: int, width: int, bits: int, *, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's rows, packed as :func:`csr_fields` ``(rows, cap)`` lays them out in ``source``
    (a contiguous uint8 tensor on ``device``, or the device address of such bytes: mapped
    page-locked host memory), as padded terms (int64, ``-1`` after a row's end), weights
    (float32, ``0`` there) and the terms again as int32 (what the search kernels read), each
    ``[rows, width]`` on ``device``. Weights are finite and > 0 (a
    :class:`~gpusparse.collection.SparseCollection`'s); with ``bits`` > 0 each row's are quantized as
    :func:`gpusparse.quantize.quantize_queries` does (its own power-of-two step, half to even,
    terms of level 0 dropped: bit for bit the same). No row may be longer than ``width``, nor
    the rows' terms more than ``cap`` (unchecked: the caller wrote them)."""
    if not 0 <= bits <= 16:
        raise ValueError("bits must be in 0..16")
    fields, size = csr_fields(rows, cap)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(source, torch.Tensor):
        if source.dtype != torch.uint8 or source.device != device or not source.is_contiguous():
            raise ValueError(f"source must be a contiguous uint8 tensor on {device}")
        if source.numel() < size:
            raise ValueError(f"source holds {source.numel()} bytes, the rows need {size}")
        base = source.data_ptr()
    else:
        base = int(source)
    terms = torch.empty((rows, width), dtype=torch.int64, device=device)
    weights = torch.empty((rows, width), dtype=torch.float32, device=device)
    terms32 = torch.empty((rows, width), dtype=torch.int32, device=device)
    if rows > 0:
        at = {name: np.uint64(base + spec[0]) for name, spec in fields.items()}
        args = (at["indptr"], at["indices"], at["values"], np.int32(width), np.int32(bits),
                pointer(terms), pointer(weights), pointer(terms32))  # fmt: skip
        kernel = load_kernel(SOURCE, "query_rows", device=device_index(device))
        launch(kernel, (rows,), (THREADS,), args, device=device)
    return terms, weights, terms32
