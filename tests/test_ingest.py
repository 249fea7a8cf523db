"""The parallel JSONL reader: the same collection and the same errors whatever the workers and
chunks; the benchmark helper runs end to end at small scale."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from gpusparse import InputError, read_vectors, write_jsonl
from gpusparse import formats as formats_module
from gpusparse.formats import ReadStats

from .test_formats import BAD_JSONL, assert_same_arrays, check_error, make_collection, rec


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of ~300 bytes, so a few dozen lines make many chunks and a pool is used."""
    monkeypatch.setattr(formats_module, "_CHUNK_BYTES", 300)


def _lines(n: int) -> list[str]:
    return [rec(f"d{i}", {"cat": 1.0 + i, "dog": 0.5, "the": i % 3}) for i in range(n)]


def _write(path, lines):
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_same_collection_whatever_the_workers(tmp_path, small_chunks, suffix):
    coll = make_collection(7, n=120)
    write_jsonl(coll[:70], tmp_path / f"a{suffix}")
    write_jsonl(coll[70:], tmp_path / f"b{suffix}")
    got = []
    for workers in (1, 2, 3):
        stats = ReadStats()
        got.append((read_vectors(tmp_path, progress=False, workers=workers, stats=stats), stats))
    for back, stats in got:
        assert_same_arrays(coll, back)
        assert back.ids == coll.ids and stats.records == 120 and stats.empty_vectors == 3


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize("where", [0, 17, 39])
@pytest.mark.parametrize(
    "case", ["malformed-json", "weight-negative", "unknown-token", "repeated-id-key", "id-space", "weight-bool"]
)
def test_same_error_in_any_chunk(tmp_path, small_chunks, suffix, where, case):
    bad, field, words = BAD_JSONL[case]
    lines = _lines(40)
    lines[where] = bad
    path = _write(tmp_path / f"v{suffix}", lines)
    for workers in (1, 2):
        with pytest.raises(InputError) as info:
            read_vectors(path, progress=False, workers=workers)
        check_error(info.value, path, where + 1, field)
        assert words in str(info.value)


def test_earliest_error_wins_across_chunks(tmp_path, small_chunks):
    # a duplicate id (line 12) before malformed JSON (line 30) in a later chunk; a negative
    # weight (line 5) is a whole-read check, reported only when all lines read
    lines = _lines(40)
    lines[4] = rec("w", {"cat": -1.0})
    lines[11] = rec("d0", {"cat": 1.0})
    lines[29] = "{"
    path = _write(tmp_path / "v.jsonl", lines)
    for workers in (1, 2):
        with pytest.raises(InputError) as info:
            read_vectors(path, progress=False, workers=workers)
        check_error(info.value, path, 12, "id")


def test_repeated_tokens_and_unknowns_in_chunks(tmp_path, small_chunks):
    lines = _lines(30)
    lines[3] = '{"id": "r", "vector": {"cat": 1.0, "dog": 0.5, "cat": 2.5}}'
    lines[20] = rec("u", {"zzznotatokenzzz": 2.0, "dog": 1.0, ":": 0.5})
    lines[25] = rec("e", {})
    path = _write(tmp_path / "v.jsonl", lines)
    got = []
    for workers in (1, 2):
        stats = ReadStats()
        c = read_vectors(path, progress=False, workers=workers, unknown="skip", stats=stats)
        got.append(c)
        assert c.row(3) == {"cat": 3.5, "dog": 0.5}
        assert c.row(20) == {"dog": 1.0, ":": 0.5}
        assert c.row(25) == {} and stats.unknown_tokens_skipped == 1
    np.testing.assert_array_equal(got[0].values, got[1].values)


def test_truncated_gzip_in_parallel_names_a_line(tmp_path, small_chunks):
    coll = make_collection(51, n=400)
    path = tmp_path / "v.jsonl.gz"
    write_jsonl(coll, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    for workers in (1, 2):
        with pytest.raises(InputError, match="truncated") as info:
            read_vectors(path, progress=False, workers=workers)
        assert isinstance(info.value.line, int) and info.value.line > 1


def test_workers_must_be_positive(tmp_path):
    path = _write(tmp_path / "v.jsonl", [json.dumps({"id": "a", "vector": {"cat": 1}})])
    with pytest.raises(ValueError, match="workers"):
        read_vectors(path, progress=False, workers=0)


def test_ingest_benchmark_runs_small_on_cpu(tmp_path):
    import ingest  # bench/ is on pytest's pythonpath

    result = ingest.main(["--docs", "300", "--shards", "2", "--device", "cpu", "--out", str(tmp_path / "out")])
    stages = [r["stage"] for r in result["stages"]]
    assert stages == ["write", "read_1core", "read_all", "build", "save", "load"]
    assert result["docs"] == 300 and result["postings"] > 300 * 50
    assert result["stages"][1]["docs"] == 150
    saved = list((tmp_path / "out").glob("*-ingest.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["card"].startswith("cpu")
