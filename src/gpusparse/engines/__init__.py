"""Search engines behind one interface, and the one place that chooses between them.

Each engine is a class in a module of its own implementing
:class:`~gpusparse.engines.base.Engine`; :data:`REGISTRY` maps its name to
``"module:Class"`` and the module is imported only when the engine is used (the CUDA and
Triton engines load optional packages). :func:`choose` resolves ``"auto"`` (the usable
engine with the highest ``auto_rank``) or checks an explicit name; the CLI's ``--kernel``
choices are :func:`names`. On a CUDA device where ``"auto"`` cannot take the fastest engine
(CuPy not installed), :func:`fallback_reason` says why and what to install, and
:func:`choose` warns once per process (:class:`SlowEngineWarning`).

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
import importlib.util
import warnings

import torch

from .base import BatchResult, Engine, SearchPlan, plan_chunks

__all__ = [
    "REGISTRY", "BatchResult", "Engine", "SearchPlan", "SlowEngineWarning", "choose", "cuda_extra",
    "fallback_reason", "get", "names", "plan_chunks",
]  # fmt: skip

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


# The package each engine's fast path needs, and the pip extra that brings it (see cuda_extra).
_NEEDS: dict[str, str] = {"tiled": "cupy"}


class SlowEngineWarning(UserWarning):
    """``kernel="auto"`` runs a slower engine on a CUDA device because a package is missing."""


def choose(name: str, device: torch.device) -> Engine:
    """The engine to search with on ``device``: ``"auto"`` takes the usable engine of highest
    ``auto_rank`` (the tiled engine on a CUDA device with CuPy, else scatter-add on a CUDA
    device with Triton, else the reference; measured in ``bench/results/``); an explicit name
    is checked and refused with the reason when it cannot run there. When ``"auto"`` skips a
    faster engine on a CUDA device, it warns once per process (:func:`fallback_reason`)."""
    device = torch.device(device)
    if name == "auto":
        engine = _best_usable(device)
        # the fastest engine needs no reason (every search passes here: a few µs of host time)
        if device.type == "cuda" and engine is not _by_rank()[0]:
            reason = fallback_reason(device, engine)
            if reason is not None:
                _warn_once(reason)
        return engine
    engine = get(name)
    reason = engine.unavailable(device)
    if reason is not None:
        raise ValueError(reason)
    return engine


def fallback_reason(device: str | torch.device, chosen: Engine | None = None) -> str | None:
    """Why ``kernel="auto"`` does not run the fastest engine on ``device``, with the command
    that installs what it lacks (one sentence); ``None`` when it does, and off a CUDA device
    (where the engine it picks is the best there is). ``chosen``: the engine ``"auto"`` picks
    there, if the caller has it."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    fastest = _by_rank()[0]
    chosen = chosen or _best_usable(device)
    if chosen is fastest:
        return None
    why = fastest.unavailable(device, auto=True) or "it is not usable here"
    package = _NEEDS.get(fastest.name)
    if package is not None and importlib.util.find_spec(package) is None:
        extra = cuda_extra()
        why = (
            f"{package} is not installed; install it with: pip install 'gpusparse[{extra}]' "
            f"(CuPy for CUDA {extra[4:]}, as this PyTorch; see docs/guides/install-gpu.md)"
        )
    return f"kernel 'auto' runs {chosen.name!r}, not the faster {fastest.name!r}: {why}"


def cuda_extra() -> str:
    """The pip extra of CuPy for this PyTorch's CUDA major version (``torch.version.cuda``):
    ``"cuda12"`` for CUDA 12, else ``"cuda13"`` (the default, also when PyTorch has no CUDA)."""
    major = (torch.version.cuda or "13").split(".")[0]
    return "cuda12" if major == "12" else "cuda13"


@functools.cache
def _by_rank() -> tuple[Engine, ...]:
    """The engines ``"auto"`` may take, highest ``auto_rank`` first."""
    return tuple(sorted((e for e in map(get, REGISTRY) if e.auto_rank > 0), key=lambda e: -e.auto_rank))


def _best_usable(device: torch.device) -> Engine:
    # in rank order, so that the usual case asks one engine whether it can run
    for engine in _by_rank():
        if engine.unavailable(device, auto=True) is None:
            return engine
    raise RuntimeError("no engine can run here")  # the reference engine runs anywhere


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(reason, SlowEngineWarning, stacklevel=4)
