"""Search engines behind one interface, and the one place that chooses between them.

Each engine is a class in a module of its own implementing
:class:`~gpusparse.engines.base.Engine`; :data:`REGISTRY` maps its name to
``"module:Class"`` and the module is imported only when the engine is used (the CUDA and
Triton engines load optional packages). :func:`choose` resolves ``"auto"`` (the usable
engine with the highest ``auto_rank``) or checks an explicit name; the CLI's ``--kernel``
choices are :func:`names`.

======== ========================================================================= =====
name     what it is                                                                 auto
======== ========================================================================= =====
tiled    on-chip accumulation per document tile (CUDA via CuPy; PyTorch elsewhere)  30
scatter  the paper's fused scatter-add (Triton)                                     20
reference scatter-add in PyTorch with float64 sums (any device)                      10
docpar   the paper's document-parallel kernel (Triton)                              never
======== ========================================================================= =====
"""

from __future__ import annotations

import functools
import importlib

import torch

from .base import BatchResult, Engine, SearchPlan, plan_chunks

__all__ = ["REGISTRY", "BatchResult", "Engine", "SearchPlan", "choose", "get", "names", "plan_chunks"]

REGISTRY: dict[str, str] = {
    "reference": "gpusparse.engines.reference:ReferenceEngine",
    "scatter": "gpusparse.engines.triton:ScatterEngine",
    "docpar": "gpusparse.engines.triton:DocparEngine",
    "tiled": "gpusparse.engines.tiled.engine:TiledEngine",
}


def names() -> tuple[str, ...]:
    """Engine names accepted by ``kernel=`` (besides ``"auto"``)."""
    return tuple(REGISTRY)


@functools.cache
def get(name: str) -> Engine:
    """The engine called ``name`` (its module imported on first use)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown kernel {name!r}; choose one of: auto, {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def choose(name: str, device: torch.device) -> Engine:
    """The engine to search with on ``device``: ``"auto"`` takes the usable engine of highest
    ``auto_rank`` (the tiled engine on a CUDA device with CuPy, else scatter-add on a CUDA
    device with Triton, else the reference; measured in ``bench/results/``); an explicit name
    is checked and refused with the reason when it cannot run there."""
    device = torch.device(device)
    if name == "auto":
        usable = [e for e in map(get, REGISTRY) if e.auto_rank > 0 and e.unavailable(device, auto=True) is None]
        return max(usable, key=lambda e: e.auto_rank)
    engine = get(name)
    reason = engine.unavailable(device)
    if reason is not None:
        raise ValueError(reason)
    return engine
