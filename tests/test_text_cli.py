"""The text commands' options: ``--backend``, ``encode --queries-only``, ``pipeline --vectors``, ``index --ciff``.

The encoder tests use ../shared (splade-tiny, Cranfield) and skip without it; the
sentence-transformers backend skips without its package. Everything runs on the CPU.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from gpusparse import Index, read_vectors

from .shared_data import SPLADE_TINY, cranfield_slice, needs_shared, write_beir
from .test_cli import assert_one_line_error, assert_usage_error, ok, run

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"
N_DOCS = 40
# The model on the CPU: runs are compared with CPU encodings (on a GPU machine the default is the
# GPU, in bfloat16).
FAST = ("--model", SPLADE_TINY, "--doc-max-length", "40", "--query-max-length", "24", "--no-progress",
        "--encode-device", "cpu")  # fmt: skip


@pytest.fixture(scope="module")
def beir(tmp_path_factory) -> Path:
    docs, queries, qrels = cranfield_slice(N_DOCS)
    return write_beir(tmp_path_factory.mktemp("beir") / "cran40", docs, queries, qrels)


def lines(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# -- --backend sentence-transformers -------------------------------------------------------------


@needs_shared
def test_sentence_transformers_backend_gives_our_run(beir, tmp_path, monkeypatch) -> None:
    pytest.importorskip("sentence_transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = ok("pipeline", beir, *FAST, "-o", tmp_path / "ours", "--k", "20", "--device", "cpu")
    st = ok(
        "pipeline", beir, *FAST, "-o", tmp_path / "st", "--k", "20", "--device", "cpu",
        "--backend", "sentence-transformers",
    )  # fmt: skip
    assert "sentence-transformers SparseEncoder" in st.stderr and "max pooling" in ours.stderr
    a = (tmp_path / "ours" / "run.trec").read_text().splitlines()
    b = (tmp_path / "st" / "run.trec").read_text().splitlines()
    assert len(a) == len(b) > 0
    # Same documents in the same order; scores equal to float32 rounding of two forward passes.
    assert [line.split()[:4] for line in a] == [line.split()[:4] for line in b]
    for x, y in zip(a, b, strict=True):
        assert float(x.split()[4]) == pytest.approx(float(y.split()[4]), rel=1e-4, abs=1e-5)
    metrics = json.loads((tmp_path / "st" / "metrics.json").read_text())
    assert metrics["settings"]["backend"] == "sentence-transformers"
    # search --model --backend: the text queries encoded by the library, against our index.
    ok("encode", beir, *FAST, "-o", tmp_path / "enc", "--index", tmp_path / "ix")
    queries = Path(beir) / "queries.jsonl"
    ok("search", tmp_path / "ix", queries, "-o", tmp_path / "a.trec", "--model", SPLADE_TINY,
       "--query-max-length", "24", "--device", "cpu", "--k", "5")  # fmt: skip
    ok("search", tmp_path / "ix", queries, "-o", tmp_path / "b.trec", "--model", SPLADE_TINY,
       "--query-max-length", "24", "--device", "cpu", "--k", "5", "--backend", "sentence-transformers")  # fmt: skip
    ra, rb = ((tmp_path / n).read_text().splitlines() for n in ("a.trec", "b.trec"))
    assert [line.split()[:4] for line in ra] == [line.split()[:4] for line in rb]
    # The library takes pooling from the model: --pooling sum is refused, not ignored.
    r = run("pipeline", beir, *FAST, "-o", tmp_path / "x", "--backend", "sentence-transformers", "--pooling", "sum")
    assert_usage_error(r)
    assert "pooling" in r.stderr


# -- encode --queries-only -------------------------------------------------------------------------


@needs_shared
def test_encode_queries_only(beir, tmp_path) -> None:
    ok("encode", beir, *FAST, "-o", tmp_path / "all")
    out = tmp_path / "q"
    result = ok("encode", beir, *FAST, "-o", out, "--queries-only")
    assert not (out / "corpus.jsonl.gz").exists()
    assert sorted(p.name for p in out.iterdir()) == ["encoding.json", "qrels.tsv", "queries.jsonl.gz"]
    assert "documents" not in result.stderr  # no corpus read, none encoded
    # The same query vectors as a full encode writes.
    assert lines(out / "queries.jsonl.gz") == lines(tmp_path / "all" / "queries.jsonl.gz")
    settings = json.loads((out / "encoding.json").read_text())
    assert "corpus" not in settings and settings["queries"]["texts"] == len(cranfield_slice(N_DOCS)[1])
    # A text query file (Anserini TSV topics) as BEIR_DIR: its queries, no qrels.
    topics = tmp_path / "topics.tsv"
    topics.write_text("q1\tboundary layer flow\nq2\t\n", encoding="utf-8")
    ok("encode", topics, *FAST, "-o", tmp_path / "t", "--queries-only")
    recs = lines(tmp_path / "t" / "queries.jsonl.gz")
    assert [r["id"] for r in recs] == ["q1", "q2"] and recs[0]["vector"] and recs[1]["vector"] == {}
    assert not (tmp_path / "t" / "qrels.tsv").exists()
    assert_usage_error(run("encode", beir, *FAST, "-o", tmp_path / "u", "--queries-only", "--index", tmp_path / "i"))
    # Without --queries-only, a query file is not a BEIR folder.
    assert_one_line_error(run("encode", topics, *FAST, "-o", tmp_path / "v"))


# -- pipeline --vectors ----------------------------------------------------------------------------


@needs_shared
def test_pipeline_reuses_encoded_vectors(beir, tmp_path) -> None:
    first = tmp_path / "first"
    ok("pipeline", beir, *FAST, "-o", first, "--k", "50", "--device", "cpu", "--save-vectors")
    ok("encode", beir, *FAST, "-o", tmp_path / "enc")
    for i, vectors in enumerate((first / "vectors", tmp_path / "enc", tmp_path / "enc" / "corpus.jsonl.gz")):
        out = tmp_path / f"again{i}"
        result = ok("pipeline", beir, *FAST, "-o", out, "--k", "50", "--device", "cpu", "--vectors", vectors)
        assert "corpus is not encoded" in result.stderr and "encoded 40 documents" not in result.stderr
        assert (out / "run.trec").read_bytes() == (first / "run.trec").read_bytes()
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["measures"] == json.loads((first / "metrics.json").read_text())["measures"]
        assert metrics["settings"]["vectors"] == str(vectors)
    # Vectors of other documents are refused, naming a document without a vector.
    other = tmp_path / "other.jsonl"
    recs = lines(tmp_path / "enc" / "corpus.jsonl.gz")[1:]
    other.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    r = run("pipeline", beir, *FAST, "-o", tmp_path / "bad", "--device", "cpu", "--vectors", other)
    assert "has no vector" in r.stderr and r.exit_code == 1 and "Traceback" not in r.output


# -- index --ciff ----------------------------------------------------------------------------------


def test_index_from_ciff(tmp_path) -> None:
    pytest.importorskip("google.protobuf")
    docs = read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False)
    queries = read_vectors(SAMPLE / "queries.jsonl.gz", progress=False)[:30]
    for quantize in (8, None):
        ix = tmp_path / f"ix{quantize}"
        Index.build(docs, quantize=quantize).save(ix)
        ciff = tmp_path / f"o{quantize}.ciff.gz"
        ok("export-ciff", ix, ciff)
        ok("import-ciff", ciff, "-o", tmp_path / f"imported{quantize}")
        result = ok("index", "--ciff", ciff, "-o", tmp_path / f"indexed{quantize}")
        assert "read " in result.stderr and "wrote" in result.stderr
        a = Index.load(tmp_path / f"imported{quantize}")
        b = Index.load(tmp_path / f"indexed{quantize}")
        assert a.ids == b.ids and (a.quantization is None) == (b.quantization is None)
        ra, rb = a.search(queries, 10), b.search(queries, 10)
        assert torch.equal(ra.ids, rb.ids) and torch.equal(ra.scores, rb.scores)
        if quantize == 8:  # a GPUSparse export keeps its bits: the same top-k as the source index
            assert b.quantization is not None and b.quantization.bits == 8
            assert torch.equal(Index.load(ix).search(queries, 10).ids, rb.ids)
    r = run("index", SAMPLE / "corpus.jsonl.gz", "--ciff", tmp_path / "o8.ciff.gz", "-o", tmp_path / "both")
    assert_usage_error(r)
    assert r.stderr.strip().splitlines()[-1].endswith("give VECTORS or --ciff, not both")
    assert_usage_error(run("index", "-o", tmp_path / "neither"))
    assert_one_line_error(run("index", "--ciff", tmp_path / "o8.ciff.gz", "-o", tmp_path / "indexed8"), "exists")
    assert_one_line_error(run("index", "--ciff", tmp_path / "missing.ciff", "-o", tmp_path / "m"))


# -- --cuda-graphs -----------------------------------------------------------------------------------


@needs_shared
def test_cuda_graphs_option(beir, tmp_path) -> None:
    off = ok("encode", beir, *FAST, "-o", tmp_path / "off", "--queries-only", "--cuda-graphs", "off")
    assert "cpu" in off.stderr
    auto = ok("encode", beir, *FAST, "-o", tmp_path / "auto", "--queries-only")  # auto: off on the CPU
    assert lines(tmp_path / "auto" / "queries.jsonl.gz") == lines(tmp_path / "off" / "queries.jsonl.gz")
    assert "CUDA graphs" not in auto.stderr
    r = run("encode", beir, *FAST, "-o", tmp_path / "on", "--queries-only", "--cuda-graphs", "on")
    assert_usage_error(r)
    assert "needs a CUDA device" in r.stderr
    r = run("pipeline", beir, *FAST, "-o", tmp_path / "st", "--backend", "sentence-transformers",
            "--cuda-graphs", "off")  # fmt: skip
    assert_usage_error(r)
    assert "--cuda-graphs" in r.stderr
