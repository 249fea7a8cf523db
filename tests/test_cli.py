"""The command line: index, info, search, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

import gpusparse
from gpusparse import Index, SparseCollection, Vocabulary, read_trec_run, read_vectors, write_jsonl, write_trec_run
from gpusparse.cli import main, parse_size

from .reference import random_collection
from .test_formats import bin_bytes, make_collection, rec, write_lines

N_DOCS, N_QUERIES = 60, 9


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def ok(*args: object) -> Result:
    result = run(*args)
    assert result.exit_code == 0, (result.stderr, result.exception)
    return result


def assert_one_line_error(result: Result, *fragments: str, code: int = 1, after_progress: bool = False) -> str:
    """Exit ``code`` through sys.exit (not an escaped exception), one stderr line.

    ``after_progress``: the error comes after the command's "read ..." report line.
    """
    # CliRunner turns an uncaught exception into exit code 1 too: check it was SystemExit.
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    if after_progress:
        assert lines and lines[0].startswith("read "), result.stderr
        lines = lines[1:]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpusparse: error: "), lines[0]
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])
    return lines[0]


def assert_usage_error(result: Result) -> None:
    assert result.exit_code == 2, (result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    docs = make_collection(501, n=N_DOCS, max_len=40)
    # queries share terms with the documents so that runs are not empty
    rng = np.random.default_rng(502)
    pool = np.unique(docs.indices)
    rows = [np.sort(rng.choice(pool, size=int(rng.integers(1, 8)), replace=False)) for _ in range(N_QUERIES)]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    queries = SparseCollection(
        indptr,
        np.concatenate(rows).astype(np.int32),
        rng.random(int(indptr[-1]), dtype=np.float32) + np.float32(0.01),
        ids=[f"q{i}" for i in range(N_QUERIES)],
    )
    write_jsonl(docs, tmp_path / "docs.jsonl")
    write_jsonl(queries, tmp_path / "queries.jsonl.gz")
    return {"docs": tmp_path / "docs.jsonl", "queries": tmp_path / "queries.jsonl.gz", "dir": tmp_path}


@pytest.fixture
def index_dir(files) -> Path:
    out = files["dir"] / "idx"
    ok("index", files["docs"], "-o", out)
    return out


def expected_run(files: dict[str, Path], k: int = 1000, tag: str = "gpusparse") -> str:
    docs = read_vectors(files["docs"], progress=False)
    qs = read_vectors(files["queries"], progress=False)
    res = Index.build(docs).search(qs, k)
    path = files["dir"] / "expected.trec"
    write_trec_run(path, qs.ids, docs.ids, res.scores.numpy(), res.ids.numpy(), tag=tag)
    return path.read_text(encoding="utf-8")


# -- the happy path -------------------------------------------------------------------------


def _listed_commands(help_text: str) -> list[str]:
    """The names under "Commands:" in a click group's --help."""
    assert "\nCommands:\n" in help_text, help_text
    lines = help_text.split("\nCommands:\n", 1)[1].splitlines()
    return [line.split()[0] for line in lines if line.startswith("  ") and line.strip()]


def _help_of(argv: list[str]) -> str:
    # The subprocess imports the gpusparse these tests import (a checkout's src/ before an install).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(gpusparse.__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_python_m_cli_lists_every_command():
    expected = sorted(main.commands)
    assert len(expected) == 14 and {"index", "search", "info", "bench", "serve", "export-ciff"} <= set(expected)
    assert _listed_commands(_help_of([sys.executable, "-m", "gpusparse.cli"])) == expected


def test_console_script_lists_the_same_commands():
    # The script pip installed beside this interpreter (a venv's bin/ need not be on PATH).
    exe = Path(sys.executable).parent / ("gpusparse.exe" if os.name == "nt" else "gpusparse")
    if not exe.is_file():
        pytest.skip(f"no console script {exe} (gpusparse is not installed in this environment)")
    assert _listed_commands(_help_of([str(exe)])) == _listed_commands(_help_of([sys.executable, "-m", "gpusparse.cli"]))


