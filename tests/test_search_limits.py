"""Issue 24, items 7 and 8 at search time: queries whose scores could overflow float32 are
refused before any search, everywhere; a ``k`` larger than the collection costs no more
than ``k = n_docs`` and has one documented result width, in the API, the CLI and the server.
"""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner

from gpusparse import Index, SparseCollection, read_vectors
from gpusparse.cli import main
from gpusparse.distributed import search_sharded
from gpusparse.errors import InputError
from gpusparse.layout.statistics import max_scores_host
from gpusparse.queries import F32_MAX, check_score_bound, score_bounds
from gpusparse.search import MAX_PADDED_K, result_width
from gpusparse.segments import SegmentedIndex
from gpusparse.streaming import StreamedIndex

from .distributed_worker import bound_worker

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"
HUGE_K = 100_000_000_000  # [225, k] float32 + int64 would be 270 TB
BIG = {"wing": 3e38, "flutter": 3e38}  # each weight finite, the scores not


@cache
def cranfield() -> tuple[Index, SparseCollection]:
    index = Index.build(read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False))
    return index, read_vectors(SAMPLE / "queries.jsonl.gz", index.vocab, progress=False)


def run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.stderr.splitlines() if not ln.startswith("read ")]
    assert len(lines) == 1 and lines[0].startswith("gpusparse: error: "), result.stderr
    return lines[0]


# -- item 7: scores that would overflow float32 ------------------------------------------------


def test_score_bound_is_the_float64_sum_of_weight_times_term_maximum():
    index, queries = cranfield()
    m = max_scores_host(index)
    got = score_bounds(queries[:20], m)
    for i in range(20):
        row = queries.row(i)
        want = sum(w * m[index.vocab.get(t)] for t, w in row.items())
        assert got[i] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("where", ["index", "streamed", "quantized", "segmented", "shard"])
def test_overflowing_query_is_refused_before_search(where, tmp_path):
    index, queries = cranfield()
    q = SparseCollection.from_dicts([queries.row(0), BIG], ids=["q-ok", "q-big"], vocab=index.vocab)
    if where == "index":
        target = index
    elif where == "streamed":
        target = StreamedIndex(index, 3, "cpu")
    elif where == "quantized":
        target = Index.build(read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False), quantize=8)
    elif where == "segmented":
        target = SegmentedIndex.create(tmp_path / "seg", read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False))
    if where == "shard":
        with pytest.raises(InputError, match=r"query 'q-big': its weights are too large: a score could overflow"):
            search_sharded(index, q, 10, distributed=False)
        return
    with pytest.raises(InputError, match=r"query 'q-big': its weights are too large: a score could overflow"):
        target.search(q, 10)


def test_segment_bound_is_that_of_all_segments(tmp_path):
    """A query refused by the compacted index is refused by its segments too, even when no
    single segment holds both of its largest terms."""
    index, _ = cranfield()
    vocab = index.vocab
    a = SparseCollection.from_dicts([{"wing": 2.0}], ids=["a"], vocab=vocab)
    b = SparseCollection.from_dicts([{"flutter": 2.0}], ids=["b"], vocab=vocab)
    seg = SegmentedIndex.create(tmp_path / "seg", a)
    seg.add(b)
    q = [{"wing": 1e38, "flutter": 1e38}]  # each segment alone: 2e38; both: 4e38 > 3.4e38
    whole = Index.build(SparseCollection.concat([a, b]))
    for target in (whole, seg):
        with pytest.raises(InputError, match="too large"):
            target.search(q, 2)


def test_accepted_queries_never_score_inf():
    """Near the bound: either refused, or every score is finite (the bound allows for rounding)."""
    index, _ = cranfield()
    m = max_scores_host(index)
    rng = np.random.default_rng(7)
    refused = accepted = 0
    for _ in range(40):
        terms = rng.choice(np.flatnonzero(m > 0), size=rng.integers(1, 6), replace=False)
        raw = rng.random(terms.size) + 0.01
        scale = F32_MAX / float(raw @ m[terms]) * rng.uniform(0.98, 1.02)
        query = {
            index.vocab.token(int(t)): float(np.float32(min(w * scale, F32_MAX)))
            for t, w in zip(terms, raw, strict=True)
        }
        try:
            res = index.search([query], 5)
        except InputError:
            refused += 1
            continue
        accepted += 1
        assert torch.isfinite(res.scores).all()
    assert refused and accepted


def test_check_score_bound_on_empty_and_zero_queries():
    index, _ = cranfield()
    q = SparseCollection.from_dicts([{}, {"wing": 0.0}], vocab=index.vocab)
    check_score_bound(q, max_scores_host(index))  # nothing to refuse
    np.testing.assert_array_equal(score_bounds(q, max_scores_host(index)), [0.0, 0.0])


