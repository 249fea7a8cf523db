"""Quantized impacts: the quantizer, and exact search over quantized vectors on every path."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import Index, SparseCollection, engines, write_jsonl
from gpusparse.engines.tiled.engine import tiled_search
from gpusparse.engines.tiled.fixed_point import fixed_point, integer_weights
from gpusparse.errors import IndexFormatError
from gpusparse.layout.tiled import tiled_layout
from gpusparse.quantize import power_of_two_step, quantize_collection, quantize_queries
from gpusparse.queries import query_batch

from .reference import dense_scores, random_collection, reference_topk
from .test_cli import ok, run


def quantized_by_hand(coll: SparseCollection, step: float | None, bits: int = 8) -> np.ndarray:
    """Dense float64 ``level · step`` matrix, written independently of gpusparse.quantize.

    ``step=None``: one step per row (queries); else the shared step (documents).
    """
    dense = coll.to_scipy().toarray().astype(np.float64)
    top = (1 << bits) - 1
    if step is None:
        row_max = dense.max(1, keepdims=True)
        steps = np.where(row_max > 0, 2.0 ** np.ceil(np.log2(np.maximum(row_max, 1e-300) / top)), 1.0)
    else:
        steps = np.full((dense.shape[0], 1), step)
    return np.rint(dense / steps) * steps


def test_step_is_the_smallest_power_of_two_that_fits():
    for m in (3.5, 1.0, 255.0, 256.0, 1e-6, 7.25):
        s = power_of_two_step(m, 8)
        assert math.frexp(s)[0] == 0.5  # a power of two
        assert m / s <= 255 < m / (s / 2)
    assert power_of_two_step(0.0, 8) == 1.0
    with pytest.raises(ValueError, match="bits"):
        power_of_two_step(1.0, 9)


def test_quantize_collection_levels_and_dropped_weights():
    docs = SparseCollection.from_dicts([{"a": 3.0, "b": 0.001, "c": 1.0}, {"b": 2.5}, {}])
    q, report = quantize_collection(docs, 8)
    assert report.quantization.step == power_of_two_step(3.0, 8) == 2.0**-6
    assert report.n_weights == 4 and report.n_dropped == 1  # 0.001 < step / 2
    assert q.row(0) == {"a": 3.0, "c": 1.0} and q.row(1) == {"b": 2.5} and q.row(2) == {}
    levels = q.values / report.quantization.step
    assert np.array_equal(levels, np.rint(levels)) and levels.max() <= 255


def test_queries_are_quantized_one_by_one(rng):
    """A query's quantized form (and so its results) does not depend on the batch."""
    queries = random_collection(rng, 20, 60, 8)
    whole = quantize_queries(queries, 8)
    for i in range(len(queries)):
        assert quantize_queries(queries[i : i + 1], 8).row(0) == whole.row(i)
    np.testing.assert_array_equal(whole.to_scipy().toarray(), quantized_by_hand(queries, None))


def test_vectorised_steps_equal_the_scalar_step(rng):
    """Each query's step is power_of_two_step of its largest weight, whatever the magnitude."""
    from gpusparse.quantize import power_of_two_steps

    m = np.concatenate([rng.random(500) * 10.0 ** rng.integers(-30, 30, 500), [0.0, 255.0, 256.0, 1.0, 2.0**-40]])
    for bits in (8, 4):
        np.testing.assert_array_equal(power_of_two_steps(m, bits), [power_of_two_step(float(x), bits) for x in m])


