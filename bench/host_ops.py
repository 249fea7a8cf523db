"""What small host-side operations of a search cost on this machine (issue 23's host path).

Usage (GPU machine): python bench/host_ops.py  — prints the median microseconds of each.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpusparse.transfer import start_to_host, to_device


def us(fn, reps: int = 500, sync: bool = True) -> float:
    times = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    dev = torch.device("cuda")
    a = np.arange(64, dtype=np.int64)
    b = np.ones(64, dtype=np.float32)
    d = torch.zeros(64, device=dev)
    pinned = torch.empty(1024, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.empty(1024, dtype=torch.uint8, device=dev)
    ev = torch.cuda.Event()
    rows = [  # (name, call, whether the device is synced before each call)
        ("torch.empty pinned 1 KB", lambda: torch.empty(1024, dtype=torch.uint8, pin_memory=True), True),
        ("torch.empty pinned 1 KB (no sync before)", lambda: torch.empty(1024, dtype=torch.uint8, pin_memory=True),
         False),
        ("torch.empty device", lambda: torch.empty(1024, dtype=torch.uint8, device=dev), True),
        ("H2D copy_ of a pinned 1 KB, non_blocking", lambda: dbuf.copy_(pinned, non_blocking=True), True),
        ("D2H copy_ into pinned 1 KB, non_blocking", lambda: pinned.copy_(dbuf, non_blocking=True), True),
        ("to_device of two small arrays", lambda: to_device([a, b], dev), True),
        ("start_to_host of 3 small tensors", lambda: start_to_host(d, d, d), True),
        ("device fill_", lambda: d.fill_(1.0), True),
        ("event record", lambda: ev.record(), True),
        ("event record + synchronize", lambda: (ev.record(), ev.synchronize()), True),
        ("torch.cuda.synchronize", torch.cuda.synchronize, True),
        ("clone of a small device tensor", lambda: d.clone(), True),
        ("numpy: 10 small ops", lambda: [np.maximum(a, 3) for _ in range(10)], True),
    ]  # fmt: skip
    for name, fn, sync in rows:
        print(f"{us(fn, sync=sync):9.1f} us  {name}")


if __name__ == "__main__":
    main()