def test_cli_refuses_an_overflowing_query_in_one_line_and_writes_no_run(tmp_path):
    assert run("index", SAMPLE / "corpus.jsonl.gz", "-o", tmp_path / "idx", "--no-progress").exit_code == 0
    qfile = tmp_path / "q.jsonl.gz"
    with gzip.open(SAMPLE / "queries.jsonl.gz", "rt") as f:
        lines = f.read().splitlines()[:3]
    lines.append(json.dumps({"id": "q-big", "vector": BIG}))
    with gzip.open(qfile, "wt") as f:
        f.write("\n".join(lines) + "\n")
    out = tmp_path / "run.trec"
    line = one_line_error(run("search", tmp_path / "idx", qfile, "-o", out, "--no-progress"))
    assert "query 'q-big'" in line and "too large" in line
    assert not out.exists() and not list(tmp_path.glob(".run.trec*"))


def test_distributed_processes_all_refuse_or_none(tmp_path):
    """The large weights sit in one shard only: every process refuses (none waits in a collective)."""
    mp.spawn(bound_worker, args=(2, str(tmp_path)), nprocs=2)
    outs = [torch.load(tmp_path / f"bound{r}.pt") for r in range(2)]
    for out in outs:
        assert "too large" in out["refused"]
        assert out["width"] == out["n_docs"]  # a huge k: one column per document of all shards
    assert torch.equal(outs[0]["ids"], outs[1]["ids"]) and outs[0]["ids"][0].tolist() == [2, 1, 3, 0]


# -- item 8: k larger than the collection -----------------------------------------------------


def test_result_width_rule():
    assert result_width(10, 5) == 10  # padded, as before
    assert result_width(MAX_PADDED_K, 5) == MAX_PADDED_K
    assert result_width(MAX_PADDED_K + 1, 5) == 5  # beyond the bound: the collection's size
    assert result_width(HUGE_K, 2 * MAX_PADDED_K) == 2 * MAX_PADDED_K
    assert result_width(3 * MAX_PADDED_K, 5 * MAX_PADDED_K) == 3 * MAX_PADDED_K


@pytest.mark.parametrize("where", ["index", "streamed", "segmented", "shard"])
def test_huge_k_equals_k_n_docs_and_small_k_beyond_n_docs_pads(where, tmp_path):
    index, queries = cranfield()
    n = index.n_docs
    want = index.search(queries, n)
    if where == "index":
        search = index.search
    elif where == "streamed":
        search = StreamedIndex(index, 3, "cpu").search
    elif where == "segmented":
        seg = SegmentedIndex.create(tmp_path / "seg", read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False))
        seg.delete(["17", "18"])
        live = Index.build(read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False))
        res = seg.search(queries, HUGE_K)
        assert res.scores.shape == (len(queries), n - 2) and len(res.ids[0]) == n - 2
        assert not any(d in ("17", "18") for row in res.ids for d in row)
        padded = seg.search(queries, n + 5)
        assert padded.scores.shape == (len(queries), n + 5) and bool((padded.positions[:, n - 2 :] == -1).all())
        del live
        return
    else:

        def search(q, k):
            return search_sharded(index, q, k, distributed=False)

    got = search(queries, HUGE_K)
    assert got.scores.shape == (len(queries), n)
    assert torch.equal(got.scores, want.scores) and torch.equal(got.ids, want.ids)
    padded = search(queries, n + 100)
    assert padded.scores.shape == (len(queries), n + 100)
    assert torch.equal(padded.ids[:, :n], want.ids) and bool((padded.ids[:, n:] == -1).all())
    assert bool((padded.scores[:, n:] == 0).all())


def test_huge_k_searches_with_at_most_n_docs(monkeypatch):
    """The engine is asked for at most n_docs results: no [n_queries, k] allocation."""
    import gpusparse.engines.reference as ref

    index, queries = cranfield()
    asked: list[int] = []
    plain = ref.ReferenceEngine.search_batch

    def spy(self, idx, q, k, plan):
        asked.append(k)
        return plain(self, idx, q, k, plan)

    monkeypatch.setattr(ref.ReferenceEngine, "search_batch", spy)
    index.search(queries, HUGE_K, kernel="reference")
    assert asked and max(asked) == index.n_docs


def test_cli_huge_k_writes_the_run_of_k_n_docs(tmp_path):
    assert run("index", SAMPLE / "corpus.jsonl.gz", "-o", tmp_path / "idx", "--no-progress").exit_code == 0
    index, _ = cranfield()
    for k in (HUGE_K, index.n_docs):
        r = run("search", tmp_path / "idx", SAMPLE / "queries.jsonl.gz", "-o", tmp_path / f"{k}.trec", "-k", k)
        assert r.exit_code == 0, r.stderr
    assert (tmp_path / f"{HUGE_K}.trec").read_bytes() == (tmp_path / f"{index.n_docs}.trec").read_bytes()
