"""What the host pays for each CUDA primitive a small search uses (issue 23: the batch-1 floor).

Usage (GPU machine): python bench/host_primitives.py [--out FILE]
Median host microseconds of each primitive (no sync inside the timed part unless named), so
that a small search's host path can be costed before it is changed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def host_us(fn, reps: int = 2000, sync: bool = False, warmup: int = 20) -> float:
    """Median host µs of ``fn()`` over ``reps`` calls after ``warmup`` calls, the device synchronised
    after each call (outside the timing; inside it with ``sync``: host to host)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter_ns() - t0)
        if not sync:
            torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    small = torch.zeros(64, device=dev)
    pinned = torch.zeros(64, pin_memory=True)
    ev = torch.cuda.Event()
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(16, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x + 1
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = x + 1
        for _ in range(20):
            y = y + 1
    arr = np.zeros(64, dtype=np.float32)
    res = {
        "empty_pinned_64": host_us(lambda: torch.empty(64, pin_memory=True), 500),
        "empty_cuda_64": host_us(lambda: torch.empty(64, device=dev)),
        "clone_cuda_64": host_us(lambda: small.clone()),
        "copy_h2d_pinned_nonblocking": host_us(lambda: small.copy_(pinned, non_blocking=True)),
        "copy_d2h_pinned_nonblocking": host_us(lambda: pinned.copy_(small, non_blocking=True)),
        "event_record": host_us(lambda: ev.record()),
        "event_new_record": host_us(lambda: torch.cuda.Event().record()),
        "stream_wait_stream": host_us(lambda: side.wait_stream(torch.cuda.current_stream())),
        "stream_context": host_us(lambda: torch.cuda.stream(side).__enter__() and None),
        "record_stream": host_us(lambda: small.record_stream(side)),
        "graph_replay_21_kernels": host_us(lambda: g.replay()),
        "synchronize_idle": host_us(lambda: torch.cuda.synchronize()),
        "event_sync_done": host_us(lambda: ev.synchronize()),
        "add_kernel": host_us(lambda: small.add_(1)),
        "current_stream": host_us(lambda: torch.cuda.current_stream()),
        "get_device_properties": host_us(lambda: torch.cuda.get_device_properties(dev)),
        "numpy_assign_64": host_us(lambda: pinned.numpy().__setitem__(Ellipsis, arr)),
        "tensor_numpy": host_us(lambda: pinned.numpy()),
        "from_numpy": host_us(lambda: torch.from_numpy(arr)),
        "cpu_tensor_clone_64": host_us(lambda: pinned.clone()),
        "python_noop_call": host_us(lambda: None),
    }
    torch.cuda.set_stream(torch.cuda.default_stream())
    try:
        import cupy as cp

        a = cp.zeros(64, dtype=cp.float32)
        k = cp.ElementwiseKernel("float32 x", "float32 y", "y = x + 1", "inc")
        k(a, a)
        res["cupy_elementwise_launch"] = host_us(lambda: k(a, a))
        res["cupy_current_stream"] = host_us(lambda: cp.cuda.get_current_stream())
    except ImportError:
        pass
    res["card"] = torch.cuda.get_device_name(0)
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for n, v in res.items():
        print(f"{n:36} {v if isinstance(v, str) else f'{v:8.2f} us'}")


if __name__ == "__main__":
    main()
