"""Shared test helpers: random sparse data and the float64 brute-force reference."""

from __future__ import annotations

import os
import sys

import torch

# Triton kernels run on the CPU through its interpreter; the variable must be set
# before triton is first imported.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
