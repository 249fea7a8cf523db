"""Text to metrics on a slice of Cranfield: encode and pipeline commands, BEIR reading, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ir_measures
import numpy as np
import pytest

from gpusparse import Index, InputError, read_vectors
from gpusparse.beir import document_text, read_beir

from .shared_data import SPLADE_TINY, cranfield_slice, needs_shared, tiny_encoder, tiny_transformers, write_beir
from .test_cli import assert_one_line_error, ok, run

pytestmark = needs_shared

N_DOCS = 50
# The model on the CPU: the runs are compared with the CPU encoder's vectors (on a GPU machine the
# default is the GPU, in bfloat16).
FAST = ("--model", SPLADE_TINY, "--doc-max-length", "40", "--query-max-length", "24", "--no-progress",
        "--encode-device", "cpu")  # fmt: skip


@pytest.fixture(scope="module")
def beir(tmp_path_factory) -> Path:
    docs, queries, qrels = cranfield_slice(N_DOCS)
    return write_beir(tmp_path_factory.mktemp("beir") / "cran50", docs, queries, qrels)


def copy_beir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_read_beir(beir):
    b = read_beir(beir)
    docs, queries, qrels = cranfield_slice(N_DOCS)
    assert b.corpus.ids == [d["_id"] for d in docs] and b.queries.ids == [q["_id"] for q in queries]
    assert b.corpus.texts[0] == f"{docs[0]['title']} {docs[0]['text']}"
    assert sum(len(v) for v in b.qrels.values()) == len(qrels)
    assert document_text("", "body") == "body" and document_text(None, "body") == "body"
    check = b.check_qrels()
    assert not check.unknown_queries and not check.unknown_documents


def test_pipeline_prints_metrics_equal_to_ir_measures(beir, tmp_path):
    out = tmp_path / "out"
    result = ok("pipeline", beir, *FAST, "-o", out, "--k", "100", "--save-vectors")
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["collection", "queries", "RR@10", "nDCG@10", "R@100", "R@1000"]
    metrics = json.loads((out / "metrics.json").read_text())
    # The run file, judged by ir_measures with its own readers.
    qrels = [ir_measures.Qrel(q, d, g) for q, d, g in cranfield_slice(N_DOCS)[2]]
    runs = list(ir_measures.read_trec_run(str(out / "run.trec")))
    want = ir_measures.calc_aggregate([ir_measures.parse_measure(m) for m in metrics["measures"]], qrels, runs)
    assert metrics["measures"] == {str(m): pytest.approx(v, abs=1e-12) for m, v in want.items()}
    assert lines[1].split()[0] == "cran50" and lines[1].split()[1] == str(metrics["judged_queries"])
    assert [float(x) for x in lines[1].split()[2:]] == [round(v, 4) for v in metrics["measures"].values()]
    assert metrics["measures"]["nDCG@10"] > 0.1  # the model really retrieves something
    # The run is the exact search of the encoder's vectors.
    docs = read_vectors(out / "vectors" / "corpus.jsonl.gz", progress=False)
    queries = read_vectors(out / "vectors" / "queries.jsonl.gz", progress=False)
    enc = tiny_encoder(doc_max_length=40, query_max_length=24)
    b = read_beir(beir)
    np.testing.assert_array_equal(docs.to_scipy().toarray(), enc.encode_documents(b.corpus.texts).to_scipy().toarray())
    assert queries.ids == b.queries.ids
    assert (
        "exact: yes"
        in ok(
            "verify",
            _index(docs, tmp_path),
            out / "vectors" / "queries.jsonl.gz",
            "--run",
            out / "run.trec",
            "--at",
            "10 100",
        ).stdout
    )
    # Truncation was counted, as the tokenizer says.
    tok, _ = tiny_transformers()
    n_long = sum(len(tok(t)["input_ids"]) > 40 for t in b.corpus.texts)
    assert f"{n_long} truncated to 40 tokens" in result.stderr
    assert metrics["encode"]["corpus"]["truncated"] == n_long


def _index(docs, tmp_path: Path) -> Path:
    path = tmp_path / "index"
    Index.build(docs).save(path)
    return path


def test_encode_command_writes_vector_files(beir, tmp_path):
    out = tmp_path / "vectors"
    ok("encode", beir, *FAST, "-o", out, "--decimals", "3", "--contents", "queries", "--index", tmp_path / "index")
    assert sorted(p.name for p in out.iterdir()) == [
        "corpus.jsonl.gz",
        "encoding.json",
        "qrels.tsv",
        "queries.jsonl.gz",
    ]
    docs = read_vectors(out / "corpus.jsonl.gz", progress=False)
    b = read_beir(beir)
    exact = tiny_encoder(doc_max_length=40, query_max_length=24).encode_documents(b.corpus.texts)
    want = np.round(exact.to_scipy().toarray().astype(np.float64), 3)
    np.testing.assert_allclose(docs.to_scipy().toarray(), want, atol=1e-6, rtol=0)
    # --index holds the unrounded vectors.
    index = Index.load(tmp_path / "index")
    assert index.ids == b.corpus.ids and int(index.lengths.sum()) == exact.nnz
    settings = json.loads((out / "encoding.json").read_text())
    assert settings["decimals"] == 3 and settings["corpus"]["texts"] == N_DOCS
    assert (out / "qrels.tsv").read_bytes() == (beir / "qrels" / "test.tsv").read_bytes()
    # Existing output is not replaced silently.
    assert_one_line_error(run("encode", beir, *FAST, "-o", out), "already exists")


def test_bad_beir_folders(beir, tmp_path):
    assert_one_line_error(run("pipeline", tmp_path / "nope", *FAST), "nope", "no such folder")
    b = copy_beir(beir, tmp_path / "no-queries")
    (b / "queries.jsonl").unlink()
    assert_one_line_error(run("pipeline", b, *FAST), "no-queries", "queries.jsonl not found")
    b = copy_beir(beir, tmp_path / "no-qrels")
    shutil.rmtree(b / "qrels")
    assert_one_line_error(run("pipeline", b, *FAST), "qrels/test.tsv not found")
    assert_one_line_error(run("pipeline", beir, *FAST, "--split", "dev"), "qrels/dev.tsv not found; it has: test")
    b = copy_beir(beir, tmp_path / "bad-json")
    with (b / "corpus.jsonl").open("a") as f:
        f.write('{"_id": "x", "text": \n')
    assert_one_line_error(run("pipeline", b, *FAST), f"corpus.jsonl:{N_DOCS + 1}", "malformed JSON")
    b = copy_beir(beir, tmp_path / "dup")
    with (b / "corpus.jsonl").open("a") as f:
        f.write('{"_id": "1", "title": "", "text": "again"}\n')
    assert_one_line_error(run("pipeline", b, *FAST), f"corpus.jsonl:{N_DOCS + 1}", "field '_id'", "duplicate id '1'")
    b = copy_beir(beir, tmp_path / "no-text")
    with (b / "queries.jsonl").open("a") as f:
        f.write('{"_id": "q-no-text"}\n')
    assert_one_line_error(run("pipeline", b, *FAST), "queries.jsonl", "field 'text'", "missing")


def test_counted_warnings(beir, tmp_path):
    """Empty query texts and qrels naming unknown queries or documents: warned, counted, not fatal."""
    b = copy_beir(beir, tmp_path / "odd")
    lines = (b / "queries.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    lines[0] = json.dumps({"_id": first["_id"], "text": "  "})
    (b / "queries.jsonl").write_text("\n".join(lines) + "\n")
    with (b / "qrels" / "test.tsv").open("a") as f:
        f.write("ghost-1\t1\t1\nghost-2\t2\t1\n1\tno-such-doc\t1\n")
    out = tmp_path / "out"
    result = ok("pipeline", b, *FAST, "-o", out)
    err = result.stderr
    assert "queries.jsonl: 1 queries have empty text; they get empty vectors" in err
    assert "2 judged queries are not in the queries file (e.g. 'ghost-1', 'ghost-2'); they have no results" in err
    assert "1 judged pairs name documents missing from the corpus" in err
    n_judged = len(read_beir(b).qrels)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["judged_queries"] == n_judged
    # The empty query and the two ghosts have no results and count as 0.
    assert metrics["judged_queries_without_results"] == 3
    assert f"3 of {n_judged:,} judged queries have no results in the run" in err


def test_bad_model_folders(beir, tmp_path):
    partial = tmp_path / "model"
    partial.mkdir()
    shutil.copy(SPLADE_TINY / "config.json", partial / "config.json")
    args = ("--doc-max-length", "40", "--no-progress")
    assert_one_line_error(
        run("pipeline", beir, "--model", partial, *args),
        "model: model folder lacks weights (model.safetensors or pytorch_model.bin), a tokenizer",
        after_progress=True,
    )
    assert_one_line_error(
        run("encode", beir, "--model", tmp_path / "missing", "-o", tmp_path / "o", *args),
        "no such model folder",
        after_progress=True,
    )


def test_read_beir_errors(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"_id": "d1", "title": 5, "text": "x"}\n')
    (tmp_path / "queries.jsonl").write_text('{"_id": "q1", "text": "y"}\n')
    with pytest.raises(InputError, match=r"corpus.jsonl:1: field 'title': expected a string"):
        read_beir(tmp_path, require_qrels=False)


def test_pipeline_default_output_folder(beir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ok("pipeline", beir, *FAST, "--k", "10", "-m", "RR@10")
    assert sorted(p.name for p in (tmp_path / "pipeline-cran50").iterdir()) == ["metrics.json", "run.trec"]
