"""bench/sub_tile_bounds.py: its shares and counts, on a collection small enough to count by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import sub_tile_bounds


def _tiny() -> tuple[sp.csr_matrix, sp.csr_matrix]:
    # 8 documents, 2 terms: term 0 in d0 (1.0), d1 (0.5), d3 (0.1); term 1 in d2 and d4-d7
    rows = [0, 1, 3, 2, 4, 5, 6, 7]
    cols = [0, 0, 0, 1, 1, 1, 1, 1]
    vals = [1.0, 0.5, 0.1, 0.2, 1.0, 1.0, 1.0, 1.0]
    docs = sp.csr_matrix((np.array(vals, np.float32), (rows, cols)), shape=(8, 2))
    queries = sp.csr_matrix(np.array([[1.0, 0.0]], np.float32))  # term 0 only
    return docs, queries


def test_block_record_counts_by_hand():
    docs, queries = _tiny()
    # tiles of 4 documents, sub-blocks of 2: {d0, d1} bound 1.0 (not below θ = 1), {d2, d3}
    # bound 0.1 (prunes its one posting), the second tile holds no posting of term 0
    rec = sub_tile_bounds.block_record(queries, docs, np.arange(8), 1, {"final": np.array([1.0])}, tile_bits=2)
    assert rec["blocks"] == 4
    assert rec["theta"]["final"]["pairs"] == 0.5
    assert rec["theta"]["final"]["postings"] == pytest.approx(1 / 3)
    assert rec["postings_per_tile_block"] == 3.0  # the one block (query, tile 0) that reads postings
    assert rec["bounds_per_tile_block"] == 2.0  # (sub-block, term 0) present twice there
    # in the order d0, d3, d1, d2, ...: {d0, d3} bound 1.0, {d1, d2} bound 0.5: one posting of three
    rec = sub_tile_bounds.block_record(
        queries, docs, np.array([0, 3, 1, 2, 4, 5, 6, 7]), 1, {"final": np.array([1.0])}, tile_bits=2
    )
    assert rec["theta"]["final"]["postings"] == pytest.approx(1 / 3)
    # a θ just above 1.0 prunes every touched sub-block
    rec = sub_tile_bounds.block_record(queries, docs, np.arange(8), 1, {"final": np.array([1.01])}, tile_bits=2)
    assert rec["theta"]["final"] == {"pairs": 1.0, "postings": 1.0, "bound_over_theta_p50": pytest.approx(0.55 / 1.01)}


def test_thresholds_final_and_first_documents():
    docs, queries = _tiny()
    final, early = sub_tile_bounds.thresholds(docs, queries, np.array([2, 3]), 1)
    assert final.tolist() == [1.0]
    assert early == pytest.approx([0.1])  # d3's score is the best among d2, d3


def test_run_writes_a_record_per_block_size(tmp_path):
    out = tmp_path / "r.json"
    sub_tile_bounds.main(["--docs", "20000", "--queries", "8", "--bits", "6", "13", "--out", str(out)])
    report = json.loads(out.read_text())
    assert [r["block_bits"] for r in report["records"]] == [6, 13]
    tile = report["records"][1]
    assert tile["bounds_per_tile_block"] <= report["records"][0]["bounds_per_tile_block"]
    for r in report["records"]:
        for th in r["theta"].values():
            assert 0.0 <= th["postings"] <= 1.0 and 0.0 <= th["pairs"] <= 1.0
    assert tile["theta"]["final"]["pairs"] == 0.0  # no whole tile prunes on this collection (issue 6's finding)
