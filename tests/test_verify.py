"""The exactness report: its scorer against the dense reference, our index against it, a corrupted run."""

from __future__ import annotations

import itertools
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


def one_doc_case():
    """A document whose exact score is 4 − 0.3 float32 ulp (rounds to 4.0, just below a power of two)."""
    from gpusparse import SparseCollection

    below4 = float(np.nextafter(np.float32(4.0), np.float32(0)))  # 3.9999998 = 4 - 2**-22
    tail = float(np.float32(0.7) * np.float32(2.0**-22))
    docs = SparseCollection.from_dicts([{"a": below4, "b": tail}, {"a": 1.0}, {"a": 1.0}], ids=["d0", "d1", "d2"])
    queries = SparseCollection.from_dicts([{"a": 1.0, "b": 1.0}], ids=["q"], vocab=docs.vocab)
    return docs, queries, below4


def test_the_wrong_float32_neighbour_below_a_power_of_two_is_rejected():
    docs, queries, below4 = one_doc_case()
    good = {"q": [("d0", 4.0), ("d1", 1.0), ("d2", 1.0)]}
    assert verify_run(good, queries, docs, docs.ids, ks=(3,)).exact
    bad = {"q": [("d0", below4), ("d1", 1.0), ("d2", 1.0)]}  # 0.7 of a float32 step from the exact sum
    report = verify_run(bad, queries, docs, docs.ids, ks=(3,))
    assert not report.exact and report.n_mismatches["scores"] == 1
    assert "'d0'" in report.mismatches[0] and "exact float32 4.0" in report.mismatches[0]
    assert report.lines()[-1] == "exact: NO"


def test_swapped_ranks_and_a_wrong_rank_column_are_rejected(random_data):
    docs, queries = random_data
    good = as_run(Index.build(docs), queries, 100)
    qid = next(q for q, rows in good.items() if len(rows) >= 2 and rows[0][1] != rows[1][1])
    swapped = {q: list(rows) for q, rows in good.items()}
    swapped[qid][0], swapped[qid][1] = swapped[qid][1], swapped[qid][0]
    report = verify_run(swapped, queries, docs, docs.ids, ks=(10, 100))
    assert report.recall == {10: 1.0, 100: 1.0}  # the sets agree
    assert not report.exact and report.n_mismatches["order"] == 1
    assert f"query {qid!r} rank 1" in report.mismatches[0]
    # Equal scores: the lower document number first.
    tie_q = next((q for q, rows in good.items() for a, b in itertools.pairwise(rows) if a[1] == b[1]), None)
    assert tie_q is not None  # quantized documents: ties exist
    rows = good[tie_q]
    r = next(i for i in range(len(rows) - 1) if rows[i][1] == rows[i + 1][1])
    tied = {q: list(v) for q, v in good.items()}
    tied[tie_q][r], tied[tie_q][r + 1] = tied[tie_q][r + 1], tied[tie_q][r]
    assert verify_run(tied, queries, docs, docs.ids, ks=(10, 100)).n_mismatches["order"] == 1
    # The rank column must count 1, 2, 3, ... in the listed order.
    ranked = {q: [(d, s, i + 1) for i, (d, s) in enumerate(v)] for q, v in good.items()}
    assert verify_run(ranked, queries, docs, docs.ids, ks=(10, 100)).exact
    ranked[qid][0] = (ranked[qid][0][0], ranked[qid][0][1], 2)
    report = verify_run(ranked, queries, docs, docs.ids, ks=(10, 100))
    assert not report.exact and report.n_mismatches == {"scores": 0, "order": 0, "rank column": 1}


def test_independent_quantizer_matches_the_index(rng):
    from gpusparse.quantize import quantize_collection, quantize_queries
    from gpusparse.verify import quantize_levels, quantize_query_rows

    docs = random_collection(rng, 300, 50, 8)
    queries = random_collection(rng, 12, 50, 6)
    for bits in (4, 8):
        qd, report = quantize_collection(docs, bits)
        ours = quantize_levels(docs.to_scipy(), report.quantization.step, bits)
        assert (ours != qd.to_scipy()).nnz == 0
        assert (quantize_query_rows(queries.to_scipy(), bits) != quantize_queries(queries, bits).to_scipy()).nnz == 0


def test_cli_verify_sample_of_a_few_thousand_documents(rng, tmp_path):
    from gpusparse import SparseCollection, Vocabulary
    from gpusparse.vector_writers import write_jsonl

    def words(c):  # BERT word pieces from 2000 on (plain tokens), as the CLI's files hold
        return SparseCollection(c.indptr, c.indices + 2000, c.values, vocab=Vocabulary.bert())

    docs = words(random_collection(rng, 4000, 400, 20, quantized=True))
    queries = words(random_collection(rng, 300, 400, 8))
    write_jsonl(docs, tmp_path / "docs.jsonl")
    write_jsonl(queries, tmp_path / "queries.jsonl")
    index = tmp_path / "index"
    ok("index", tmp_path / "docs.jsonl", "--output", index)
    runf = tmp_path / "run.trec"
    ok("search", index, tmp_path / "queries.jsonl", "--k", "100", "-o", runf)
    out = ok("verify", index, tmp_path / "queries.jsonl", "--run", runf, "--sample", "25", "--at", "10 100").stdout
    assert "a random sample of 25 of 300 queries" in out and out.rstrip().endswith("exact: yes")
    # Nudge every score by one float32 step: any sample catches it.
    lines = []
    for line in runf.read_text().splitlines():
        q, z, d, r, s, t = line.split()
        lines.append(" ".join([q, z, d, r, repr(float(np.nextafter(np.float32(s), np.float32(np.inf)))), t]))
    bad = tmp_path / "bad.trec"
    bad.write_text("\n".join(lines) + "\n")
    result = run("verify", index, tmp_path / "queries.jsonl", "--run", bad, "--sample", "5", "--at", "10 100")
    assert "exact: NO" in result.stdout and "first mismatches" in result.stdout
