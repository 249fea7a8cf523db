"""CUDA streams shared across the package, and what a CUDA graph's capture on them needs.

PyTorch keeps a cuBLAS workspace (~32 MiB) for every stream a matrix product ever ran on,
for the life of the process, so side streams are made once per device and reused, never
per call.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterator

import torch


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` that CUDA graphs are warmed up and captured on (the
    encoder's and the search's). A fresh stream per capture held ~50 MB a graph after the
    graphs were gone (measured on an H200: 242 MB after five encoder graphs and their
    encoder were freed)."""
    with torch.cuda.device(device):
        return torch.cuda.Stream()


@contextlib.contextmanager
def collection_held() -> Iterator[None]:
    """No automatic garbage collection inside the block (a CUDA graph's warm-up and capture):
    one that frees another CUDA graph (a dropped index's or encoder's, in a reference cycle)
    destroys it while the stream captures, which voids the capture (PyTorch no longer collects
    before one). The collector is enabled again after the block, if it was before."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
