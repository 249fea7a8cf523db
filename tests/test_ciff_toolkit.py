"""CIFF checked against a second implementation: ciff-toolkit (its own compiled protobuf schema,
CiffReader / CiffWriter), in the ``test`` extra.

(a) A file ``gpusparse export-ciff`` writes is read by ciff-toolkit: header, every postings
list and every document record equal our index's, and a float64 scorer over ciff-toolkit's
postings ranks as ``gpusparse search`` (and PISA, where pyterrier-pisa is installed, over the
same postings). (b) A file ciff-toolkit writes (plain and gzipped) is read by ``gpusparse
import-ciff`` and ``index --ciff`` and searched with the reference's results. CPU, seconds.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from click.testing import CliRunner

from gpusparse import Index, SparseCollection, Vocabulary, read_vectors, write_jsonl
from gpusparse.cli import main
from gpusparse.verify import quantize_query_rows, read_run

from .reference import canonical_scores, reference_topk

ciff_toolkit = pytest.importorskip("ciff_toolkit")
pytest.importorskip("google.protobuf")

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"
K = 10


@cache
def sample() -> tuple[SparseCollection, SparseCollection]:
    """The shipped Cranfield sample: its documents and all its queries."""
    return read_vectors(SAMPLE / "corpus.jsonl.gz"), read_vectors(SAMPLE / "queries.jsonl.gz")


def cli(*args: object) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


def read_with_toolkit(path: Path) -> tuple[object, list[object], list[object]]:
    """ciff-toolkit's header, postings lists and document records of ``path``."""
    from ciff_toolkit.read import CiffReader

    with CiffReader(path) as reader:
        header = reader.read_header()
        lists = list(reader.read_postings_lists())
        docs = list(reader.read_documents())
    return header, lists, docs


def toolkit_collection(lists: list, docs: list, vocab: Vocabulary, scale: float) -> SparseCollection:
    """The documents of ciff-toolkit's messages as rows (weight = tf · scale), decoded here:
    document numbers are the running sums of the gaps."""
    rows, cols, vals = [], [], []
    for pl in lists:
        gaps = np.array([p.docid for p in pl.postings], dtype=np.int64)
        rows.append(np.cumsum(gaps))
        cols.append(np.full(gaps.size, vocab.get(pl.term), dtype=np.int64))
        vals.append(np.array([p.tf for p in pl.postings], dtype=np.float64) * scale)
    mat = sp.csr_matrix(
        (np.concatenate(vals).astype(np.float32), (np.concatenate(rows), np.concatenate(cols))),
        shape=(len(docs), len(vocab)),
    )
    ids = [d.collection_docid for d in sorted(docs, key=lambda d: d.docid)]
    return SparseCollection.from_scipy(mat, ids=ids, vocab=vocab)


def top_k_run(docs: SparseCollection, queries: SparseCollection, k: int) -> dict[str, list[tuple[str, np.float32]]]:
    """The float64 reference's top-``k`` (ties by document number) as ``{qid: [(doc id, score)]}``."""
    scores, ranked = reference_topk(canonical_scores(docs, queries), k)
    return {
        q: [(docs.ids[d], scores[i, r]) for r, d in enumerate(ranked[i]) if d >= 0] for i, q in enumerate(queries.ids)
    }


def run_of(path: Path) -> dict[str, list[tuple[str, np.float32]]]:
    return {q: [(d, np.float32(s)) for d, s, _ in rows] for q, rows in read_run(path).items()}


def assert_same_run(got: dict, want: dict) -> None:
    assert got.keys() <= want.keys()
    for q, rows in want.items():
        assert got.get(q, []) == rows, q


# -- (a) our files, read by ciff-toolkit ----------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("ciff-out")
    write_jsonl(sample()[1], d / "q.jsonl")
    cli("index", SAMPLE / "corpus.jsonl.gz", "-o", d / "ix", "--quantize", 8, "--no-progress")
    cli("export-ciff", d / "ix", d / "ix.ciff")
    cli("export-ciff", d / "ix", d / "ix.ciff.gz")
    cli("search", d / "ix", d / "q.jsonl", "-o", d / "ix.trec", "--k", K, "--no-progress")
    return {"dir": d, "index": Index.load(d / "ix")}