def test_version_and_help():
    assert "0.1.0" in ok("--version").stdout
    for cmd in ("index", "search", "info"):
        assert "Usage:" in ok(cmd, "--help").stdout


def test_index_info_search(files, index_dir):
    assert (index_dir / "manifest.json").is_file()
    assert hidden(files["dir"]) == []

    info = ok("info", index_dir)
    assert f"documents      {N_DOCS}" in info.stdout and "30,522 terms" in info.stdout

    data = json.loads(ok("info", index_dir, "--json").stdout)
    docs = read_vectors(files["docs"], progress=False)
    assert data["documents"] == N_DOCS
    assert data["empty_documents"] == docs.stats().n_empty == 3
    assert data["vocabulary_terms"] == 30522
    assert data["postings"] == docs.nnz
    assert data["padded_postings"] >= data["postings"] and data["padded_postings"] % 32 == 0
    assert data["format_version"] == 1 and data["bytes_on_disk"] > 0

    out = files["dir"] / "run.trec"
    result = ok("search", index_dir, files["queries"], "-o", out)
    assert f"read {N_QUERIES} vectors" in result.stderr
    text = out.read_text(encoding="utf-8")
    assert text == expected_run(files)
    lines = text.splitlines()
    assert f"wrote {len(lines)} lines" in result.stderr
    ranks: dict[str, list[int]] = {}
    for line in lines:
        qid, q0, doc, rank, score, tag = line.split(" ")
        assert q0 == "Q0" and tag == "gpusparse" and float(score) > 0 and doc in docs.ids
        ranks.setdefault(qid, []).append(int(rank))
    assert set(ranks) == {f"q{i}" for i in range(N_QUERIES)}
    assert all(r == list(range(1, len(r) + 1)) for r in ranks.values())
    run_data = read_trec_run(out)
    assert all(
        [s for _, s in v] == sorted((s for _, s in v), reverse=True) for v in run_data.values()
    )  # scores descending
    assert hidden(files["dir"]) == []


def test_search_options_give_the_same_run(files, index_dir):
    d = files["dir"]
    ok("search", index_dir, files["queries"], "-o", d / "default.trec")
    default = (d / "default.trec").read_text()
    variants = {
        "k": ["--k", "1000"],
        "batch1": ["--batch-size", "1"],
        "batch4": ["--batch-size", "4", "--memory-budget", "64KiB"],
        "budget": ["--memory-budget", "64KiB"],
        "budget-bytes": ["--memory-budget", "65536", "--device", "cpu", "--kernel", "reference"],
        "no-verify": ["--no-verify", "--no-progress"],
    }
    for name, opts in variants.items():
        ok("search", index_dir, files["queries"], "-o", d / f"{name}.trec", *opts)
        assert (d / f"{name}.trec").read_text() == default, name


def test_search_k_truncates(files, index_dir):
    d = files["dir"]
    ok("search", index_dir, files["queries"], "-o", d / "full.trec")
    ok("search", index_dir, files["queries"], "-o", d / "k3.trec", "-k", "3", "--tag", "short")
    full, top3 = read_trec_run(d / "full.trec"), read_trec_run(d / "k3.trec")
    assert top3 == {q: v[:3] for q, v in full.items()}
    assert all(line.endswith(" short") for line in (d / "k3.trec").read_text().splitlines())
    assert (d / "k3.trec").read_text() == expected_run(files, k=3, tag="short")


def test_search_replaces_an_existing_run_only_with_overwrite(files, index_dir):
    out = files["dir"] / "run.trec"
    out.write_text("old\n")
    result = run("search", index_dir, files["queries"], "-o", out)
    assert result.exit_code == 1 and "--overwrite" in result.stderr
    assert out.read_text() == "old\n"
    ok("search", index_dir, files["queries"], "-o", out, "--overwrite")
    assert out.read_text() == expected_run(files)


