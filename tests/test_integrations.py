"""gpusparse.integrations with the real libraries: PyTerrier, sentence-transformers, CIFF (protobuf).

Each part skips when its library is absent (all three are in the ``test`` extra); the
encoder tests need ../shared/models/splade-tiny. Everything runs on the CPU in seconds.
"""

from __future__ import annotations

import gzip
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import Index, SparseCollection, read_qrels, read_vectors
from gpusparse.errors import InputError
from gpusparse.evaluate import evaluate
from tests.shared_data import SPLADE_TINY, needs_shared, tiny_encoder

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"


@cache
def sample() -> tuple[SparseCollection, SparseCollection, dict]:
    """The shipped Cranfield sample: document vectors, the first 40 query vectors, qrels."""
    docs = read_vectors(SAMPLE / "corpus.jsonl.gz")
    queries = read_vectors(SAMPLE / "queries.jsonl.gz")[:40]
    qrels = read_qrels(SAMPLE / "qrels.tsv")
    return docs, queries, {q: qrels[q] for q in queries.ids if q in qrels}


# -- torch sparse tensors -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_torch_sparse_in_build_and_search(layout: str) -> None:
    docs, queries, _ = sample()
    d, q = docs.to_scipy().tocoo(), queries.to_scipy().tocoo()

    def tensor(m: sp.coo_matrix) -> torch.Tensor:
        t = torch.sparse_coo_tensor(np.vstack([m.row, m.col]), m.data, m.shape)  # not coalesced
        return t if layout == "coo" else t.coalesce().to_sparse_csr()

    want = Index.build(docs).search(queries, 20)
    ix = Index.build(tensor(d))
    got = ix.search(tensor(q), 20)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)
    coll = SparseCollection.from_torch_sparse(tensor(d), ids=docs.ids, vocab=docs.vocab)
    assert np.array_equal(coll.indptr, docs.indptr) and np.array_equal(coll.values, docs.values)


def test_torch_sparse_duplicates_summed_and_refusals() -> None:
    t = torch.sparse_coo_tensor([[0, 0, 1], [3, 3, 1]], [1.0, 2.0, 0.5], (2, 5))
    c = SparseCollection.from_torch_sparse(t)
    assert c.row(0) == {"3": 3.0} and c.row(1) == {"1": 0.5} and len(c.vocab) == 5
    with pytest.raises(TypeError, match="sparse COO or CSR"):
        SparseCollection.from_torch_sparse(torch.zeros(2, 5))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="negative"):
        SparseCollection.from_torch_sparse(torch.sparse_coo_tensor([[0], [1]], [-1.0], (1, 5)))


# -- CIFF -----------------------------------------------------------------------------------


def test_ciff_round_trip_quantized(tmp_path: Path) -> None:
    pytest.importorskip("google.protobuf")
    from gpusparse.integrations.ciff import export_ciff, index_from_ciff, iter_messages, read_ciff_header

    docs, queries, _ = sample()
    original = Index.build(docs, quantize=8)
    out = tmp_path / "sample.ciff.gz"
    report = export_ciff(original, out)
    assert report.n_postings == original.stats().n_postings and report.n_dropped == 0
    with gzip.open(out) as f:  # really gzipped
        f.read(1)
    head = read_ciff_header(out)
    assert (head.num_doc_records, head.step, head.bits) == (len(docs), original.quantization.step, 8)
    msgs = list(iter_messages(out))
    terms = [m.term for m in msgs[1 : 1 + head.num_postings_lists]]
    assert terms == sorted(terms, key=lambda t: t.encode())  # Lucene/PISA lexicon order
    pl = msgs[1]  # gaps: first absolute, then differences; tf = level (integer)
    docs_of = np.cumsum([p.docid for p in pl.postings])
    tid = original.vocab.get(pl.term)
    a = int(original.offsets[tid])
    assert np.array_equal(docs_of, original.doc_ids[a : a + len(docs_of)].numpy())
    levels = (original.scores[a : a + len(docs_of)].double() / head.step).numpy()
    assert np.array_equal([p.tf for p in pl.postings], levels)

    back = index_from_ciff(out)
    assert back.quantization == original.quantization and back.ids == original.ids
    want, got = original.search(queries, 50), back.search(queries, 50)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)


