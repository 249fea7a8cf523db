"""GPU bytes over every allocator, for the benchmarks: one definition, so every row counts the same.

``gpu_memory(device)``: PyTorch's current and peak (since the last
``torch.cuda.reset_peak_memory_stats``) allocated and reserved bytes, CuPy's default pool,
and the device-wide use from ``mem_get_info`` (which adds the CUDA context and anything
else on the card). ``all_allocators`` is the peak the benchmarks quote: PyTorch's reserved
peak plus CuPy's pool; ``held_all_allocators`` the same for the bytes held now.
"""

from __future__ import annotations


def gpu_memory(device=None) -> dict | None:
    """The figures above for ``device`` (default: the current CUDA device); ``None`` without CUDA
    or for a CPU device."""
    import torch

    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    free, total = torch.cuda.mem_get_info(device)
    out = {
        "torch_allocated": torch.cuda.memory_allocated(device),
        "torch_reserved": torch.cuda.memory_reserved(device),
        "torch_max_allocated": torch.cuda.max_memory_allocated(device),
        "torch_max_reserved": torch.cuda.max_memory_reserved(device),
        "device_used": total - free,
        "device_total": total,
        "cupy_pool": 0,
    }
    try:
        import cupy

        out["cupy_pool"] = int(cupy.get_default_memory_pool().total_bytes())
    except ImportError:
        pass
    out["all_allocators"] = out["torch_max_reserved"] + out["cupy_pool"]
    out["held_all_allocators"] = out["torch_reserved"] + out["cupy_pool"]
    return out
