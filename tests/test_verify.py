"""The exactness report: its scorer against the dense reference, our index against it, a corrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpusparse import Index, InputError, read_vectors
from gpusparse.verify import documents_from_index_arrays, exact_topk, verify_run

from .reference import dense_scores, random_collection, reference_topk
from .test_cli import assert_one_line_error, ok, run

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"


@pytest.fixture(scope="module")
def random_data():
    rng = np.random.default_rng(2611)
    docs = random_collection(rng, 700, 300, 25, quantized=True, empty_fraction=0.05)  # quantized: many ties
    queries = random_collection(rng, 23, 300, 6, empty_fraction=0.1)
    return docs, queries


@pytest.mark.parametrize("budget", [1 << 30, 8 * 23 * 50])  # one chunk, and chunks of 50 documents
def test_exact_topk_equals_dense_reference(random_data, budget):
    docs, queries = random_data
    k = 40
    ref_s, ref_i = reference_topk(dense_scores(docs, queries), k)
    top, _ = exact_topk(docs, queries, k, memory_budget=budget)
    np.testing.assert_array_equal(top.ids, ref_i)
    np.testing.assert_allclose(top.scores.astype(np.float32), ref_s, rtol=0, atol=0)


def test_documents_from_index_arrays_are_the_collection(random_data):
    docs, _ = random_data
    index = Index.build(docs)
    a = {k: v.numpy() for k, v in index.arrays().items()}
    mat = documents_from_index_arrays(a["doc_ids"], a["scores"], a["offsets"], a["lengths"], index.n_docs)
    assert (mat != docs.to_scipy()).nnz == 0


def as_run(index: Index, queries, k: int) -> dict[str, list[tuple[str, float]]]:
    res = index.search(queries, k)
    return {
        q: [(index.ids[d], s) for d, s in zip(res.ids[i].tolist(), res.scores[i].tolist(), strict=True) if d >= 0]
        for i, q in enumerate(queries.ids)
    }


def test_our_search_is_exact_and_a_corrupted_run_is_caught(random_data):
    docs, queries = random_data
    index = Index.build(docs)
    good = as_run(index, queries, 100)
    report = verify_run(good, queries, docs, docs.ids, ks=(10, 100))
    assert report.exact and report.recall == {10: 1.0, 100: 1.0}
    assert report.max_ulp_diff <= 0.5 + 1e-6 and report.max_abs_diff < 1e-5
    assert report.queries_with_matches == sum(1 for q in good.values() if q)

    # Swap the 3rd result of one query for a document outside its top-100: recall drops.
    qid = next(q for q, rows in good.items() if len(rows) == 100)
    inside = {d for d, _ in good[qid]}
    outsider = next(d for d in docs.ids if d not in inside)
    bad = {q: list(rows) for q, rows in good.items()}
    bad[qid][2] = (outsider, bad[qid][2][1])
    report = verify_run(bad, queries, docs, docs.ids, ks=(10, 100))
    assert not report.exact
    n = report.queries_with_matches
    assert report.recall[10] == pytest.approx(1 - 0.1 / n) and report.recall[100] == pytest.approx(1 - 0.01 / n)
    assert report.max_abs_diff > 0

    # Nudge one score by a few float32 ulps: the sets agree, the score check does not.
    nudged = {q: list(rows) for q, rows in good.items()}
    d, s = nudged[qid][0]
    nudged[qid][0] = (d, float(np.float32(s) + 4 * np.spacing(np.float32(s))))
    report = verify_run(nudged, queries, docs, docs.ids, ks=(10, 100))
    assert report.recall == {10: 1.0, 100: 1.0} and not report.exact
    assert report.max_ulp_diff == pytest.approx(4, abs=0.5) and report.worst[:2] == (qid, d)


def test_depth_and_unknown_ids(random_data):
    docs, queries = random_data
    index = Index.build(docs)
    shallow = as_run(index, queries, 10)
    report = verify_run(shallow, queries, docs, docs.ids, ks=(10, 100))
    assert report.recall[10] == 1.0 and report.recall[100] is None
    assert any("n/a" in line for line in report.lines())
    with pytest.raises(InputError, match="document 'zz' is not in the index"):
        verify_run({queries.ids[0]: [("zz", 1.0)]}, queries, docs, docs.ids)
    with pytest.raises(InputError, match="not in the queries file"):
        verify_run({"nope": []}, queries, docs, docs.ids)


@pytest.fixture(scope="module")
def sample_index(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "index"
    Index.build(read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False)).save(path)
    return path


def test_cli_verify_sample(sample_index, tmp_path):
    queries = SAMPLE / "queries.jsonl.gz"
    out = ok("verify", sample_index, queries).stdout
    assert "Recall@1000   1.000000  (225 of 225 queries identical)" in out and out.rstrip().endswith("exact: yes")
    # A run file checked against the original vectors (nothing built by GPUSparse).
    runf = tmp_path / "run.trec"
    ok("search", sample_index, queries, "-o", runf)
    js = json.loads(
        ok("verify", sample_index, queries, "--run", runf, "--docs", SAMPLE / "corpus.jsonl.gz", "--json").stdout
    )
    assert js["exact"] and js["recall"] == {"R@10": 1.0, "R@100": 1.0, "R@1000": 1.0}
    # Corrupt the run: drop the first result of the first query (ranks shift up).
    lines = runf.read_text().splitlines()
    bad = tmp_path / "bad.trec"
    bad.write_text("\n".join(lines[1:]) + "\n")
    result = run("verify", sample_index, queries, "--run", bad)
    assert "exact: NO" in result.stdout
    assert_one_line_error(result, "differs from exact search")


def test_cli_verify_bad_input(sample_index, tmp_path):
    queries = SAMPLE / "queries.jsonl.gz"
    assert_one_line_error(run("verify", tmp_path / "nope", queries), "nope")
    bad = tmp_path / "bad.trec"
    bad.write_text("1 Q0 no-such-doc 1 2.0 t\n")
    assert_one_line_error(
        run("verify", sample_index, queries, "--run", bad), "document 'no-such-doc' is not in the index"
    )
    result = run("verify", sample_index, queries, "--at", "ten")
    assert result.exit_code == 2 and "--at" in result.stderr
