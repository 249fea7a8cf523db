"""bench/doc_order_cost.py: the per-block work it counts, on a collection small enough to count by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import doc_order_cost


def test_block_work_counts_dense_rows_and_sparse_postings():
    # 8 documents, tiles of 4; term 0 in documents 0-3 (dense at 50 %), term 1 in 0 and 4, term 2 nowhere
    rows = [0, 1, 2, 3, 0, 4]
    cols = [0, 0, 0, 0, 1, 1]
    docs = sp.csr_matrix((np.ones(6, np.float32), (rows, cols)), shape=(8, 3))
    queries = sp.csr_matrix(np.array([[1, 1, 0], [0, 1, 1]], np.float32))  # term 1 read by both
    work = doc_order_cost.block_work(docs, queries, np.arange(8), tile_bits=2, dense_min=0.5)
    # blocks: 2 queries x 2 tiles; dense rows: term 0 in tile 0, read by query 0 only -> 1 row
    # sparse: term 1 has one posting in each tile, read by 2 queries -> 4 postings
    assert work == {"dense_rows_per_block": 1 / 4, "sparse_postings_per_block": 4 / 4, "tiles": 2}
    # tiles {0, 4, 1, 5} and {2, 6, 3, 7}: term 0 half of each tile (a dense row in both, one
    # reader), term 1's two postings together in the first (dense there, two readers)
    spread = doc_order_cost.block_work(docs, queries, np.array([0, 4, 1, 5, 2, 6, 3, 7]), 2, 0.5)
    assert spread == {"dense_rows_per_block": (2 + 2) / 4, "sparse_postings_per_block": 0.0, "tiles": 2}


def test_synthetic_run_writes_every_order(tmp_path):
    out = tmp_path / "r.json"
    doc_order_cost.main(["--synthetic", "3000", "--tile-bits", "8", "--clusters", "3", "--sample", "--out", str(out)])
    report = json.loads(out.read_text())
    orders = {r["order"] for r in report["rows"]}
    assert orders == {"collection", "random", "cluster 3", "cluster 3, engine order"}
    base = next(r for r in report["rows"] if r["order"] == "collection")
    assert base["rows_vs_collection"] == 1.0 and base["postings_vs_collection"] == 1.0


def test_load_csr_reads_scipy_files_and_the_block_max_cache(tmp_path):
    m = sp.random(20, 30, density=0.2, format="csr", dtype=np.float32, random_state=1)
    sp.save_npz(tmp_path / "a.npz", m)
    np.savez(tmp_path / "b.npz", indptr=m.indptr, indices=m.indices, data=m.data, shape=np.asarray(m.shape))
    for name in ("a.npz", "b.npz"):
        got = doc_order_cost.load_csr(tmp_path / name)
        assert got.shape == m.shape and (got != m).nnz == 0