def test_ciff_float_index_exports_as_its_8bit_build(tmp_path: Path) -> None:
    pytest.importorskip("google.protobuf")
    from gpusparse.integrations.ciff import export_ciff, index_from_ciff, read_ciff

    docs, queries, _ = sample()
    out = tmp_path / "f.ciff"
    export_ciff(Index.build(docs), out)
    with pytest.raises(FileExistsError):
        export_ciff(Index.build(docs), out)
    want = Index.build(docs, quantize=8).search(queries, 30)
    got = index_from_ciff(out).search(queries, 30)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)
    raw = read_ciff(out, scale=1.0)  # tf as weights: integer impacts, as PISA reads them
    assert np.array_equal(raw.values, np.round(raw.values)) and raw.values.max() <= 255


def test_ciff_foreign_terms_and_bad_files(tmp_path: Path) -> None:
    pytest.importorskip("google.protobuf")
    from gpusparse.integrations.ciff import export_ciff, read_ciff

    coll = SparseCollection.from_dicts(
        [{"b": 2.0, "a": 1.0}, {"c": 4.0}], ids=["d1", "d2"], vocab=__import__("gpusparse").Vocabulary(["a", "b", "c"])
    )
    out = tmp_path / "x.ciff"
    export_ciff(Index.build(coll), out)
    back = read_ciff(out, scale=1.0)  # terms not all BERT tokens: the file's own vocabulary
    assert (
        back.ids == ["d1", "d2"] and back.row(0) == {"a": 32.0, "b": 64.0} and back.row(1) == {"c": 128.0}
    )  # step 2**-5: 4.0 / 255 rounded up
    data = out.read_bytes()
    (tmp_path / "cut.ciff").write_bytes(data[: len(data) - 3])
    with pytest.raises(InputError, match="record"):
        read_ciff(tmp_path / "cut.ciff")


def test_ciff_cli(tmp_path: Path) -> None:
    pytest.importorskip("google.protobuf")
    from click.testing import CliRunner

    from gpusparse.cli import main

    docs, queries, _ = sample()
    Index.build(docs, quantize=8).save(tmp_path / "ix")
    r = CliRunner().invoke(main, ["export-ciff", str(tmp_path / "ix"), str(tmp_path / "o.ciff")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["import-ciff", str(tmp_path / "o.ciff"), "-o", str(tmp_path / "back")])
    assert r.exit_code == 0, r.output
    a, b = Index.load(tmp_path / "ix").search(queries, 10), Index.load(tmp_path / "back").search(queries, 10)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.scores, b.scores)
    r = CliRunner().invoke(main, ["import-ciff", str(tmp_path / "o.ciff"), "-o", str(tmp_path / "back")])
    assert r.exit_code == 1 and "already exists" in r.output


def test_ciff_same_topk_as_pisa(tmp_path: Path) -> None:
    """PISA (pyterrier-pisa) on the same integer impacts that export_ciff writes ranks the same documents."""
    pisa = pytest.importorskip("pyterrier_pisa")
    pytest.importorskip("google.protobuf")
    import pandas as pd

    from gpusparse.integrations.ciff import export_ciff, read_ciff

    docs, queries, _ = sample()
    export_ciff(Index.build(docs, quantize=8), tmp_path / "s.ciff")
    impacts = read_ciff(tmp_path / "s.ciff", scale=1.0)  # integer tf
    index = pisa.PisaIndex(str(tmp_path / "pisa"), stemmer="none")
    index.toks_indexer(scale=1.0).index({"docno": i, "toks": impacts.row(r)} for r, i in enumerate(impacts.ids))
    q_int = SparseCollection(
        queries.indptr, queries.indices, np.round(queries.values * 100), queries.ids, queries.vocab
    )
    topics = pd.DataFrame({"qid": q_int.ids, "query_toks": [q_int.row(i) for i in range(len(q_int))]})
    theirs = index.quantized(num_results=10, toks_scale=1.0)(topics)
    ours = Index.build(impacts).retrieve(q_int, 10)
    for qid, rows in ours.items():
        got = theirs[theirs.qid == qid].sort_values("rank")
        np.testing.assert_allclose(got.score.to_numpy(), [s for _, s in rows], rtol=1e-6)


