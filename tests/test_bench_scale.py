"""bench/scale.py (issue 18, 100M documents) at a small scale: it runs, and the sampled
queries equal the chunk-by-chunk reference; on a GPU with the CUDA kernels as well."""

from __future__ import annotations

import json

import pytest

from .conftest import bench_script, require_cuda_kernels


@pytest.fixture(scope="module")
def scale_bench():
    return bench_script("scale")


@pytest.mark.parametrize("weights", ["float32", "uint8"])
def test_a_small_run_on_the_cpu_is_exact(scale_bench, tmp_path, capsys, weights):
    out = tmp_path / "scale.json"
    scale_bench.main(["--docs", "500", "--vocab", "1000", "--device", "cpu", "--weights", weights, "--batch", "6",
                      "-k", "50", "--sample", "3", "--reps", "1", "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    r = saved["result"]
    assert r["exact"] == {**r["exact"], "sampled": 3, "rows_equal": 3, "mismatched_rows": []}
    assert r["docs"] == 500 and r["postings"] > 0 and r["resident"]["layout"] > 0
    assert saved["device"] == "cpu" and "--docs 500" in saved["command"]
    assert "3/3" in capsys.readouterr().out.splitlines()[-1]  # the table comes last


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["float32", "uint8"])
def test_a_run_on_the_gpu_is_exact(scale_bench, tmp_path, weights):
    """200K calibrated documents in chunks of 2**16 on the GPU, 32 sampled queries at k = 1000."""
    require_cuda_kernels()
    out = tmp_path / "scale.json"
    scale_bench.main(["--docs", "200000", "--weights", weights, "--chunk-docs", str(1 << 16), "--batch", "64",
                      "--sample", "32", "--reps", "2", "--out", str(out)])  # fmt: skip
    r = json.loads(out.read_text())["result"]
    assert r["exact"]["rows_equal"] == 32, r["exact"]
    assert r["memory_after_build"]["all_allocators"] >= r["resident"]["layout"]
