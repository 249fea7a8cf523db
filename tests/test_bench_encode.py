"""bench/encode.py runs end to end at tiny sizes on the CPU and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import bench_script
from .shared_data import SPLADE_TINY, needs_shared


@needs_shared
def test_encode_benchmark_tiny_run_writes_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    bench = bench_script("encode")
    result = bench.main(["--tiny", "--device", "cpu", "--tiny-model", str(SPLADE_TINY), "--out", str(tmp_path)])
    saved = json.loads(Path(result["path"]).read_text())
    assert saved["benchmark"] == "encode" and [r["part"] for r in saved["rows"]] == ["tiny", "e2e", "base"]
    tiny, e2e, base = saved["rows"]
    assert tiny["passages"] == e2e["passages"] == e2e["indexed_docs"] == 40 and base["passages"] == 16
    for row in (tiny, base):
        assert row["encode_s"] > 0 and row["bare_s"] > 0 and row["nnz"] > 0
        assert row["encode_over_bare"] == pytest.approx(row["encode_s"] / row["bare_s"])
        assert row["tokenize_passages_per_s"] > 0
    assert base["prune_top"] == 256 and base["mean_nnz"] <= 256
    assert e2e["postings"] == tiny["nnz"] and e2e["npz_bytes"] > 0 and "from cranfield" in saved["texts"]
    for row in (tiny, base):
        assert list(row["variants"]) == ["rust", "new", "gwords"]
        assert row["bare_pool_s"] > 0 and row["bare_graphs_s"] > 0
        assert row["bucket_padded_tokens"] >= row["padded_tokens"]
        for v in row["variants"].values():
            assert v["nnz"] == pytest.approx(row["nnz"], rel=1e-3) and v["encode_s"] == min(v["encode_s_reps"])
            assert {"tokenize", "launch", "wait_tokens", "assemble"} <= set(v["stages"]) and v["device"] == {}
        # On the CPU the graphs variant runs the same bucketed forward without capture.
        assert row["variants"]["rust"]["cuda_graphs"] is None and row["variants"]["new"]["cuda_graphs"]["graphs"] == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].split()[:3] == ["part", "passages", "encode/s"] and table[5] == ""
    assert [line.split()[1] for line in table[8:14]] == ["rust", "new", "gwords", "bare", "new", "gwords"]
    assert len(table) == 20


@needs_shared
def test_tokenize_rate_benchmark_runs_and_compares_the_same_texts(tmp_path, capsys):
    pytest.importorskip("transformers")
    bench = bench_script("tokenize_rate")
    args = ["--passages", "600", "--batch-size", "64", "--reps", "1", "--device-ms", "1", "--out", str(tmp_path)]
    result = bench.main([*args, "--tiny-model", str(SPLADE_TINY)])
    saved = json.loads(Path(result["path"]).read_text())
    assert set(saved["passages_per_s"]) == {"rust", "cache_cold", "cache_warm"}
    assert set(saved["pipeline"]) == {"old", "rust", "new"}
    for r in saved["pipeline"].values():
        assert r["wall_s"] >= r["stages"]["launch"] >= r["device_s"] == pytest.approx(10 * 0.001)  # 4 + 6 batches
    assert "word cache / Rust" in capsys.readouterr().out
