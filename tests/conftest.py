"""Shared test helpers: random sparse data and the float64 brute-force reference."""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# Triton kernels run on the CPU through its interpreter; the variable must be set
# before triton is first imported.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


SEED_VARIABLE = "GPUSPARSE_TEST_SEED"


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A random generator with a fresh seed per test (inputs differ every run: the paths must
    be exact on any data), or the seed of ``GPUSPARSE_TEST_SEED``. The seed is recorded in the
    test's ``user_properties`` and printed with a failure (see ``pytest_runtest_makereport``)."""
    forced = os.environ.get(SEED_VARIABLE)
    seed = int(forced) if forced else secrets.randbits(32)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("random seed", f"{SEED_VARIABLE}={value} reproduces this test's inputs"))


def require_cuda_kernels() -> None:
    """For a test of the CuPy-compiled CUDA kernels: skip without a CUDA device; on a CUDA
    machine, a missing CuPy FAILS the test (a GPU box without CuPy would otherwise run none
    of the fast-engine tests and stay green)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        pytest.fail(
            f"CUDA is available but CuPy cannot be imported ({e}): the CUDA kernels (tiled engine, rescoring, "
            "row sort) would go untested. Install CuPy for this CUDA version, e.g. pip install cupy-cuda12x",
            pytrace=False,
        )


def bench_script(name: str):
    """``bench/<name>.py`` loaded as a module of its own (``bench_<name>``), for tests of the
    benchmark scripts (which are files, not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
