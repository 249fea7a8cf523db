"""The fast JSONL chunk parser against the strict one: the same records, term ids, float32
weight bits, weight problems and errors, on random chunks full of awkward spellings; and a
whole read (any worker count, plain or gzipped) the same as a read by the strict path alone."""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import sys
import types

import numpy as np
import pytest

from gpusparse import InputError, Vocabulary, read_vectors
from gpusparse import formats as formats_module
from gpusparse import jsonl_chunks as jc
from gpusparse.formats import ReadStats

from .test_formats import BAD_JSONL, assert_same_arrays

VOCAB = Vocabulary.bert()
IDS = jc.TokenIds(VOCAB)
# Plain, subword, unicode and JSON-awkward tokens (quote, backslash, colon, words that are JSON literals).
TOKENS = ["cat", "dog", "##ing", "the", "é", "ך", "日", "リ", '"', "\\", ":", "true", "false", "null", "[unused5]", "{"]
TOKENS = [t for t in TOKENS if VOCAB.get(t) is not None]
UNKNOWN = ["zzznotatokenzzz", "ünknöwn"]


def _weight_text(rng: np.random.Generator, bad: bool, infinite: bool = False) -> str:
    x = float(rng.random() * 3)
    forms = [
        repr(x),  # 17 digits, as json.dumps writes a float64
        repr(float(np.float32(x))),  # what a float32 becomes in Python
        np.format_float_positional(np.float32(x)),  # shortest float32 spelling
        f"{x:.3e}",
        f"{x:E}",
        f"{x * 1e-6:.6e}",
        str(int(rng.integers(0, 5))),  # ints, 0 included
        "0",
        "0.0",
        "-0.0",
        "1e-50",  # below float32: becomes 0
        "3.4028234e38",
        "123456789012345678901234567890",  # an int beyond 2**64
        "1.0",
    ]
    if bad:
        forms += ["-0.5", "1e39", "-2"] + ["1e400"] * infinite  # orjson refuses 1e400: a fallback
    return forms[int(rng.integers(len(forms)))]


def _random_chunk(
    seed: int, n: int = 40, *, unknown: bool = False, bad: bool = False, repeats: bool = False, infinite: bool = False
) -> bytes:
    rng = np.random.default_rng(seed)
    ascii_only = bool(rng.integers(2))
    sep = [(",", ":"), (", ", ": ")][int(rng.integers(2))]
    pool = TOKENS + (UNKNOWN if unknown else [])
    lines = []
    for i in range(n):
        if rng.random() < 0.05:
            lines.append(" \t" if rng.random() < 0.5 else "")  # blank lines keep their numbers
            continue
        k = int(rng.integers(0, 10))  # 0: an empty vector
        toks = [pool[j] for j in rng.choice(len(pool), size=min(k, len(pool)), replace=False)]
        if repeats and toks and rng.random() < 0.3:
            toks.append(toks[0])  # a repeated token: summed by the strict path
        pairs = [json.dumps(t, ensure_ascii=ascii_only) + sep[1] + _weight_text(rng, bad, infinite) for t in toks]
        key, doc_id = [("id", f"d{seed}-{i}"), ("id", 1000 * seed + i), ("_id", f"u{seed}-{i}")][int(rng.integers(3))]
        contents = ["", 'a:"b" : true, {x} null \\ é', "plain text"][int(rng.integers(3))]
        head = sep[0].join(
            [
                json.dumps(key) + sep[1] + json.dumps(doc_id),
                '"contents"' + sep[1] + json.dumps(contents, ensure_ascii=ascii_only),
            ]
        )
        lines.append("{" + head + sep[0] + '"vector"' + sep[1] + "{" + sep[0].join(pairs) + "}}")
    return ("\n".join(lines) + "\n").encode()


def assert_same_chunk(a: jc.ChunkResult, b: jc.ChunkResult) -> None:
    assert a.ids == b.ids
    for name, dtype in (("lines", np.int64), ("lengths", np.int64), ("terms", np.int32), ("weights", np.float32)):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == dtype, name
        np.testing.assert_array_equal(
            x.view(np.uint32) if dtype == np.float32 else x, y.view(np.uint32) if dtype == np.float32 else y
        )
    assert repr(a.bad_weights) == repr(b.bad_weights)  # repr: nan equals nan
    assert (a.unknown_skipped, a.newlines, a.error) == (b.unknown_skipped, b.newlines, b.error)


@pytest.mark.parametrize("seed", range(40))
def test_fast_chunk_equals_strict_chunk(seed):
    unknown = seed % 2 == 1
    data = _random_chunk(seed, unknown=unknown, bad=seed % 3 == 0)
    mode = "skip" if unknown else "error"
    fast = jc._fast_chunk(data, IDS, mode)  # the fast path takes these chunks: no fallback
    strict = jc._strict_chunk(data, VOCAB.lookup, mode)
    assert_same_chunk(fast, strict)
    assert strict.error is None and len(fast.ids) > 0
    if unknown:
        assert fast.unknown_skipped > 0 or b"zzznotatokenzzz" not in data