@pytest.mark.parametrize("name", ["ix.ciff", "ix.ciff.gz"])
def test_toolkit_reads_our_export_as_our_index(exported, name):
    index: Index = exported["index"]
    header, lists, docs = read_with_toolkit(exported["dir"] / name)
    q = index.quantization
    assert q is not None and q.bits == 8
    lengths, offsets = index.lengths.numpy(), index.offsets.numpy()
    doc_ids, scores = index.doc_ids.numpy(), index.scores.numpy()
    terms = np.flatnonzero(lengths > 0)
    levels = np.round(scores.astype(np.float64) / q.step).astype(np.int64)
    real = doc_ids >= 0
    assert np.array_equal(levels[real] * q.step, scores[real].astype(np.float64))  # weights are levels · step
    doc_len = np.zeros(index.n_docs, dtype=np.int64)
    np.add.at(doc_len, doc_ids[real], levels[real])

    assert header.version == 1
    assert header.num_postings_lists == header.total_postings_lists == terms.size
    assert header.num_docs == header.total_docs == index.n_docs
    assert header.total_terms_in_collection == int(doc_len.sum())
    assert header.average_doclength == pytest.approx(doc_len.sum() / index.n_docs, rel=1e-15)
    assert f"weight = tf * {q.step!r} (8-bit)" in header.description

    assert sorted(pl.term.encode() for pl in lists) == [pl.term.encode() for pl in lists]  # byte order, as Lucene
    assert sorted(index.vocab.get(pl.term) for pl in lists) == terms.tolist()
    for pl in lists:
        t = index.vocab.get(pl.term)
        a, n = int(offsets[t]), int(lengths[t])
        got_docs = np.cumsum([p.docid for p in pl.postings])
        got_tf = np.array([p.tf for p in pl.postings])
        assert np.array_equal(got_docs, doc_ids[a : a + n]), pl.term
        assert np.array_equal(got_tf, levels[a : a + n]), pl.term
        assert pl.df == n and pl.cf == int(got_tf.sum()), pl.term
    assert [d.docid for d in docs] == list(range(index.n_docs))
    assert [d.collection_docid for d in docs] == index.ids
    assert [d.doclength for d in docs] == doc_len.tolist()


def test_top_k_over_toolkit_postings_equals_gpusparse_search(exported):
    """A float64 scorer over ciff-toolkit's postings (weight = tf · step, queries quantized as
    the checker of gpusparse verify does) gives the run ``gpusparse search`` wrote."""
    index: Index = exported["index"]
    _, lists, docs = read_with_toolkit(exported["dir"] / "ix.ciff")
    coll = toolkit_collection(lists, docs, index.vocab, index.quantization.step)
    _, queries = sample()
    qmat = quantize_query_rows(queries.to_scipy(), index.quantization.bits)
    qs = SparseCollection.from_scipy(qmat, ids=list(queries.ids), vocab=queries.vocab)
    want = top_k_run(coll, qs, K)
    assert sum(len(v) for v in want.values()) == K * len(queries)  # every query has K results
    assert_same_run(run_of(exported["dir"] / "ix.trec"), want)


def test_pisa_over_toolkit_postings_ranks_as_gpusparse(exported, tmp_path):
    """PISA (pyterrier-pisa) indexes ciff-toolkit's postings of our file (tf as impacts) and
    scores the same top-10 as GPUSparse's own reading of that file (scale 1)."""
    pisa = pytest.importorskip("pyterrier_pisa")
    import pandas as pd

    from gpusparse.integrations.ciff import read_ciff

    index: Index = exported["index"]
    _, lists, docs = read_with_toolkit(exported["dir"] / "ix.ciff")
    impacts = toolkit_collection(lists, docs, index.vocab, 1.0)
    ours = read_ciff(exported["dir"] / "ix.ciff", scale=1.0)
    assert np.array_equal(ours.to_scipy().toarray(), impacts.to_scipy().toarray()) and ours.ids == impacts.ids
    pidx = pisa.PisaIndex(str(tmp_path / "pisa"), stemmer="none")
    pidx.toks_indexer(scale=1.0).index({"docno": i, "toks": impacts.row(r)} for r, i in enumerate(impacts.ids))
    _, queries = sample()
    q_int = SparseCollection(
        queries.indptr, queries.indices, np.round(queries.values * 100), queries.ids, queries.vocab
    )
    topics = pd.DataFrame({"qid": q_int.ids, "query_toks": [q_int.row(i) for i in range(len(q_int))]})
    theirs = pidx.quantized(num_results=K, toks_scale=1.0)(topics)
    mine = Index.build(ours).retrieve(q_int, K)
    for qid, rows in mine.items():
        got = theirs[theirs.qid == qid].sort_values("rank")
        np.testing.assert_array_equal(got.score.to_numpy(dtype=np.float64), [s for _, s in rows])
        cut = rows[-1][1] if len(rows) == K else None  # documents tied with the k-th may differ
        assert {d for d, s in rows if s != cut} <= set(got.docno), qid