def test_index_from_a_folder_and_several_files(files):
    d = files["dir"]
    docs = read_vectors(files["docs"], progress=False)
    parts = d / "parts"
    parts.mkdir()
    write_jsonl(docs[:20], parts / "a.jsonl.gz")
    write_jsonl(docs[20:], parts / "b.jsonl", flavor="seismic")
    ok("index", parts, "-o", d / "from-folder")
    ok("index", parts / "a.jsonl.gz", parts / "b.jsonl", "-o", d / "from-files")
    ok("index", files["docs"], "-o", d / "from-one")
    a, b, c = (Index.load(d / n) for n in ("from-folder", "from-files", "from-one"))
    for x in (a, b):
        assert x.ids == c.ids and torch.equal(x.scores, c.scores) and torch.equal(x.doc_ids, c.doc_ids)


def test_integer_vocabulary_and_bin_files(tmp_path):
    vocab = Vocabulary.integer(300)
    docs = make_collection(511, n=25, vocab=vocab)
    from gpusparse import write_seismic_bin

    write_seismic_bin(docs, tmp_path / "docs.bin")
    write_lines(tmp_path / "q.jsonl", [rec("a", {"5": 1.0, "17": 0.5}), rec("b", {"299": 2.0})])
    ok("index", tmp_path / "docs.bin", "-o", tmp_path / "idx", "--vocab", "integer:300")
    assert Index.load(tmp_path / "idx").vocab == vocab
    ok("search", tmp_path / "idx", tmp_path / "q.jsonl", "-o", tmp_path / "run")
    # a term id past the index's vocabulary is an unknown token for the queries
    write_lines(tmp_path / "q2.jsonl", [rec("a", {"5": 1.0}), rec("b", {"300": 2.0})])
    result = run("search", tmp_path / "idx", tmp_path / "q2.jsonl", "-o", tmp_path / "run2")
    assert_one_line_error(result, "q2.jsonl:2", "'300'")
    assert not (tmp_path / "run2").exists()


# -- unknown tokens -------------------------------------------------------------------------


def test_unknown_tokens_skip(files):
    d = files["dir"]
    path = write_lines(
        d / "unk.jsonl", [rec("a", {"cat": 1.0, "zzqqunknown": 2.0}), rec("b", {"qqzzunknown": 1.0, "xxunk": 1})]
    )
    result = run("index", path, "-o", d / "idx-unk")
    assert_one_line_error(result, "unk.jsonl:1", "zzqqunknown")
    assert not (d / "idx-unk").exists()
    result = ok("index", path, "-o", d / "idx-unk", "--unknown-tokens", "skip")
    assert "3 unknown tokens skipped" in result.stderr
    assert Index.load(d / "idx-unk").n_docs == 2


def test_queries_with_tokens_unknown_to_the_index(files, index_dir):
    d = files["dir"]
    q = write_lines(d / "q.jsonl", [rec("q1", {"cat": 1.0}), rec("q2", {"dog": 1.0, "zzqqunknown": 1.0})])
    result = run("search", index_dir, q, "-o", d / "run.trec")
    assert_one_line_error(result, f"{q}:2", "zzqqunknown")
    assert not (d / "run.trec").exists() and hidden(d) == []
    result = ok("search", index_dir, q, "-o", d / "run.trec", "--unknown-tokens", "skip")
    assert "1 unknown tokens skipped" in result.stderr


# -- bad input ------------------------------------------------------------------------------

GOOD = [rec("g1", {"cat": 1.0}), rec("g2", {"dog": 2.0})]


def _jsonl(bad: str, suffix: str = ".jsonl") -> Callable[[Path], tuple[Path, str]]:
    def make(d: Path) -> tuple[Path, str]:
        path = write_lines(d / f"bad{suffix}", [*GOOD, bad])
        return path, f"{path}:3"

    return make


