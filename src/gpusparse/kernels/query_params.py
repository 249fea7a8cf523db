"""The tiled engine's per-query fixed-point parameters computed on the device (``cuda/query_params.cu``).

A small batch's search replays one CUDA graph; computing its parameters on the host first
(:func:`gpusparse.engines.tiled.fixed_point.fixed_point_host`: a few numpy reductions over the
padded batch and ~50 operations on ``[B]`` arrays) took ~25 µs of an H200 host's time at batch 1
and ~300 µs at batch 256, before the launch. In the graph, one warp per query reduces its row and
does the same float64 arithmetic in the same order. Its sums (the score bound, the weights' sum)
add across the warp's lanes, where numpy pairs the slots otherwise: a parameter can then differ
from the host's in its last bit, and either is a valid bound (the margins carry their own slack). Rows the host
would refuse (out of the fixed-point range) or whose scaled weights are not integers where the
kernel multiplies integers are flagged for the general path instead.
"""

from __future__ import annotations

import numpy as np
import torch

from .cupy_launch import check_tensors, device_index, launch, load_kernel, pointer

__all__ = ["SOURCE", "query_params"]

SOURCE = "query_params.cu"  # in kernels/cuda/
WARPS = 4  # rows a block of the kernel (one warp each)


def query_params(
    terms: torch.Tensor,
    weights: torch.Tensor,
    max_scores: torch.Tensor,
    *,
    top_bits: int,
    min_w: float,
    max_w: float,
    weight_bits: int | None,
    step: float | None,
    max_delta: int,
) -> dict[str, torch.Tensor]:
    """The parameters of :func:`gpusparse.engines.tiled.fixed_point.fixed_point_host` on the
    device: ``scale`` (float64), ``delta`` (int64; 0 with ``step``: exact integer products, see
    :func:`~gpusparse.engines.tiled.fixed_point.exact_margin`), with ``weight_bits`` also ``mult`` (float64)
    and ``shift`` (int32), ``lb`` (float64, the match floor) and ``redo`` (bool), each ``[B]``.

    From the padded batch ``terms`` (int64, -1 padding) and ``weights`` (float32, 0 padding)
    ``[B, W]``, the lists' largest weights ``max_scores`` (float32 ``[V]``), ``top_bits`` (log2
    of the accumulator's limit), the index's smallest and largest weights ``min_w``/``max_w``,
    the layout's ``weight_bits`` (``None``: float64 or 8-bit products), ``step`` (the layout's
    8-bit step where the kernel multiplies integers, else ``None``) and the largest margin
    allowed. ``redo`` flags the rows whose parameters the host would refuse (``max_delta``
    exceeded, a shift outside 0..62) or whose weights times ``scale · step`` are not all
    integers (over the terms that have postings: the others are never multiplied)."""
    dev = terms.device
    b, width = terms.shape
    check_tensors({"terms": (terms, torch.int64), "weights": (weights, torch.float32),
                   "max_scores": (max_scores, torch.float32)}, dev)  # fmt: skip
    if weights.shape != terms.shape:
        raise ValueError("terms and weights must have one shape [B, W]")
    out = {
        "scale": torch.empty(b, dtype=torch.float64, device=dev),
        "delta": torch.empty(b, dtype=torch.int64, device=dev),
        "lb": torch.empty(b, dtype=torch.float64, device=dev),
        "redo": torch.empty(b, dtype=torch.bool, device=dev),
    }
    if weight_bits is not None:
        out["mult"] = torch.empty(b, dtype=torch.float64, device=dev)
        out["shift"] = torch.empty(b, dtype=torch.int32, device=dev)
    if b == 0:
        return out
    null = np.uint64(0)
    args = (pointer(terms), pointer(weights), np.int32(b), np.int32(width), pointer(max_scores), np.int32(top_bits),
            np.float64(min_w), np.float64(max_w), np.int32(-1 if weight_bits is None else weight_bits),
            np.float64(step or 0.0), np.int64(max_delta), pointer(out["scale"]), pointer(out["delta"]),
            pointer(out["mult"]) if "mult" in out else null, pointer(out["shift"]) if "shift" in out else null,
            pointer(out["lb"]), pointer(out["redo"]))  # fmt: skip
    kernel = load_kernel(SOURCE, "query_params", device=device_index(dev))
    launch(kernel, (-(-b // WARPS),), (WARPS * 32,), args, device=dev)
    return out