@pytest.mark.parametrize("seed", range(12))
def test_parse_chunk_equals_strict_on_doubtful_chunks(seed):
    # repeated tokens, unknown tokens refused: the fast path must step aside, not differ
    data = _random_chunk(100 + seed, unknown=True, repeats=True, bad=True, infinite=True)
    for mode in ("error", "skip"):
        assert_same_chunk(jc.parse_chunk(data, IDS, mode), jc._strict_chunk(data, VOCAB.lookup, mode))


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_bad_line_same_result_fast_or_strict(case):
    bad = BAD_JSONL[case][0]
    good = json.dumps({"id": "g", "vector": {"cat": 1.0}})
    data = f"{good}\n{bad}\n{good}\n".encode()
    assert_same_chunk(jc.parse_chunk(data, IDS, "error"), jc._strict_chunk(data, VOCAB.lookup, "error"))


def _always_strict(monkeypatch):
    def refuse(*args):
        raise jc._Fallback

    monkeypatch.setattr(jc, "_fast_chunk", refuse)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_read_equals_strict_read_whatever_the_workers(tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(formats_module, "_CHUNK_BYTES", 2000)
    for i in range(3):
        data = b"".join(_random_chunk(200 + 10 * i + j, n=30, unknown=True) for j in range(3))
        (tmp_path / f"p{i}{suffix}").write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    got = []
    for workers in (1, 2, 3):
        stats = ReadStats()
        got.append((read_vectors(tmp_path, progress=False, workers=workers, unknown="skip", stats=stats), stats))
    _always_strict(monkeypatch)
    ref_stats = ReadStats()
    ref = read_vectors(tmp_path, progress=False, workers=2, unknown="skip", stats=ref_stats)
    assert ref_stats.unknown_tokens_skipped > 0 and ref_stats.zero_weights_dropped > 0
    for coll, stats in got:
        assert_same_arrays(coll, ref)
        assert coll.ids == ref.ids and stats == ref_stats


@pytest.mark.parametrize("where", [0, 33, 89])
def test_weight_errors_same_as_strict_whatever_the_workers(tmp_path, monkeypatch, where):
    # whole-read checks (negative, overflow, not finite) report the first bad weight of the
    # first failing kind, wherever the chunks fall
    monkeypatch.setattr(formats_module, "_CHUNK_BYTES", 1500)
    lines = _random_chunk(300, n=90).decode().splitlines()
    lines[where] = json.dumps({"id": "bad", "vector": {"cat": 1.0, "dog": -0.25}})
    lines[-1] = '{"id": "late", "vector": {"cat": 1e400}}'  # not finite is checked before negative
    path = tmp_path / "v.jsonl"
    path.write_text("\n".join(lines) + "\n")
    errors = []
    for workers in (1, 2):
        with pytest.raises(InputError) as info:
            read_vectors(path, progress=False, workers=workers)
        errors.append(str(info.value))
    _always_strict(monkeypatch)
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False, workers=1)
    assert errors == [str(info.value)] * 2
    assert f"{path}:90" in errors[0] and "inf is not finite" in errors[0]


def test_workers_do_not_fork_once_cuda_is_initialised(monkeypatch):
    # (a fake torch: on a GPU machine earlier tests of this process may have initialised CUDA)
    fresh = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fresh)
    assert formats_module._start_method() == ("fork" if "fork" in mp.get_all_start_methods() else "forkserver")
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert formats_module._start_method() in ("forkserver", "spawn")


def test_read_with_workers_started_without_fork(tmp_path, monkeypatch):
    # what a read does once CUDA is initialised: the forkserver (or each spawned worker)
    # imports the package afresh and the token ids are pickled (seconds: it imports torch)
    monkeypatch.setattr(formats_module, "_CHUNK_BYTES", 3000)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)  # as if CUDA were initialised: no fork
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(_random_chunk(400 + j, n=30) for j in range(3)))
    got = read_vectors(path, progress=False, workers=2)
    ref = read_vectors(path, progress=False, workers=1)
    assert_same_arrays(got, ref)
    assert got.ids == ref.ids and mp.active_children() == []


def test_nothing_left_behind_after_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(formats_module, "_CHUNK_BYTES", 3000)
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(_random_chunk(500 + j, n=30) for j in range(3)) + b'{"id": "x", "vector": \n')
    before = set(tmp_path.iterdir())
    with pytest.raises(InputError, match="malformed JSON"):
        read_vectors(path, progress=False, workers=2)
    assert mp.active_children() == [] and set(tmp_path.iterdir()) == before