def _bin(data: bytes, where: str) -> Callable[[Path], tuple[Path, str]]:
    def make(d: Path) -> tuple[Path, str]:
        path = d / "bad.bin"
        path.write_bytes(data)
        return path, f"{path}{where}"

    return make


def _dup_across(d: Path) -> tuple[Path, str]:
    folder = d / "dups"
    folder.mkdir()
    write_lines(folder / "a.jsonl", [rec("w", {}), rec("x", {"cat": 1.0})])
    b = write_lines(folder / "b.jsonl", [rec("x", {"dog": 1.0})])
    return folder, f"{b}:1"


def _dup_within(d: Path) -> tuple[Path, str]:
    path = write_lines(d / "dup.jsonl", [rec("x", {"cat": 1.0}), rec("y", {}), rec("x", {})])
    return path, f"{path}:3"


def _truncated_gz(d: Path) -> tuple[Path, str]:
    path = d / "trunc.jsonl.gz"
    write_jsonl(make_collection(521, n=300), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path, str(path)


def _missing(d: Path) -> tuple[Path, str]:
    return d / "nope.jsonl", str(d / "nope.jsonl")


def _empty_folder(d: Path) -> tuple[Path, str]:
    (d / "empty").mkdir()
    (d / "empty" / "notes.txt").write_text("x")
    return d / "empty", str(d / "empty")


def _bad_extension(d: Path) -> tuple[Path, str]:
    path = d / "vectors.txt"
    path.write_text(GOOD[0] + "\n")
    return path, str(path)


_RECS = [([1, 5], [0.5, 1.0]), ([], []), ([2, 3, 4], [1.0, 2.0, 3.0])]

BAD_INPUTS: dict[str, Callable[[Path], tuple[Path, str]]] = {
    "malformed-json": _jsonl('{"id": "x", "vector": {'),
    "malformed-json-gz": _jsonl('{"id": "x", "vector": {', ".jsonl.gz"),
    "json-array": _jsonl("[1, 2]"),
    "missing-id": _jsonl(json.dumps({"vector": {"cat": 1}})),
    "missing-vector": _jsonl(json.dumps({"id": "x"})),
    "vector-not-object": _jsonl(rec("x", [1, 2])),
    "id-wrong-type": _jsonl(rec(1.5, {"cat": 1})),
    "id-whitespace": _jsonl(rec("a b", {"cat": 1})),
    "weight-string": _jsonl(rec("x", {"cat": "1"})),
    "weight-nan": _jsonl('{"id": "x", "vector": {"cat": NaN}}'),
    "weight-infinity": _jsonl('{"id": "x", "vector": {"cat": Infinity}}'),
    "weight-negative": _jsonl(rec("x", {"cat": -1.0})),
    "weight-overflow": _jsonl(rec("x", {"cat": 1e39})),
    "unknown-token": _jsonl(rec("x", {"zzqqunknown": 1.0})),
    "duplicate-id-within": _dup_within,
    "duplicate-id-across": _dup_across,
    "truncated-gz": _truncated_gz,
    "truncated-bin": _bin(bin_bytes(_RECS)[:-4], " record 3"),
    "bin-trailing-bytes": _bin(bin_bytes(_RECS) + b"\0\0\0\0", ""),
    "bin-term-out-of-range": _bin(bin_bytes([([1], [1.0]), ([99999], [1.0])]), " record 2"),
    "missing-path": _missing,
    "folder-without-vectors": _empty_folder,
    "unknown-extension": _bad_extension,
    # bugs: these escape as OverflowError / MemoryError tracebacks
    "weight-huge-int": _jsonl('{"id": "x", "vector": {"cat": 1' + "0" * 400 + "}}"),
    "bin-absurd-count": _bin(struct.pack("<I", 0xFFFFFFFF), ": field 'count'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_index_bad_input(tmp_path, case):
    path, where = BAD_INPUTS[case](tmp_path)
    out = tmp_path / "idx"
    result = run("index", path, "-o", out)
    assert_one_line_error(result, where)
    assert not out.exists()
    assert hidden(tmp_path) == []


@pytest.mark.parametrize(
    "case",
    ["malformed-json-gz", "missing-id", "weight-negative", "unknown-token", "duplicate-id-within", "truncated-bin"],
)
def test_search_bad_queries(files, index_dir, case):
    d = files["dir"] / "bad"
    d.mkdir()
    path, where = BAD_INPUTS[case](d)
    out = files["dir"] / "run.trec"
    result = run("search", index_dir, path, "-o", out)
    assert_one_line_error(result, where)
    assert not out.exists()
    assert hidden(files["dir"]) == []


def test_same_file_twice_is_refused(files):
    # duplicate ids must be refused even when they come from the same file named twice
    out = files["dir"] / "idx"
    result = run("index", files["docs"], files["docs"], "-o", out)
    assert_one_line_error(result, str(files["docs"]), "duplicate id")
    assert not out.exists()


def test_index_onto_an_existing_folder(files, index_dir):
    before = (index_dir / "manifest.json").read_bytes()
    result = run("index", files["docs"], "-o", index_dir)
    assert_one_line_error(result, str(index_dir), "already exists")
    assert (index_dir / "manifest.json").read_bytes() == before
    other = files["dir"] / "other.jsonl"
    write_lines(other, [rec("only", {"cat": 1.0})])
    ok("index", other, "-o", index_dir, "--overwrite")
    assert Index.load(index_dir).ids == ["only"]
    assert hidden(files["dir"]) == []


def test_overwrite_refuses_a_non_index_folder(files):
    folder = files["dir"] / "data"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep")
    result = run("index", files["docs"], "-o", folder, "--overwrite")
    assert_one_line_error(result, str(folder), "not a GPUSparse index", after_progress=True)
    assert (folder / "keep.txt").read_text() == "keep"


def test_bad_vocab_spec(files):
    for spec in ("integer:abc", "integer:0", str(files["dir"] / "no-such-vocab")):
        result = run("index", files["docs"], "-o", files["dir"] / "idx", "--vocab", spec)
        assert_one_line_error(result)
        assert not (files["dir"] / "idx").exists()


def test_search_on_a_folder_that_is_not_an_index(files):
    d = files["dir"]
    (d / "notidx").mkdir()
    result = run("search", d / "notidx", files["queries"], "-o", d / "run")
    assert_one_line_error(result, "notidx", "not a GPUSparse index")
    result = run("search", d / "missing", files["queries"], "-o", d / "run")
    assert_one_line_error(result, "missing")
    result = run("info", d / "notidx")
    assert_one_line_error(result, "notidx")
    assert not (d / "run").exists()


def test_search_on_a_corrupted_index(files, index_dir):
    f = index_dir / "scores.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x40
    f.write_bytes(bytes(data))
    out = files["dir"] / "run"
    assert_one_line_error(run("search", index_dir, files["queries"], "-o", out), "scores.npy", "checksum")
    ok("search", index_dir, files["queries"], "-o", out, "--no-verify")


def test_info_on_a_newer_index(index_dir):
    m = json.loads((index_dir / "manifest.json").read_text())
    m["format_version"] = 999
    (index_dir / "manifest.json").write_text(json.dumps(m))
    assert_one_line_error(run("info", index_dir), "newer")


def test_search_into_a_missing_folder(files, index_dir):
    out = files["dir"] / "no" / "such" / "run.trec"
    result = run("search", index_dir, files["queries"], "-o", out)
    # Refused up front, before any work, as a usage error naming the folder.
    assert_usage_error(result)
    assert str(out.parent) in result.stderr and "does not exist" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(files, index_dir):
    d = files["dir"]
    result = run("search", index_dir, files["queries"], "-o", d / "run", "--device", "cuda")
    assert_usage_error(result)
    assert "CUDA is not available" in result.stderr
    assert not (d / "run").exists()
    result = run("index", files["docs"], "-o", d / "idx-cuda", "--device", "cuda:0")
    assert_usage_error(result)
    assert not (d / "idx-cuda").exists()
    assert hidden(d) == []


def test_bad_option_values(files, index_dir):
    d = files["dir"]
    for opts in (
        ["--memory-budget", "banana"],
        ["--memory-budget", "12 parsecs"],
        ["-k", "0"],
        ["--batch-size", "0"],
        ["--tag", "two words"],
        ["--kernel", "magic"],
        ["--unknown-tokens", "maybe"],
    ):
        result = run("search", index_dir, files["queries"], "-o", d / "run", *opts)
        assert_usage_error(result)
        assert not (d / "run").exists(), opts


def test_memory_budget_below_the_minimum(files, index_dir):
    # parse_size accepts "1KiB" but search() raises ValueError("memory_budget must be at
    # least 64 KiB"), which friendly_errors does not catch: a traceback.
    result = run("search", index_dir, files["queries"], "-o", files["dir"] / "run", "--memory-budget", "1KiB")
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (1, 2)
    assert not (files["dir"] / "run").exists()


@pytest.mark.parametrize(
    ("text", "value"),
    [("1GiB", 2**30), ("512MB", 512 * 10**6), ("1048576", 1048576), ("64KiB", 65536), (" 2 gib ", 2 * 2**30)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("kernel", ["scatter", "docpar"])
def test_every_kernel_writes_the_reference_run_file(rng, tmp_path, kernel):
    """Issue #3's acceptance: each kernel's run file equals the reference kernel's, byte for byte."""
    from gpusparse.kernels import triton_available

    if not triton_available():
        pytest.skip("needs Triton (a GPU, or TRITON_INTERPRET=1)")
    docs = random_collection(rng, 300, 200, 12, empty_fraction=0.05)
    queries = random_collection(rng, 6, 200, 8, empty_fraction=0.1)
    write_jsonl(docs, tmp_path / "docs.jsonl")
    write_jsonl(queries, tmp_path / "queries.jsonl")
    assert run("index", tmp_path / "docs.jsonl", "-o", tmp_path / "idx", "--vocab", "integer:200").exit_code == 0
    runs = {}
    for name in ("reference", kernel):
        out = tmp_path / f"{name}.trec"
        args = ["search", tmp_path / "idx", tmp_path / "queries.jsonl", "-o", out, "--k", "50", "--kernel", name]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        result = run(*args, "--memory-budget", "64KiB", "--device", device)
        assert result.exit_code == 0, result.stderr
        runs[name] = out.read_bytes()
    assert runs["reference"] and runs[kernel] == runs["reference"]


def test_search_takes_a_device_memory_limit(files, index_dir):
    # on a CPU the limit has nothing to plan for: the run is the unlimited one
    d, limit = files["dir"], "--device-memory-limit"
    ok("search", index_dir, files["queries"], "-o", d / "limited.trec", "--device", "cpu", limit, "1GiB")
    assert (d / "limited.trec").read_text(encoding="utf-8") == expected_run(files)
    bad = run("search", index_dir, files["queries"], "-o", d / "x.trec", "--device-memory-limit", "lots")
    assert bad.exit_code == 2 and "--device-memory-limit" in bad.output
    tiny = run("search", index_dir, files["queries"], "-o", d / "x.trec", "--device-memory-limit", "100KB")
    assert tiny.exit_code == 2 and "at least 1MiB" in tiny.output
    dist = run("search", index_dir, files["queries"], "-o", d / "x.trec", "--distributed", limit, "1GB")
    assert dist.exit_code == 2 and "--index-memory" in dist.output