# -- PyTerrier --------------------------------------------------------------------------------


def test_pyterrier_experiment_equals_gpusparse_eval(tmp_path: Path) -> None:
    pytest.importorskip("pyterrier")
    import pandas as pd
    import pyterrier as pt

    from gpusparse.integrations.pyterrier import GPUSparseIndexer, GPUSparseRetriever

    docs, queries, qrels = sample()
    path = GPUSparseIndexer(tmp_path / "ix").index(
        {"docno": i, "doc_toks": docs.row(r)} for r, i in enumerate(docs.ids)
    )
    retriever = GPUSparseRetriever(path, k=100, batch_size=16)  # several batches
    topics = pd.DataFrame({"qid": queries.ids, "query_toks": [queries.row(i) for i in range(len(queries))]})
    res = retriever(topics)
    assert list(res.columns) == ["qid", "query_toks", "docno", "score", "rank"]
    first = res[res.qid == queries.ids[0]]
    assert first["rank"].tolist() == list(range(len(first))) and first.score.is_monotonic_decreasing
    qr = pd.DataFrame([(q, d, g) for q, dd in qrels.items() for d, g in dd.items()], columns=["qid", "docno", "label"])
    got = pt.Experiment([retriever], topics, qr, eval_metrics=["ndcg_cut_10", "recip_rank", "recall_100"])
    want = evaluate(Index.build(docs).retrieve(queries, 100), qrels, ["nDCG@10", "RR", "R@100"]).values
    row = got.iloc[0]
    assert row["ndcg_cut_10"] == pytest.approx(want["nDCG@10"], abs=1e-12)
    assert row["recip_rank"] == pytest.approx(want["RR"], abs=1e-12)
    assert row["recall_100"] == pytest.approx(want["R@100"], abs=1e-12)
    assert not pt.java.started()  # no JVM for any of it


@needs_shared
def test_pyterrier_text_queries_with_an_encoder() -> None:
    pytest.importorskip("pyterrier")
    import pandas as pd

    from gpusparse.integrations.pyterrier import GPUSparseRetriever

    enc = tiny_encoder()
    docs = enc.encode_documents(["the capital of france is paris", "vaccines and the immune system"], ["a", "b"])
    res = GPUSparseRetriever(Index.build(docs), k=2, encoder=enc)(pd.DataFrame({"qid": ["q"], "query": ["paris"]}))
    assert res.docno.tolist()[0] == "a" and "query" in res.columns
    with pytest.raises(ValueError, match="encoder"):
        GPUSparseRetriever(Index.build(docs))(pd.DataFrame({"qid": ["q"], "query": ["paris"]}))


# -- sentence-transformers --------------------------------------------------------------------


@needs_shared
def test_sparse_encoder_adapter_equals_splade_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sentence_transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from gpusparse.integrations.encoders import make_encoder

    adapter = make_encoder(SPLADE_TINY, "sentence-transformers", query_max_length=64, doc_max_length=256, device="cpu")
    ours = tiny_encoder()
    texts = ["what is the capital of france", "  ", "how do vaccines trigger the immune system " * 40]
    assert adapter.vocab == ours.vocab  # BERT's: the model's vocabulary mapped through its tokenizer
    for kind in ("query", "document"):
        a, b = adapter.encode(texts, kind=kind), ours.encode(texts, kind=kind)
        assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
        np.testing.assert_allclose(a.values, b.values, rtol=1e-5, atol=1e-6)
        assert a.row(1) == {}  # empty text, empty vector
    pruned = adapter.encode(texts, kind="query", prune_top=3)
    assert pruned.row(0).keys() == {"capital", "france", "french"}
    # The model's own sparse output goes into Index.build / search directly.
    st_docs = adapter.model.encode_document(texts[::2], convert_to_sparse_tensor=True)
    ix = Index.build(st_docs)
    res = ix.search(adapter.model.encode_query(["capital of france"]), 2)
    assert res.ids[0, 0].item() == 0
    with pytest.raises(ValueError, match="pooling"):
        make_encoder(SPLADE_TINY, "sentence-transformers", pooling="sum")