def test_query_quantization_rounds_half_to_even_and_drops_zero_levels():
    """Ties at half a step round to even (as ``levels`` does for documents), weights below
    half a step are dropped, empty rows stay empty; every row has its own step."""
    step = power_of_two_step(255.0, 8)  # 1.0: the row's largest weight is 255
    row = [255.0, 2.5, 3.5, 0.5, 0.25, 1.5]  # levels 255, 2, 4, 0 (dropped), 0 (dropped), 2
    coll = SparseCollection.from_scipy(sp.csr_matrix(np.array([row, [0.0] * 6, [0.0, 0.0, 0.0, 0.0, 3.0, 0.0]])))
    q = quantize_queries(coll, 8)
    assert step == 1.0
    np.testing.assert_array_equal(q.indptr, [0, 4, 4, 5])
    np.testing.assert_array_equal(q.indices, [0, 1, 2, 5, 4])
    third = power_of_two_step(3.0, 8)
    np.testing.assert_array_equal(q.values, np.array([255.0, 2.0, 4.0, 2.0, round(3.0 / third) * third], np.float32))
    assert q.values.dtype == np.float32 and q.indptr.dtype == np.int64


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4])
def test_every_kernel_is_exact_on_a_quantized_index(rng, bits, device):
    docs = random_collection(rng, 700, 90, 12, empty_fraction=0.05)
    queries = random_collection(rng, 9, 90, 8, empty_fraction=0.1)
    index = Index.build(docs, quantize=bits, device=device)
    # Only the engines that cannot run here are left out (e.g. Triton kernels on a CPU without
    # its interpreter); an engine that can run and raises fails the test.
    kernels = [kernel for kernel in engines.names() if engines.get(kernel).unavailable(index.device) is None]
    assert "reference" in kernels
    step = index.quantization.step
    assert index.quantization.bits == bits and step == power_of_two_step(float(docs.values.max()), bits)
    scores = quantized_by_hand(queries, None, bits) @ quantized_by_hand(docs, step, bits).T
    for k in (1, 10, 700):
        ref_s, ref_i = reference_topk(scores, k)
        for kernel in kernels:
            res = index.search(queries, k, kernel=kernel)
            np.testing.assert_array_equal(res.ids.numpy(), ref_i, err_msg=kernel)
            np.testing.assert_array_equal(res.scores.numpy(), ref_s, err_msg=kernel)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("acc", ["carry", "u32"])
@pytest.mark.parametrize("quantized_queries", [True, False])
def test_tiled_layout_stores_levels_and_stays_exact(rng, acc, device, quantized_queries):
    """Integer products when the queries are quantized too; float64 ones when they are not."""
    docs = random_collection(rng, 900, 120, 14, quantized=rng.random() < 0.5)
    queries = random_collection(rng, 7, 120, 9)
    index = Index.build(docs, device=device, quantize=8)
    tl = tiled_layout(index, 6, 0.05)
    assert tl.wts.dtype == torch.uint8 and tl.dense.dtype == torch.uint8 and tl.step == index.quantization.step
    assert tl.dense.shape[0] > 0 and tl.wts.numel() > 0  # both phases are exercised
    qq = quantize_queries(queries, 8) if quantized_queries else queries
    scores = dense_scores(SparseCollection.from_scipy(index_matrix(index)), qq)
    batch = query_batch(qq, index.device)
    fp = fixed_point(index, batch, acc)
    assert integer_weights(tl, batch, fp, acc) == (quantized_queries and acc == "u32")
    for k in (1, 5, 100, 900):
        s, i = tiled_search(index, batch, k, tile_bits=6, dense_min=0.05, acc=acc, emulated=device == "cpu").resolved()
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s)


