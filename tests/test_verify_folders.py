"""``gpusparse verify`` reads every folder kind that ``gpusparse search`` reads: plain,
sharded (``index --shards``) and segmented (``add`` / ``delete``: only live documents)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from gpusparse import SparseCollection, Vocabulary, read_vectors
from gpusparse.cli.verify import folder_documents
from gpusparse.vector_writers import write_jsonl

from .reference import random_collection
from .test_cli import assert_one_line_error, ok, run


def _words(c: SparseCollection, prefix: str, start: int = 0) -> SparseCollection:
    """BERT word pieces from 2000 on (plain tokens), string ids ``prefix-N``."""
    ids = [f"{prefix}-{start + i}" for i in range(len(c))]
    return SparseCollection(c.indptr, c.indices + 2000, c.values, ids=ids, vocab=Vocabulary.bert())


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(2020)
    # Quantized weights: many tied scores, so the order of ties (document number) is checked.
    docs = _words(random_collection(rng, 240, 120, 12, quantized=True), "doc")
    new = _words(random_collection(rng, 40, 120, 12, quantized=True), "new")
    queries = _words(random_collection(rng, 30, 120, 5), "q")
    out = {"docs": tmp_path / "docs.jsonl", "new": tmp_path / "new.jsonl", "queries": tmp_path / "queries.jsonl"}
    write_jsonl(docs, out["docs"])
    write_jsonl(new, out["new"])
    write_jsonl(queries, out["queries"])
    return out


def _bump_one_score(runf: Path, tmp_path: Path) -> Path:
    """The run with one score moved up by one float32 step."""
    lines = runf.read_text().splitlines()
    q, z, d, r, s, t = lines[3].split()
    lines[3] = " ".join([q, z, d, r, repr(float(np.nextafter(np.float32(s), np.float32(np.inf)))), t])
    bad = tmp_path / "bad.trec"
    bad.write_text("\n".join(lines) + "\n")
    return bad


def _check_folder(index: Path, queries: Path, tmp_path: Path) -> str:
    """search's run verifies as exact, so does a search now, and one changed score does not."""
    runf = tmp_path / "run.trec"
    ok("search", index, queries, "--k", "50", "-o", runf, "--overwrite")
    out = ok("verify", index, queries, "--run", runf, "--at", "10 50").stdout
    assert out.rstrip().endswith("exact: yes"), out
    now = ok("verify", index, queries, "--at", "10 50", "--device", "cpu").stdout
    assert now.rstrip().endswith("exact: yes"), now
    result = run("verify", index, queries, "--run", _bump_one_score(runf, tmp_path), "--at", "10 50")
    assert result.stdout.rstrip().endswith("exact: NO") and "1 scores" in result.stdout, result.stdout
    assert_one_line_error(result, "differs from exact search")
    return runf.read_text()


def test_sharded_folder(files, tmp_path):
    index = tmp_path / "sharded"
    ok("index", files["docs"], "-o", index, "--shards", "3")
    matrix, ids = folder_documents(index)
    docs = read_vectors(files["docs"], progress=False)
    assert ids == list(docs.ids)  # shard after shard, in the corpus order
    assert (matrix != docs.to_scipy()).nnz == 0 and matrix.shape[0] == 240
    _check_folder(index, files["queries"], tmp_path)
    # A sample of the queries reads only their terms' postings, shard by shard.
    out = ok("verify", index, files["queries"], "--sample", "7", "--at", "10", "--device", "cpu").stdout
    assert "a random sample of 7 of 30 queries" in out and out.rstrip().endswith("exact: yes")


def test_segmented_folder_counts_only_live_documents(files, tmp_path):
    index = tmp_path / "segmented"
    ok("index", files["docs"], "-o", index)
    before = tmp_path / "before.trec"
    ok("search", index, files["queries"], "--k", "50", "-o", before)
    top = before.read_text().split("\n", 1)[0].split()[2]  # the first query's best document
    ok("add", index, files["new"])
    (tmp_path / "gone.txt").write_text(f"{top}\ndoc-5\nnew-3\n")
    ok("delete", index, tmp_path / "gone.txt")
    matrix, ids = folder_documents(index)
    docs = read_vectors(files["docs"], progress=False)
    new = read_vectors(files["new"], progress=False)
    gone = {top, "doc-5", "new-3"}
    want_ids = [i for i in list(docs.ids) + list(new.ids) if i not in gone]
    assert ids == want_ids and matrix.shape[0] == 277  # 240 + 40 - 3, in insertion order
    rows = {i: r for r, i in enumerate(list(docs.ids) + list(new.ids))}
    full = docs.to_scipy()
    full.resize((240, new.to_scipy().shape[1]))
    both = sp.vstack([full, new.to_scipy()], format="csr")
    assert (matrix != both[[rows[i] for i in want_ids]]).nnz == 0
    text = _check_folder(index, files["queries"], tmp_path)
    assert any(line.split()[2].startswith("new-") for line in text.splitlines())  # added documents are found
    # The run from before the delete ranks a deleted document: it is not in the index any more.
    stale = run("verify", index, files["queries"], "--run", before, "--at", "10 50")
    assert_one_line_error(stale, f"document {top!r} is not in the index")
