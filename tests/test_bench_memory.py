"""bench/memory.py (issue 18) at a small scale on the CPU: every mode runs and agrees."""

from __future__ import annotations

import argparse

import pytest

from .conftest import bench_script


@pytest.fixture(scope="module")
def memory_bench():
    return bench_script("memory")


@pytest.mark.parametrize("quantize", [None, 8])
def test_every_mode_returns_the_same_results(memory_bench, quantize):
    results = []
    for mode in memory_bench.MODES:
        args = argparse.Namespace(docs=1500, batch=6, ks=[10, 100], reps=1, seed=3, device="cpu", mode=mode,
                                  quantize=quantize, cap_gib=None)  # fmt: skip
        results.append(memory_bench.worker(args))
    assert memory_bench._same(results) == {"8-bit" if quantize else "float32": True}
    for r in results:
        assert set(r["rows"]) == {"10", "100"} and r["index_memory"]["by_device"]["cpu"] > 0
        assert "k=10" in memory_bench._row(r)


def test_the_plan_covers_both_weight_types_and_the_cap(memory_bench):
    modes = list(memory_bench.MODES)
    plan = memory_bench.runs(argparse.Namespace(cap_gib=16.0, cap_only=False, modes=modes, dense_mins=[None]))
    assert {(p["mode"], p["quantize"]) for p in plan if not p["cap_gib"]} == {
        ("lists", None), ("tiled", None), ("tiled-float", None), ("lists", 8), ("tiled", 8)}  # fmt: skip
    assert all(p["mode"] != "lists" for p in plan if p["cap_gib"])
    capped = memory_bench.runs(argparse.Namespace(cap_gib=16.0, cap_only=True, modes=modes, dense_mins=[None]))
    assert capped == [p for p in plan if p["cap_gib"]]  # --cap-only: the capped runs alone
    limited = memory_bench.runs(argparse.Namespace(cap_gib=None, cap_only=True, limit_gib=16.0))
    assert limited == [{"mode": "lists", "quantize": q, "cap_gib": None, "limit_gib": 16.0, "dense_min": None}
                       for q in (None, 8)]  # fmt: skip
    swept = memory_bench.runs(argparse.Namespace(cap_gib=None, cap_only=False, modes=["lists", "tiled"],
                                                 dense_mins=[0.12, 0.25]))  # fmt: skip
    assert [(p["mode"], p["dense_min"]) for p in swept if p["quantize"] is None] == [
        ("lists", None), ("tiled", 0.12), ("tiled", 0.25)]  # fmt: skip


def test_each_row_records_the_prediction(memory_bench):
    args = argparse.Namespace(docs=1500, batch=6, ks=[10], reps=1, seed=3, device="cpu", mode="tiled", quantize=None,
                              cap_gib=None, limit_gib=4.0)  # fmt: skip
    r = memory_bench.worker(args)
    assert r["predicted"]["mode"] == "tiled" and r["predicted"]["peak"] > r["predicted"]["resident"] > 0
    assert "predicted resident" in memory_bench._row(r)
    assert r["plan"] == []  # a limit plans only for a GPU