@pytest.mark.parametrize("device", DEVICES)
def test_integer_sums_that_tie_after_float32_rounding_are_kept(device, monkeypatch):
    """8-bit levels times prepared queries' levels are exact integers, and the margin is 0 then
    (fixed_point.exact_margin): what keeps the documents whose float32 score ties the k-th one is
    the emission's float32 ulp alone. Here a query of 300 terms puts the sums between 2**24 and
    2**25, where float32 holds every other integer: documents i and i + 1 (sums n + i, n + i + 1)
    tie in pairs after rounding, and the k-th falls inside a pair, whose lower document id wins.
    Several waves, each compacted (so candidates are dropped at the running k-th's threshold)."""
    from gpusparse.engines.tiled import waves

    monkeypatch.setattr(waves, "SINGLE_WAVE_MAX_CANDIDATES", 0)
    monkeypatch.setattr(waves, "FINAL_COMPACTION_MIN_BATCH", 0)
    v, n_docs, u = 320, 200, 2.0**-8
    rows = []
    for i in range(1, n_docs + 1):  # term 0 at level i, terms 1..299 at level 255
        rows.append({0: i * u, **{t: 255 * u for t in range(1, 300)}})
    order = list(np.random.default_rng(5).permutation(n_docs))  # ids unrelated to the sums
    docs = sp.lil_matrix((n_docs, v), dtype=np.float32)
    for doc, r in zip(order, rows, strict=True):
        for t, w in r.items():
            docs[doc, t] = w
    docs = SparseCollection.from_scipy(docs.tocsr())
    q = sp.lil_matrix((1, v), dtype=np.float32)
    q[0, 0] = u
    for t in range(1, 300):
        q[0, t] = 255 * u
    queries = SparseCollection.from_scipy(q.tocsr())
    index = Index.build(docs, device=device, quantize=8)
    assert index.quantization.step == u
    scores = dense_scores(docs, queries)  # float64 products of exact levels, rounded to float32
    batch = query_batch(quantize_queries(queries, 8), index.device)
    fp = fixed_point(index, batch, "u32")
    assert integer_weights(tiled_layout(index, 5, 0.05), batch, fp, "u32")
    for k in (1, 2, 51, 52, 120, 200):
        ref_s, ref_i = reference_topk(scores, k)
        assert len(set(ref_s[0].tolist())) < k or k <= 2  # ties after rounding at this k
        emulated = device == "cpu"
        s, i = tiled_search(index, batch, k, tile_bits=5, dense_min=0.05, acc="u32", emulated=emulated).resolved()
        np.testing.assert_array_equal(i.cpu().numpy(), ref_i, err_msg=str(k))
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s, err_msg=str(k))


def index_matrix(index: Index):
    """The index's documents as a scipy CSR matrix (from its own arrays)."""
    from gpusparse.verify import documents_from_index_arrays

    a = {k: v.cpu().numpy() for k, v in index.arrays().items()}
    return documents_from_index_arrays(a["doc_ids"], a["scores"], a["offsets"], a["lengths"], index.n_docs)


def test_quantization_survives_save_and_load(rng, tmp_path):
    docs = random_collection(rng, 200, 40, 6)
    queries = random_collection(rng, 5, 40, 5)
    index = Index.build(docs, quantize=8)
    index.save(tmp_path / "ix")
    loaded = Index.load(tmp_path / "ix")
    assert loaded.quantization == index.quantization
    a, b = index.search(queries, 50), loaded.search(queries, 50)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.scores, b.scores)
    manifest = tmp_path / "ix" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["quantization"]["step"] = 0.3
    manifest.write_text(json.dumps(m))
    with pytest.raises(IndexFormatError, match="quantization"):
        Index.load(tmp_path / "ix")


def test_cli_index_quantize_info_search_and_verify(rng, tmp_path):
    docs = random_collection(rng, 300, 50, 8)
    docs.values[:3] = 1e-4  # below half a step: dropped, and said so
    queries = random_collection(rng, 6, 50, 6)
    write_jsonl(docs, tmp_path / "docs.jsonl")
    write_jsonl(queries, tmp_path / "queries.jsonl")
    res = ok("index", tmp_path / "docs.jsonl", "--output", tmp_path / "ix", "--quantize", "8")
    step = 2.0 ** np.ceil(np.log2(docs.values.max() / 255))
    dropped = int((np.rint(docs.values / step) == 0).sum())
    assert dropped >= 3
    assert "quantized to 8-bit impacts" in res.stderr and f" {dropped:,} of {docs.nnz:,} weights" in res.stderr
    info = ok("info", tmp_path / "ix").stdout
    assert "8-bit impacts" in info
    ok("search", tmp_path / "ix", tmp_path / "queries.jsonl", "--k", "20", "--output", tmp_path / "run.trec")
    rep = ok("verify", tmp_path / "ix", tmp_path / "queries.jsonl", "--run", tmp_path / "run.trec", "--json")
    assert json.loads(rep.stdout)["exact"] is True
    rep = ok(
        "verify", tmp_path / "ix", tmp_path / "queries.jsonl", "--run", tmp_path / "run.trec",
        "--docs", tmp_path / "docs.jsonl", "--json",
    )  # fmt: skip
    assert json.loads(rep.stdout)["exact"] is True
    bad = run("index", tmp_path / "docs.jsonl", "--output", tmp_path / "ix2", "--quantize", "9")
    assert bad.exit_code == 2 and "9" in bad.output