# -- (b) ciff-toolkit's files, read by gpusparse ----------------------------------------------


def write_with_toolkit(path: Path, docs: SparseCollection, tf: np.ndarray) -> None:
    """``docs`` (weights replaced by the integer ``tf``) as CIFF, by ciff-toolkit's writer."""
    from ciff_toolkit.ciff_pb2 import DocRecord, Header, PostingsList
    from ciff_toolkit.write import CiffWriter

    mat = sp.csr_matrix((tf, docs.indices, docs.indptr), shape=(len(docs), len(docs.vocab))).tocsc()
    terms = sorted(np.flatnonzero(np.diff(mat.indptr)).tolist(), key=lambda t: docs.vocab.token(t).encode())
    lengths = np.asarray(mat.sum(axis=1)).ravel().astype(np.int64)
    lists = []
    for t in terms:
        rows, tfs = mat.indices[mat.indptr[t] : mat.indptr[t + 1]], mat.data[mat.indptr[t] : mat.indptr[t + 1]]
        pl = PostingsList(term=docs.vocab.token(t), df=rows.size, cf=int(tfs.sum()))
        for g, f in zip(np.diff(rows, prepend=0).tolist(), tfs.tolist(), strict=True):
            pl.postings.add(docid=g, tf=int(f))
        lists.append(pl)
    header = Header(
        version=1,
        num_postings_lists=len(lists),
        num_docs=len(docs),
        total_postings_lists=len(lists),
        total_docs=len(docs),
        total_terms_in_collection=int(lengths.sum()),
        average_doclength=float(lengths.mean()),
        description="written by ciff-toolkit",
    )
    records = [
        DocRecord(docid=i, collection_docid=d, doclength=int(n))
        for i, (d, n) in enumerate(zip(docs.ids, lengths, strict=True))
    ]
    with CiffWriter(path) as writer:
        writer.write_header(header)
        writer.write_postings_lists(lists)
        writer.write_documents(records)


@cache
def impacts() -> tuple[np.ndarray, dict]:
    """Integer impacts of the sample's documents, and the float64 reference's top-K over them."""
    docs, queries = sample()
    tf = np.round(docs.values * 40).clip(1, 255).astype(np.int64)
    coll = SparseCollection(docs.indptr, docs.indices, tf.astype(np.float32), list(docs.ids), docs.vocab)
    return tf, top_k_run(coll, queries, K)


@pytest.mark.parametrize("name", ["toolkit.ciff", "toolkit.ciff.gz"])
def test_gpusparse_reads_a_toolkit_file(tmp_path, name):
    docs, queries = sample()
    tf, want = impacts()
    write_with_toolkit(tmp_path / name, docs, tf)
    if name.endswith(".gz"):
        assert (tmp_path / name).read_bytes()[:2] == b"\x1f\x8b"  # gzipped by the toolkit
    write_jsonl(queries, tmp_path / "q.jsonl")
    cli("import-ciff", tmp_path / name, "-o", tmp_path / "imported")
    cli("index", "--ciff", tmp_path / name, "-o", tmp_path / "indexed")
    for folder in ("imported", "indexed"):
        index = Index.load(tmp_path / folder)
        assert index.quantization is None and index.ids == docs.ids  # float32 weights: tf · 1
        out = tmp_path / f"{folder}.trec"
        cli("search", tmp_path / folder, tmp_path / "q.jsonl", "-o", out, "--k", K, "--no-progress")
        assert_same_run(run_of(out), want)
