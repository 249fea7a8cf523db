"""``encode --index``: the encoder's output indexed directly equals the old round trip (encode to
JSONL, then ``gpusparse index``), and so do the .npz and Seismic .bin vector files; ``pipeline``
saves and reuses them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpusparse import Index, read_vectors
from gpusparse.layout.postings import ARRAYS

from .shared_data import SPLADE_TINY, cranfield_slice, needs_shared, write_beir
from .test_cli import assert_usage_error, ok, run

pytestmark = needs_shared

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"
N_DOCS = 40
FAST = ("--model", SPLADE_TINY,
        "--doc-max-length", "40", "--query-max-length", "24", "--encode-batch-size", "16",
        "--encode-device", "cpu", "--no-progress")  # fmt: skip


@pytest.fixture(scope="module")
def beir(tmp_path_factory) -> Path:
    docs, queries, qrels = cranfield_slice(N_DOCS)
    docs[4] = {**docs[4], "title": "", "text": "   "}  # an empty text: an empty vector, a document all the same
    return write_beir(tmp_path_factory.mktemp("beir") / "cran", docs, queries, qrels)


def assert_same_index(a: Path, b: Path, *, ids: bool = True) -> None:
    x, y = Index.load(a), Index.load(b)
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(x, name).numpy(), getattr(y, name).numpy(), err_msg=name)
    assert x.vocab == y.vocab and x.n_docs == y.n_docs
    if ids:
        assert x.ids == y.ids


@pytest.fixture(scope="module")
def indexes(beir, tmp_path_factory) -> dict[str, Path]:
    """The same corpus indexed three ways (a fourth, from Seismic .bin, is the pipeline test's)."""
    tmp = tmp_path_factory.mktemp("ways")
    ok("encode", beir, *FAST, "-o", tmp / "jsonl")
    ok("index", tmp / "jsonl" / "corpus.jsonl.gz", "-o", tmp / "ix-jsonl", "--no-progress")
    direct = ok("encode", beir, *FAST, "--index", tmp / "ix-direct")
    assert f"indexed {N_DOCS} documents on cpu" in direct.stderr and "wrote" not in direct.stderr
    assert "encoded" in direct.stderr and " queries in " not in direct.stderr  # --index alone: the corpus only
    ok("encode", beir, *FAST, "-o", tmp / "npz", "--vectors-format", "npz", "--index", tmp / "ix-npz-direct")
    ok("index", tmp / "npz" / "corpus.npz", "-o", tmp / "ix-npz", "--no-progress")
    names = ("jsonl", "direct", "npz-direct", "npz")
    return {"folder": tmp, **{name: tmp / f"ix-{name}" for name in names}}


def test_encode_index_equals_encode_then_index(indexes):
    assert_same_index(indexes["direct"], indexes["jsonl"])
    assert Index.load(indexes["direct"]).stats().n_empty_docs == 1


def test_npz_vectors_index_the_same(indexes):
    assert_same_index(indexes["npz-direct"], indexes["direct"])
    assert_same_index(indexes["npz"], indexes["jsonl"])


def test_the_same_run_both_ways(indexes, tmp_path):
    queries = SAMPLE / "queries.jsonl.gz"
    runs = []
    for way in ("jsonl", "direct"):
        ok("search", indexes[way], queries, "-k", "20", "-o", tmp_path / f"{way}.trec", "--no-progress")
        runs.append((tmp_path / f"{way}.trec").read_text())
    assert runs[0] == runs[1] and len(runs[0].splitlines()) > 4000  # 225 queries, up to 20 hits each


def test_vector_files_hold_what_the_index_holds(indexes):
    folder = indexes["folder"]
    jsonl = read_vectors(folder / "jsonl" / "corpus.jsonl.gz", progress=False)
    npz = read_vectors(folder / "npz" / "corpus.npz", progress=False)
    assert npz.ids == jsonl.ids
    np.testing.assert_array_equal(npz.values, jsonl.values)
    settings = json.loads((folder / "npz" / "encoding.json").read_text())
    assert settings["vectors_format"] == "npz" and settings["corpus"]["texts"] == N_DOCS
    assert sorted(p.name for p in (folder / "npz").iterdir()) == [
        "corpus.npz",
        "encoding.json",
        "qrels.tsv",
        "queries.jsonl.gz",
    ]


def test_encode_option_errors(beir, tmp_path):
    result = run("encode", beir, *FAST)
    assert_usage_error(result)
    assert "nothing to write" in result.stderr
    result = run("encode", beir, *FAST, "-o", tmp_path / "x", "--vectors-format", "npz", "--decimals", "3")
    assert_usage_error(result)
    assert "--decimals rounds JSONL weights" in result.stderr and not (tmp_path / "x").exists()


def test_pipeline_saves_and_reuses_binary_vectors(beir, indexes, tmp_path):
    first = tmp_path / "first"
    ok("pipeline", beir, *FAST, "-o", first, "--save-vectors", "--vectors-format", "npz", "--k", "50")
    assert sorted(p.name for p in (first / "vectors").iterdir()) == ["corpus.npz", "queries.jsonl.gz"]
    # Seismic .bin: no ids; gpusparse index numbers the records, pipeline --vectors gives them the corpus ids.
    ok("encode", beir, *FAST, "-o", tmp_path / "enc-bin", "--vectors-format", "bin")
    ok("index", tmp_path / "enc-bin" / "corpus.bin", "-o", tmp_path / "ix-bin", "--no-progress")
    assert_same_index(tmp_path / "ix-bin", indexes["jsonl"], ids=False)
    assert Index.load(tmp_path / "ix-bin").ids == [str(i) for i in range(N_DOCS)]
    for name, source in (("npz", first / "vectors"), ("bin", tmp_path / "enc-bin")):
        again = ok("pipeline", beir, *FAST, "-o", tmp_path / f"again-{name}", "--vectors", source, "--k", "50")
        assert "corpus is not encoded" in again.stderr
        assert (tmp_path / f"again-{name}" / "run.trec").read_text() == (first / "run.trec").read_text()
