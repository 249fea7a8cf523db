"""Readers and writers: vector files, TREC runs and qrels; bad input located precisely."""

from __future__ import annotations

import gzip
import itertools
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpusparse import (
    InputError,
    SparseCollection,
    Vocabulary,
    read_qrels,
    read_trec_run,
    read_vectors,
    write_jsonl,
    write_seismic_bin,
    write_trec_run,
)
from gpusparse.formats import ReadStats

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).parents[1] / ".." / "shared"
SAMPLE = REPO / "data" / "sample" / "cranfield"


# -- helpers --------------------------------------------------------------------------------


def make_collection(
    seed: int,
    n: int = 30,
    vocab: Vocabulary | None = None,
    *,
    max_len: int = 20,
    empty_rows: int = 3,
    id_prefix: str = "d",
) -> SparseCollection:
    """``n`` random vectors over ``vocab`` (default BERT), ``empty_rows`` of them empty.

    Weights use all float32 mantissa bits; ids are unique, some non-ASCII.
    """
    vocab = Vocabulary.bert() if vocab is None else vocab
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=n)
    if empty_rows:
        lengths[rng.choice(n, size=min(empty_rows, n), replace=False)] = 0
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = [np.sort(rng.choice(len(vocab), size=int(ln), replace=False)) for ln in lengths]
    indices = np.concatenate([*rows, np.zeros(0, np.int64)]).astype(np.int32)
    values = rng.random(indices.size, dtype=np.float32) * np.float32(5) + np.float32(1e-3)
    ids = [f"{id_prefix}{i}" if i % 5 else f"{id_prefix}-é{i}" for i in range(n)]
    return SparseCollection(indptr, indices, values, ids=ids, vocab=vocab)


def assert_same_arrays(a: SparseCollection, b: SparseCollection) -> None:
    assert a.indptr.dtype == b.indptr.dtype == np.int64
    assert a.indices.dtype == b.indices.dtype == np.int32
    assert a.values.dtype == b.values.dtype == np.float32
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.indices, b.indices)
    # bitwise, not approximately
    np.testing.assert_array_equal(a.values.view(np.uint32), b.values.view(np.uint32))


def vocab_of(kind: str) -> Vocabulary:
    return Vocabulary.bert() if kind == "bert" else Vocabulary.integer(500)


def rec(doc_id: object, vector: object, **extra: object) -> str:
    return json.dumps({"id": doc_id, "contents": "", "vector": vector, **extra})


def write_lines(path: Path, lines: list[str]) -> Path:
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def bin_bytes(records: list[tuple[list[int], list[float]]], count: int | None = None) -> bytes:
    out = [struct.pack("<I", len(records) if count is None else count)]
    for terms, weights in records:
        out.append(struct.pack("<I", len(terms)))
        out.append(np.asarray(terms, dtype="<i4").tobytes())
        out.append(np.asarray(weights, dtype="<f4").tobytes())
    return b"".join(out)


def check_error(exc: InputError, path: Path | str | None, line: int | None, field: str | None = None) -> None:
    msg = str(exc)
    assert "\n" not in msg, msg
    assert exc.path == (None if path is None else str(path)), msg
    assert exc.line == line, msg
    assert exc.field == field, msg
    if path is not None:
        assert msg.startswith(str(path)), msg
        if line is not None:
            assert (f" record {line}:" if exc.record else f"{path}:{line}:") in msg, msg


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_kind", ["bert", "integer"])
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize(("flavor", "seed"), [("anserini", 11), ("seismic", 12)])
def test_jsonl_round_trip(tmp_path, vocab_kind, suffix, flavor, seed):
    vocab = vocab_of(vocab_kind)
    coll = make_collection(seed + 100 * len(suffix) + len(vocab_kind), vocab=vocab)
    assert coll.stats().n_empty == 3
    path = tmp_path / f"vectors{suffix}"
    write_jsonl(coll, path, flavor=flavor)
    if suffix.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            first = json.loads(f.readline())
    else:
        first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert ("contents" if flavor == "anserini" else "content") in first
    stats = ReadStats()
    back = read_vectors(path, vocab, progress=False, stats=stats)
    assert_same_arrays(coll, back)
    assert back.ids == coll.ids
    assert back.vocab == vocab
    assert stats.records == len(coll) and stats.empty_vectors == 3 and stats.files == [str(path)]
    assert stats.unknown_tokens_skipped == 0 and stats.zero_weights_dropped == 0


def test_jsonl_round_trip_with_contents(tmp_path):
    coll = make_collection(21, n=4)
    path = tmp_path / "v.jsonl"
    write_jsonl(coll, path, contents=["a b", "ü", "", "x\ny"])
    texts = [json.loads(line)["contents"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert texts == ["a b", "ü", "", "x\ny"]
    assert_same_arrays(coll, read_vectors(path, progress=False))


@pytest.mark.parametrize(("vocab_kind", "seed"), [("bert", 31), ("integer", 32)])
def test_seismic_bin_round_trip(tmp_path, vocab_kind, seed):
    vocab = vocab_of(vocab_kind)
    coll = make_collection(seed, vocab=vocab)
    path = tmp_path / "vectors.bin"
    write_seismic_bin(coll, path)
    expected_size = 4 + 4 * len(coll) + 8 * coll.nnz
    assert path.stat().st_size == expected_size
    stats = ReadStats()
    back = read_vectors(path, vocab, progress=False, stats=stats)
    assert_same_arrays(coll, back)
    assert back.ids == [str(i) for i in range(len(coll))]
    assert stats.records == len(coll) and stats.empty_vectors == 3


def test_all_empty_and_no_vectors(tmp_path):
    empty = SparseCollection([0, 0, 0], [], [], ids=["a", "b"])
    write_jsonl(empty, tmp_path / "e.jsonl")
    write_seismic_bin(empty, tmp_path / "e.bin")
    for name in ("e.jsonl", "e.bin"):
        back = read_vectors(tmp_path / name, progress=False)
        assert len(back) == 2 and back.nnz == 0
        np.testing.assert_array_equal(back.indptr, [0, 0, 0])
    # No vector at all is refused (issue 24): it made a 0-document index, exit status 0.
    none = SparseCollection([0], [], [])
    write_seismic_bin(none, tmp_path / "none.bin")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "zero.jsonl").write_bytes(b"")
    write_lines(tmp_path / "blank.jsonl.gz", [" ", ""])
    for name in ("none.bin", "blank.jsonl", "zero.jsonl", "blank.jsonl.gz"):
        with pytest.raises(InputError, match="empty collection") as info:
            read_vectors(tmp_path / name, progress=False)
        check_error(info.value, tmp_path / name, None)


def test_folder_read_in_name_order(tmp_path):
    coll = make_collection(41, n=45)
    folder = tmp_path / "parts"
    folder.mkdir()
    # written in reverse order, with mixed suffixes, plus files that are not vectors
    write_jsonl(coll[30:45], folder / "part-03.json")
    write_jsonl(coll[15:30], folder / "part-02.jsonl.gz", flavor="seismic")
    write_jsonl(coll[0:15], folder / "part-01.jsonl")
    (folder / "README.md").write_text("not vectors")
    (folder / "sub.jsonl").mkdir()
    stats = ReadStats()
    back = read_vectors(folder, progress=False, stats=stats)
    assert_same_arrays(coll, back)
    assert back.ids == coll.ids
    assert [Path(f).name for f in stats.files] == ["part-01.jsonl", "part-02.jsonl.gz", "part-03.json"]


def test_several_bin_files_number_ids_on(tmp_path):
    coll = make_collection(42, n=20, vocab=Vocabulary.integer(300))
    write_seismic_bin(coll[:8], tmp_path / "a.bin")
    write_seismic_bin(coll[8:], tmp_path / "b.bin")
    back = read_vectors(tmp_path, Vocabulary.integer(300), progress=False)
    assert_same_arrays(coll, back)
    assert back.ids == [str(i) for i in range(20)]


def test_paths_given_as_a_list_keep_their_order(tmp_path):
    coll = make_collection(43, n=10)
    write_jsonl(coll[5:], tmp_path / "a.jsonl")
    write_jsonl(coll[:5], tmp_path / "b.jsonl")
    back = read_vectors([tmp_path / "b.jsonl", str(tmp_path / "a.jsonl")], progress=False)
    assert_same_arrays(coll, back)


def test_duplicate_terms_are_summed_in_the_constructor():
    c = SparseCollection([0, 3, 5], [7, 2, 7, 4, 4], np.array([1.0, 0.5, 2.0, 0.25, 0.25], np.float32))
    np.testing.assert_array_equal(c.indptr, [0, 2, 3])
    np.testing.assert_array_equal(c.indices, [2, 7, 4])
    np.testing.assert_array_equal(c.values, np.array([0.5, 3.0, 0.5], np.float32))


def test_duplicate_terms_are_summed_in_bin(tmp_path):
    path = tmp_path / "dup.bin"
    path.write_bytes(bin_bytes([([9, 3, 9], [1.5, 0.25, 2.0]), ([1, 1], [0.5, 0.0])]))
    c = read_vectors(path, Vocabulary.integer(10), progress=False)
    np.testing.assert_array_equal(c.indptr, [0, 2, 3])
    np.testing.assert_array_equal(c.indices, [3, 9, 1])
    np.testing.assert_array_equal(c.values, np.array([0.25, 3.5, 0.5], np.float32))


def test_duplicate_terms_are_summed_in_jsonl_integer_vocab(tmp_path):
    # "7" and "07" are two JSON keys naming the same term of an integer vocabulary
    path = write_lines(tmp_path / "dup.jsonl", [rec("a", {"7": 1.0, "07": 2.5, "3": 1.0})])
    c = read_vectors(path, Vocabulary.integer(10), progress=False)
    np.testing.assert_array_equal(c.indices, [3, 7])
    np.testing.assert_array_equal(c.values, np.array([1.0, 3.5], np.float32))


def test_underscore_id_and_integer_id_are_accepted(tmp_path):
    path = write_lines(tmp_path / "v.jsonl", [json.dumps({"_id": "x1", "vector": {"cat": 1}}), rec(17, {"dog": 2})])
    c = read_vectors(path, progress=False)
    assert c.ids == ["x1", "17"]
    assert c.row(1) == {"dog": 2.0}


def test_repeated_tokens_in_one_vector_are_summed(tmp_path):
    # json.loads keeps the last of repeated keys; the README says duplicates are summed.
    lines = [
        '{"id": "a", "vector": {"cat": 1.0, "dog": 0.5, "cat": 2.5}}',
        '{"id": "b", "vector": {"cat": 0.25, "cat": 0.25, "cat": 0.5, "cat": 1}}',
        '{"id": "c", "vector": {"dog": 1, "zzznotatokenzzz": 2, "zzznotatokenzzz": 3}}',
        '{"id": "d", "vector": {"cat": 0.0, "cat": 0.0}}',
    ]
    stats = ReadStats()
    c = read_vectors(write_lines(tmp_path / "dup.jsonl", lines), unknown="skip", progress=False, stats=stats)
    assert c.row(0) == {"cat": 3.5, "dog": 0.5}
    assert c.row(1) == {"cat": 2.0}
    assert c.row(2) == {"dog": 1.0}
    assert c.row(3) == {}
    assert stats.unknown_tokens_skipped == 2 and stats.zero_weights_dropped == 2


def test_repeated_non_record_keys_keep_the_last_value(tmp_path):
    # "contents" is not read: json.loads' rule (last wins) is kept for keys the readers ignore
    line = '{"id": "a", "contents": "x", "vector": {"cat": 1}, "contents": "y"}'
    c = read_vectors(write_lines(tmp_path / "v.jsonl", [line]), progress=False)
    assert c.ids == ["a"] and c.row(0) == {"cat": 1.0}


def test_negative_integer_and_large_integer_ids_stay_accepted(tmp_path):
    lines = [rec(-5, {"cat": 1}), rec(10**30, {"dog": 1}), rec("x\u00e9\U0001f600", {"the": 1})]
    c = read_vectors(write_lines(tmp_path / "v.jsonl", lines), progress=False)
    assert c.ids == ["-5", str(10**30), "x\u00e9\U0001f600"]


def test_weights_up_to_float32_max_are_accepted_exactly(tmp_path):
    # Item 7: 3e38 is a float32; a query of two of them may overflow a SCORE (checked at
    # search time), but the values themselves are valid and kept exactly.
    path = write_lines(tmp_path / "q.jsonl", [rec("q", {"wing": 3e38, "flutter": 3.4028234663852886e38})])
    c = read_vectors(path, progress=False)
    assert c.row(0) == {"wing": float(np.float32(3e38)), "flutter": float(np.finfo(np.float32).max)}


def test_weights_below_float32_range_count_as_dropped_zeros(tmp_path):
    path = write_lines(tmp_path / "v.jsonl", [rec("a", {"cat": 1e-50, "dog": 1.0})])
    stats = ReadStats()
    c = read_vectors(path, progress=False, stats=stats)
    assert c.row(0) == {"dog": 1.0} and stats.zero_weights_dropped == 1


def test_utf8_byte_order_mark_on_the_first_line_is_allowed(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (GOOD[0] + "\n" + GOOD[1] + "\n").encode())
    assert read_vectors(path, progress=False).ids == ["g1", "g2"]


def test_surrogate_encoded_as_utf8_bytes_is_not_utf8(tmp_path):
    # json.loads(bytes) decodes with "surrogatepass": b"\xed\xa0\x80" became a lone surrogate id
    path = tmp_path / "v.jsonl"
    path.write_bytes(GOOD[0].encode() + b"\n" + b'{"id": "a\xed\xa0\x80", "vector": {}}\n')
    with pytest.raises(InputError, match="not UTF-8") as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, 2)


@pytest.mark.parametrize(
    "bad_id", ["", "a b", "a\tb", "a\x00", "a\u200b", "\ud800", "a\u2028", "\x85", "a\ue000", "\U000e0001"]
)
def test_collection_constructor_refuses_ids_a_run_cannot_hold(bad_id):
    with pytest.raises(InputError) as info:
        SparseCollection([0, 0, 0], [], [], ids=["ok", bad_id])
    check_error(info.value, None, 2, "id")
    assert info.value.record


def test_from_dicts_checks_weights_as_the_reader_does():
    for bad, words in [(True, "not a number"), ("1.0", "not a number"), (None, "not a number"), (10**400, "overflows")]:
        with pytest.raises(InputError, match=words) as info:
            SparseCollection.from_dicts([{"cat": 1.0}, {"dog": bad}])
        check_error(info.value, None, 2, "vector")
    c = SparseCollection.from_dicts([{"cat": np.float32(1.5), "dog": np.int64(2), "the": 1}])
    assert c.row(0) == {"cat": 1.5, "dog": 2.0, "the": 1.0}


def test_parse_vector_names_the_place_it_is_given():
    from gpusparse.collection import parse_vector

    vocab = Vocabulary.bert()
    parsed = parse_vector({"cat": 1, "zzzz_nope": -1.0, "dog": 0.5}, vocab, unknown="skip")
    assert parsed.terms.tolist() == [vocab.get("cat"), vocab.get("dog")]
    assert parsed.weights.tolist() == [1.0, 0.5] and parsed.skipped == 1
    pairs = (("cat", 1.0), ("cat", 2.0))  # what decode_json_line makes of {"cat": 1, "cat": 2}
    assert parse_vector(pairs, vocab).terms.tolist() == [vocab.get("cat")] * 2
    for vector, words in [
        ([["cat", 1.0]], "got list"),
        ({"cat": float("inf")}, "not finite"),
        ({"cat": -1}, "negative"),
    ]:
        with pytest.raises(InputError, match=words) as info:
            parse_vector(vector, vocab, path="q.jsonl", line=7)  # type: ignore[arg-type]
        check_error(info.value, "q.jsonl", 7, "vector")


# -- ReadStats ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_read_stats_counts(tmp_path, suffix):
    path = write_lines(
        tmp_path / f"v{suffix}",
        [
            rec("a", {"cat": 1.0, "zzzunknownzzz": 2.0, "dog": 0.0}),
            rec("b", {}),
            "",
            rec("c", {"qqqnope": 1.0, "xxxnope": 1.0}),  # empty once unknown tokens are skipped
            rec("d", {"the": 0, "of": 0.0}),  # empty once zeros are dropped
            rec("e", {"dog": 0.5}),
        ],
    )
    stats = ReadStats()
    c = read_vectors(path, unknown="skip", progress=False, stats=stats)
    assert c.ids == ["a", "b", "c", "d", "e"]
    assert c.row(0) == {"cat": 1.0}
    assert stats.records == 5
    assert stats.empty_vectors == 3
    assert stats.unknown_tokens_skipped == 3
    assert stats.zero_weights_dropped == 3
    summary = stats.summary()
    assert "5 vectors from 1 file(s)" in summary
    assert "3 empty" in summary and "3 unknown tokens skipped" in summary and "3 zero weights dropped" in summary


def test_read_stats_accumulate_over_files(tmp_path):
    write_lines(tmp_path / "a.jsonl", [rec("a", {"cat": 1.0}), rec("b", {})])
    write_lines(tmp_path / "b.jsonl", [rec("c", {"nope_nope": 1.0})])
    stats = ReadStats()
    read_vectors(tmp_path, unknown="skip", progress=False, stats=stats)
    assert len(stats.files) == 2 and stats.records == 3 and stats.empty_vectors == 2
    assert stats.unknown_tokens_skipped == 1


def test_unknown_mode_is_validated(tmp_path):
    path = write_lines(tmp_path / "v.jsonl", [rec("a", {"cat": 1.0})])
    with pytest.raises(ValueError):
        read_vectors(path, unknown="ignore", progress=False)  # type: ignore[arg-type]


# -- bad JSONL input ------------------------------------------------------------------------

GOOD = [rec("g1", {"cat": 1.0}), rec("g2", {"dog": 2.0})]

# (bad third line, field, words the message must contain)
BAD_JSONL = {
    "malformed-json": ('{"id": "x", "vector": {"cat": 1.0}', None, "malformed JSON"),
    "trailing-garbage": (rec("x", {"cat": 1}) + " xyz", None, "malformed JSON"),
    "json-array": ('[{"id": "x"}]', None, "expected a JSON object"),
    "json-number": ("42", None, "expected a JSON object"),
    "missing-id": (json.dumps({"vector": {"cat": 1.0}}), "id", "missing"),
    "null-id": (rec(None, {"cat": 1.0}), "id", "missing"),
    "missing-vector": (json.dumps({"id": "x", "contents": "t"}), "vector", "missing"),
    "vector-is-list": (rec("x", [["cat", 1.0]]), "vector", "object"),
    "vector-is-string": (rec("x", "cat:1"), "vector", "object"),
    "id-float": (rec(1.5, {"cat": 1.0}), "id", "float"),
    "id-bool": (rec(True, {"cat": 1.0}), "id", "bool"),
    "id-object": (rec({"a": 1}, {"cat": 1.0}), "id", "dict"),
    "id-space": (rec("a b", {"cat": 1.0}), "id", "whitespace"),
    "id-tab": (rec("ab\t", {"cat": 1.0}), "id", "whitespace"),
    "id-empty": (rec("", {"cat": 1.0}), "id", "empty"),
    "weight-string": (rec("x", {"cat": "1.0"}), "vector", "not a number"),
    "weight-null": (rec("x", {"cat": None}), "vector", "not a number"),
    "weight-list": (rec("x", {"cat": [1.0]}), "vector", "not a number"),
    "weight-nan": ('{"id": "x", "vector": {"cat": NaN}}', "vector", "not finite"),
    "weight-infinity": ('{"id": "x", "vector": {"cat": Infinity}}', "vector", "not finite"),
    "weight-minus-infinity": ('{"id": "x", "vector": {"cat": -Infinity}}', "vector", "not finite"),
    "weight-1e400": ('{"id": "x", "vector": {"cat": 1e400}}', "vector", "not finite"),
    "weight-negative": (rec("x", {"cat": 1.0, "dog": -0.5}), "vector", "negative"),
    "weight-overflow": (rec("x", {"cat": 1e39}), "vector", "overflows float32"),
    "unknown-token": (rec("x", {"cat": 1.0, "zzzunknownzzz": 1.0}), "vector", "zzzunknownzzz"),
    # JSON true/false are not numbers (ids reject booleans explicitly; weights should too)
    "weight-bool": (rec("x", {"cat": True}), "vector", "not a number"),
    # an integer too large for a double raises OverflowError in array('d').extend
    "weight-huge-int": ('{"id": "x", "vector": {"cat": 1' + "0" * 400 + "}}", "vector", "weight"),
    # issue 24, item 7: weights beyond float32, whatever their spelling
    "weight-minus-1e39": (rec("x", {"cat": -1e39}), "vector", "negative"),
    "weight-int-1e39": ('{"id": "x", "vector": {"cat": 1' + "0" * 39 + "}}", "vector", "overflows float32"),
    "weight-just-above-float32-max": (rec("x", {"cat": 3.4028236e38}), "vector", "overflows float32"),
    # item 8: these escaped as RecursionError / ValueError tracebacks
    "nested-100k-deep": ('{"id": "x", "vector": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "nested too deeply"),
    "weight-5000-digits": ('{"id": "x", "vector": {"cat": 1' + "0" * 5000 + "}}", None, "digits"),
    "id-5000-digits": ('{"id": 1' + "0" * 5000 + ', "vector": {"cat": 1}}', None, "digits"),
    # item 8: a lone surrogate failed only when the index was saved; items 9: ids a TREC run cannot hold
    "id-lone-surrogate": ('{"id": "a\\ud800", "vector": {"cat": 1}}', "id", "surrogate"),
    "id-nul": (rec("a\x00b", {"cat": 1.0}), "id", "control character U+0000"),
    "id-delete": (rec("ab\x7f", {"cat": 1.0}), "id", "control character U+007F"),
    "id-escape": (rec("\x1b[31mred", {"cat": 1.0}), "id", "control character U+001B"),
    "id-zero-width-space": (rec("a\u200bb", {"cat": 1.0}), "id", "invisible format character U+200B"),
    "id-byte-order-mark": (rec("\ufeffa", {"cat": 1.0}), "id", "U+FEFF"),
    "id-newline": (rec("a\nb", {"cat": 1.0}), "id", "whitespace"),
    "id-next-line": (rec("a\x85b", {"cat": 1.0}), "id", "whitespace"),
    "id-no-break-space": (rec("a\xa0b", {"cat": 1.0}), "id", "whitespace"),
    "id-line-separator": (rec("a\u2028b", {"cat": 1.0}), "id", "whitespace"),
    "id-info-separator": (rec("a\x1fb", {"cat": 1.0}), "id", "whitespace"),  # str.split() splits on it
    "underscore-id-nul": (json.dumps({"_id": "\x00", "vector": {"cat": 1.0}}), "id", "control character"),
    # item 9: a repeated key that names the record's id or vector: which one is meant?
    "repeated-id-key": ('{"id": "x", "vector": {"cat": 1}, "id": "y"}', "id", "repeated"),
    "repeated-vector-key": ('{"id": "x", "vector": {"cat": 1}, "vector": {"dog": 1}}', "vector", "repeated"),
    # duplicate tokens are summed, in float32: 3e38 + 3e38 overflows
    "repeated-token-sum-overflows": (
        '{"id": "x", "vector": {"cat": 3e38, "dog": 1, "cat": 3e38}}',
        "vector",
        "overflows",
    ),
}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize("case", list(BAD_JSONL))
def test_bad_jsonl_line(tmp_path, case, suffix):
    bad, field, words = BAD_JSONL[case]
    path = write_lines(tmp_path / f"bad{suffix}", [*GOOD, bad, rec("g4", {"cat": 1.0})])
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, 3, field)
    assert not info.value.record
    assert words in str(info.value)


@pytest.mark.parametrize("case", ["weight-nan", "weight-negative", "weight-overflow"])
def test_bad_weight_message_shows_a_plain_number(tmp_path, case):
    bad, _, _ = BAD_JSONL[case]
    path = write_lines(tmp_path / "bad.jsonl", [*GOOD, bad])
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    # numpy 2's repr leaks into the message: "weight np.float64(-0.5) is negative"
    assert "np.float64" not in str(info.value), str(info.value)


def test_unknown_token_in_queries_for_another_vocab(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [rec("q", {"5": 1.0}), rec("r", {"cat": 1.0})])
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    check_error(info.value, path, 2, "vector")


def test_not_utf8(tmp_path):
    path = tmp_path / "v.jsonl"
    path.write_bytes(GOOD[0].encode() + b"\n" + b'{"id": "\xff\xfe", "vector": {}}\n')
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, 2)


def test_duplicate_id_within_a_file(tmp_path):
    path = write_lines(tmp_path / "v.jsonl", [rec("x", {"cat": 1.0}), rec("y", {}), rec("x", {"dog": 1.0})])
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, 3, "id")
    assert f"{path}:1" in str(info.value) and "'x'" in str(info.value)


def test_duplicate_id_across_files(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [rec("w", {}), rec("x", {"cat": 1.0})])
    b = write_lines(tmp_path / "b.jsonl.gz", [rec("x", {"dog": 1.0})])
    with pytest.raises(InputError) as info:
        read_vectors(tmp_path, progress=False)
    check_error(info.value, b, 1, "id")
    assert f"first seen at {a}:2" in str(info.value)


def test_integer_and_string_id_collide(tmp_path):
    path = write_lines(tmp_path / "v.jsonl", [rec(7, {"cat": 1.0}), rec("7", {"dog": 1.0})])
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, 2, "id")


def test_same_file_given_twice_is_a_duplicate(tmp_path):
    # _Builder.add_id only compares (path, line) of the first sighting, so reading the
    # same file twice is not seen as a duplicate and the collection gets repeated ids.
    path = write_lines(tmp_path / "v.jsonl", [rec("x", {"cat": 1.0})])
    with pytest.raises(InputError) as info:
        read_vectors([path, path], progress=False)
    check_error(info.value, path, 1, "id")


def test_bin_ids_collide_with_jsonl_ids(tmp_path):
    write_seismic_bin(SparseCollection([0, 1], [5], [1.0]), tmp_path / "a.bin")
    b = write_lines(tmp_path / "b.jsonl", [rec("0", {"cat": 1.0})])
    with pytest.raises(InputError) as info:
        read_vectors(tmp_path, progress=False)
    check_error(info.value, b, 1, "id")
    assert "a.bin record 1" in str(info.value)


def test_unknown_token_is_an_error_by_default(tmp_path):
    path = write_lines(tmp_path / "v.jsonl", [rec("a", {"cat": 1.0, "notatoken_qq": 2.0})])
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, 1, "vector")
    assert "'notatoken_qq'" in str(info.value) and "--unknown-tokens skip" in str(info.value)


# -- bad gzip -------------------------------------------------------------------------------


def _truncated_gz(tmp_path: Path) -> Path:
    coll = make_collection(51, n=400)
    path = tmp_path / "v.jsonl.gz"
    write_jsonl(coll, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_truncated_gzip_names_the_file(tmp_path):
    path = _truncated_gz(tmp_path)
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    assert info.value.path == str(path)
    assert "\n" not in str(info.value) and "truncated" in str(info.value)


def test_truncated_gzip_names_the_line(tmp_path):
    # The module promises file *and line*; the gzip error is raised in _open_binary,
    # which does not know the line the reader had reached.
    path = _truncated_gz(tmp_path)
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    assert isinstance(info.value.line, int) and info.value.line > 1, str(info.value)


def test_gz_suffix_on_plain_text(tmp_path):
    path = tmp_path / "v.jsonl.gz"
    path.write_text(GOOD[0] + "\n")
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    assert info.value.path == str(path) and "\n" not in str(info.value)


# -- bad Seismic .bin -----------------------------------------------------------------------


def test_zero_byte_gzip_is_not_gzip_data(tmp_path):
    # GzipFile reads 0 bytes as empty data: this made a 0-document index, exit status 0
    path = tmp_path / "v.jsonl.gz"
    path.write_bytes(b"")
    for read in (lambda p: read_vectors(p, progress=False), read_qrels, read_trec_run):
        with pytest.raises(InputError, match="0 bytes") as info:
            read(path)
        check_error(info.value, path, None)


def _good_bin_records() -> list[tuple[list[int], list[float]]]:
    return [([1, 5], [0.5, 1.0]), ([], []), ([2, 3, 4], [1.0, 2.0, 3.0])]


def test_truncated_bin(tmp_path):
    path = tmp_path / "v.bin"
    path.write_bytes(bin_bytes(_good_bin_records())[:-4])
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    check_error(info.value, path, 3)
    assert info.value.record and "record 3" in str(info.value) and "truncated" in str(info.value)


def test_bin_ends_between_records(tmp_path):
    path = tmp_path / "v.bin"
    path.write_bytes(bin_bytes(_good_bin_records(), count=5))
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    check_error(info.value, path, 4)
    assert info.value.record


def test_bin_with_an_absurd_count(tmp_path):
    # A corrupt header must not make the reader allocate 2 x 32 GiB (MemoryError): the
    # count is checked against the file size first, and the error names the header field.
    path = tmp_path / "v.bin"
    path.write_bytes(struct.pack("<I", 0xFFFFFFFF))
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    check_error(info.value, path, None, "count")
    assert "4,294,967,295 records" in str(info.value)


@pytest.mark.parametrize("extra", [b"\0\0\0\0", b"\x01\x02", b"\0" * 12])
def test_bin_with_trailing_bytes(tmp_path, extra):
    path = tmp_path / "v.bin"
    path.write_bytes(bin_bytes(_good_bin_records()) + extra)
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    assert info.value.path == str(path) and "\n" not in str(info.value)
    assert f"{len(extra)} bytes after the last of 3 records" in str(info.value)


@pytest.mark.parametrize("data", [b"", b"\x01\x00"])
def test_bin_too_short(tmp_path, data):
    path = tmp_path / "v.bin"
    path.write_bytes(data)
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, None)


@pytest.mark.parametrize("bad_term", [10, 99999, -1])
def test_bin_term_out_of_vocab(tmp_path, bad_term):
    path = tmp_path / "v.bin"
    recs = _good_bin_records()
    recs[2] = ([2, bad_term, 4], [1.0, 2.0, 3.0])
    path.write_bytes(bin_bytes(recs))
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    check_error(info.value, path, 3, "components")
    assert info.value.record and f"term id {bad_term}" in str(info.value)


@pytest.mark.parametrize(
    ("weight", "words"), [(-1.0, "negative"), (float("nan"), "not finite"), (float("inf"), "not finite")]
)
def test_bin_bad_weight(tmp_path, weight, words):
    path = tmp_path / "v.bin"
    recs = _good_bin_records()
    recs[2] = ([2, 3, 4], [1.0, weight, 3.0])
    path.write_bytes(bin_bytes(recs))
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    check_error(info.value, path, 3, "vector")
    assert info.value.record and words in str(info.value)


def test_bin_duplicate_terms_overflow_names_the_record(tmp_path):
    # Each weight fits float32 but their sum does not; the error comes from
    # SparseCollection and carries no file or record.
    path = tmp_path / "v.bin"
    path.write_bytes(bin_bytes([([1], [1.0]), ([5, 5], [3e38, 3e38])]))
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    check_error(info.value, path, 2, "vector")


def test_jsonl_error_after_a_bin_file_is_a_line_not_a_record(tmp_path):
    # finish() formats every weight error as "record N" once any .bin file was read.
    write_seismic_bin(SparseCollection([0, 1], [5], [1.0]), tmp_path / "a.bin")
    b = write_lines(tmp_path / "b.jsonl", [rec("x", {"cat": 1.0}), rec("y", {"cat": -1.0})])
    with pytest.raises(InputError) as info:
        read_vectors(tmp_path, progress=False)
    check_error(info.value, b, 2, "vector")
    assert not info.value.record


def test_gzipped_bin_is_refused(tmp_path):
    path = tmp_path / "v.bin.gz"
    path.write_bytes(gzip.compress(bin_bytes(_good_bin_records())))
    with pytest.raises(InputError) as info:
        read_vectors(path, Vocabulary.integer(10), progress=False)
    check_error(info.value, path, None)


# -- bad paths ------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, None)
    assert "no such file" in str(info.value)


@pytest.mark.parametrize("content", [[], ["README.md", "vectors.txt"]])
def test_folder_without_vector_files(tmp_path, content):
    folder = tmp_path / "f"
    folder.mkdir()
    for name in content:
        (folder / name).write_text("x")
    with pytest.raises(InputError) as info:
        read_vectors(folder, progress=False)
    check_error(info.value, folder, None)
    assert "no vector files" in str(info.value)


@pytest.mark.parametrize("name", ["vectors.txt", "vectors.csv", "vectors.jsonl.bz2"])
def test_unknown_extension(tmp_path, name):
    path = tmp_path / name
    path.write_text(GOOD[0] + "\n")
    with pytest.raises(InputError) as info:
        read_vectors(path, progress=False)
    check_error(info.value, path, None)
    assert "unknown file type" in str(info.value)


def test_index_folder_given_as_vectors_is_named(tmp_path):
    # An index folder given as QUERIES read its manifest.json as JSONL: "manifest.json:1: malformed JSON"
    from gpusparse import Index

    Index.build(SparseCollection.from_dicts([{"cat": 1.0}]), device="cpu").save(tmp_path / "idx")
    with pytest.raises(InputError, match="index folder, not vectors") as info:
        read_vectors(tmp_path / "idx", progress=False)
    check_error(info.value, tmp_path / "idx", None)


@pytest.mark.parametrize("names", [("corpus.jsonl", "queries.jsonl"), ("corpus.jsonl.gz", "queries.jsonl.gz")])
def test_beir_or_encoded_folder_given_as_vectors_is_named(tmp_path, names):
    for name in names:
        write_lines(tmp_path / name, [rec("a", {"cat": 1.0})])
    (tmp_path / "encoding.json").write_text("{}")
    with pytest.raises(InputError, match="both a corpus and queries") as info:
        read_vectors(tmp_path, progress=False)
    check_error(info.value, tmp_path, None)
    assert read_vectors(tmp_path / names[1], progress=False).ids == ["a"]  # its files still read


def test_folder_with_a_foreign_manifest_is_read_as_vectors(tmp_path):
    # only a GPUSparse manifest makes a folder an index: another manifest.json is just a .json file
    write_lines(tmp_path / "manifest.json", [rec("m", {"cat": 1.0})])
    write_lines(tmp_path / "part.jsonl", [rec("p", {"dog": 1.0})])
    assert read_vectors(tmp_path, progress=False).ids == ["m", "p"]


def test_no_paths():
    with pytest.raises(InputError) as info:
        read_vectors([], progress=False)
    assert "\n" not in str(info.value)


# -- TREC runs ------------------------------------------------------------------------------


@pytest.mark.parametrize(("suffix", "seed"), [("", 61), (".gz", 62)])
def test_write_and_read_trec_run(tmp_path, suffix, seed):
    rng = np.random.default_rng(seed)
    doc_ids = [f"doc{i}" for i in range(50)]
    qids = ["q1", "q2", "q3"]
    k = 6
    ranked = np.stack([rng.choice(50, size=k, replace=False) for _ in qids]).astype(np.int64)
    scores = -np.sort(-rng.random((3, k), dtype=np.float32) * 10, axis=1)
    ranked[1, 4:] = -1  # q2: four results
    scores[1, 4:] = 0
    ranked[2, :] = -1  # q3: none
    scores[2, :] = 0
    path = tmp_path / f"run.trec{suffix}"
    n = write_trec_run(path, qids, doc_ids, scores, ranked, tag="mytag")
    assert n == k + 4
    opener = gzip.open if suffix else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == n
    expected_rows = [(0, r) for r in range(k)] + [(1, r) for r in range(4)]
    for line, (qi, r) in zip(lines, expected_rows, strict=True):
        qid, q0, doc, rank, score, tag = line.split(" ")
        assert (qid, q0, doc, rank, tag) == (qids[qi], "Q0", doc_ids[ranked[qi, r]], str(r + 1), "mytag")
        assert np.float32(float(score)) == scores[qi, r]  # shortest repr round-trips float32
    if not suffix:
        run = read_trec_run(path)
        assert list(run) == ["q1", "q2"]
        assert [d for d, _ in run["q1"]] == [doc_ids[d] for d in ranked[0]]
        assert np.array_equal(np.array([s for _, s in run["q1"]], np.float32), scores[0])
        assert [d for d, _ in run["q2"]] == [doc_ids[d] for d in ranked[1, :4]]


def test_trec_run_tag_must_be_one_word(tmp_path):
    with pytest.raises(ValueError):
        write_trec_run(tmp_path / "r", ["q"], ["d"], np.ones((1, 1)), np.zeros((1, 1), np.int64), tag="a b")


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_write_trec_run_refuses_non_finite_scores(tmp_path, bad):
    # Item 7: a query {"wing": 3e38, "flutter": 3e38} scored inf, and "inf" went into the run
    scores = np.array([[2.0, 1.0], [bad, 1.0]], np.float32)
    ranked = np.array([[0, 1], [1, 0]])
    with pytest.raises(InputError, match="not finite") as info:
        write_trec_run(tmp_path / "run.trec", ["q1", "q2"], ["d0", "d1"], scores, ranked)
    assert "'q2'" in str(info.value) and "'d1'" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "run.trec").exists()  # refused before anything was written
    scores[1, 0], ranked[1, 0] = np.inf, -1  # an empty slot's score is never written
    scores[1, 1], ranked[1, 1] = 0.0, -1
    assert write_trec_run(tmp_path / "run.trec", ["q1", "q2"], ["d0", "d1"], scores, ranked) == 2


@pytest.mark.parametrize("bad", ["a b", "a\x00", "a\u200b", "", "\ud800"])
@pytest.mark.parametrize("kind", ["query", "document"])
def test_write_trec_run_refuses_ids_a_run_cannot_hold(tmp_path, bad, kind):
    qids, doc_ids = (["q1", bad], ["d0", "d1"]) if kind == "query" else (["q1", "q2"], ["d0", bad])
    with pytest.raises(InputError, match=f"{kind} id") as info:
        write_trec_run(tmp_path / "run.trec", qids, doc_ids, np.ones((2, 2)), np.array([[0, 1], [1, 0]]))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run.trec").exists()


def test_write_trec_run_ignores_bad_ids_it_does_not_write(tmp_path):
    # only the documents in the run are checked: d1 is never ranked
    n = write_trec_run(tmp_path / "run.trec", ["q1"], ["d0", "d 1"], np.ones((1, 2)), np.array([[0, -1]]))
    assert n == 1


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("q1 Q0 d1 1 inf t", "not finite"),
        ("q1 Q0 d1 1 nan t", "not finite"),
        ("q1 Q0 d1 1 -Infinity t", "not finite"),
        ("q1 Q0 d\x001 1 2.0 t", "control character"),
        ("q\u200b1 Q0 d1 1 2.0 t", "invisible format character"),
    ],
)
def test_read_trec_run_refuses_what_write_trec_run_refuses(tmp_path, line, words):
    path = tmp_path / "run.trec"
    path.write_text(f"q1 Q0 d0 1 3.0 t\n\n{line}\n", encoding="utf-8")
    with pytest.raises(InputError, match=words) as info:
        read_trec_run(path)
    check_error(info.value, path, 3)


@pytest.mark.parametrize(
    ("line", "words"),
    [("q1 Q0 d1 1 2.5", "6 columns"), ("q1 Q0 d1 one 2.5 t", "bad rank"), ("q1 Q0 d1 1 x t", "score")],
)
def test_read_trec_run_bad_line(tmp_path, line, words):
    path = tmp_path / "run.trec"
    path.write_text(f"q1 Q0 d0 1 3.0 t\n\n{line}\n")
    with pytest.raises(InputError) as info:
        read_trec_run(path)
    check_error(info.value, path, 3)
    assert words in str(info.value)


def test_read_trec_run_missing_file(tmp_path):
    with pytest.raises(InputError) as info:
        read_trec_run(tmp_path / "none.trec")
    assert info.value.path == str(tmp_path / "none.trec") and "\n" not in str(info.value)


# -- qrels ----------------------------------------------------------------------------------


def test_read_qrels_beir_tsv(tmp_path):
    path = tmp_path / "test.tsv"
    path.write_text("query-id\tcorpus-id\tscore\n1\t184\t3\n1\t29\t2\n2\t12\t0\n\n3\t1\t-1\n")
    assert read_qrels(path) == {"1": {"184": 3, "29": 2}, "2": {"12": 0}, "3": {"1": -1}}


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_qrels_trec(tmp_path, suffix):
    path = tmp_path / f"qrels.txt{suffix}"
    text = "301 0 FBIS3-1 1\n301 0 FBIS3-2 0\n302 Q0 LA-7 2\n"
    path.write_bytes(gzip.compress(text.encode()) if suffix else text.encode())
    assert read_qrels(path) == {"301": {"FBIS3-1": 1, "FBIS3-2": 0}, "302": {"LA-7": 2}}


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("1\t2", "columns"),
        ("1 0 2 3 4", "columns"),
        ("1\t2\thigh", "not an integer"),
        ("1 0 d x", "not an integer"),
        ("1\t2\tnan", "not an integer"),
        ("1\t2\tinf", "not an integer"),  # int(float("inf")) raises OverflowError
    ],
)
def test_read_qrels_bad_line(tmp_path, line, words):
    path = tmp_path / "qrels.tsv"
    path.write_text(f"query-id\tcorpus-id\tscore\n1\t5\t1\n{line}\n")
    with pytest.raises(InputError) as info:
        read_qrels(path)
    check_error(info.value, path, 3)
    assert words in str(info.value)


@pytest.mark.parametrize("line", ["1\t\x00\t1", "1 0 d\x7f 1", "\ufeff1\t2\t1"])
def test_read_qrels_refuses_ids_with_control_characters(tmp_path, line):
    path = tmp_path / "qrels.tsv"
    path.write_text(f"query-id\tcorpus-id\tscore\n1\t5\t1\n{line}\n", encoding="utf-8")
    with pytest.raises(InputError, match="character") as info:
        read_qrels(path)
    check_error(info.value, path, 3)


def test_read_qrels_skips_a_byte_order_mark(tmp_path):
    path = tmp_path / "qrels.tsv"
    path.write_bytes(b"\xef\xbb\xbfquery-id\tcorpus-id\tscore\n1\t5\t1\n")
    assert read_qrels(path) == {"1": {"5": 1}}


def test_read_real_cranfield_qrels():
    path = SHARED / "data" / "cranfield" / "qrels" / "test.tsv"
    if not path.is_file():
        pytest.skip(f"{path} not available")
    qrels = read_qrels(path)
    assert len(qrels) == 225
    assert sum(len(v) for v in qrels.values()) == 1611


# -- the shipped sample ---------------------------------------------------------------------


def test_shipped_sample_reads_cleanly():
    corpus, queries = SAMPLE / "corpus.jsonl.gz", SAMPLE / "queries.jsonl.gz"
    if not corpus.is_file():
        pytest.skip("sample data not present")
    stats = ReadStats()
    docs = read_vectors(corpus, Vocabulary.bert(), progress=False, stats=stats)
    assert len(docs) == 1398 and stats.records == 1398
    assert stats.unknown_tokens_skipped == 0 and stats.empty_vectors == 0
    assert docs.stats().max_nnz == 386
    assert len(set(docs.ids)) == 1398
    qstats = ReadStats()
    qs = read_vectors(queries, Vocabulary.bert(), progress=False, stats=qstats)
    assert len(qs) == 225 and qstats.records == 225 and qstats.unknown_tokens_skipped == 0
    assert qs.stats().max_nnz == 157
    qrels = SAMPLE / "qrels.tsv"
    if qrels.is_file():
        judged = read_qrels(qrels)
        assert set(judged) <= set(qs.ids)
        assert {d for v in judged.values() for d in v} <= set(docs.ids)


# -- BEIR texts: the same id and JSON rules ---------------------------------------------------


def _beir_folder(tmp_path: Path, corpus: list[str], queries: list[str]) -> Path:
    folder = tmp_path / "beir"
    (folder / "qrels").mkdir(parents=True)
    write_lines(folder / "corpus.jsonl", corpus)
    write_lines(folder / "queries.jsonl", queries)
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    return folder


BEIR_DOC = json.dumps({"_id": "d1", "title": "t", "text": "x"})
BEIR_QUERY = json.dumps({"_id": "q1", "text": "y"})

BAD_BEIR = {
    "nul-id": (json.dumps({"_id": "d\x00", "text": "x"}), "_id", "control character"),
    "surrogate-id": ('{"_id": "\\udfff", "text": "x"}', "_id", "surrogate"),
    "nested-100k-deep": ('{"_id": "d", "text": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "nested too deeply"),
    "5000-digits": ('{"_id": 1' + "0" * 5000 + ', "text": "x"}', None, "digits"),
    "repeated-text-key": ('{"_id": "d", "text": "x", "text": "y"}', "text", "repeated"),
}


@pytest.mark.parametrize("which", ["corpus", "queries"])
@pytest.mark.parametrize("case", list(BAD_BEIR))
def test_bad_beir_line(tmp_path, case, which):
    from gpusparse.beir import read_beir

    bad, field, words = BAD_BEIR[case]
    corpus = [BEIR_DOC, bad] if which == "corpus" else [BEIR_DOC]
    queries = [BEIR_QUERY, bad] if which == "queries" else [BEIR_QUERY]
    folder = _beir_folder(tmp_path, corpus, queries)
    with pytest.raises(InputError, match=words) as info:
        read_beir(folder)
    check_error(info.value, folder / f"{which}.jsonl", 2, field)


@pytest.mark.parametrize("which", ["corpus", "queries"])
@pytest.mark.parametrize("content", [b"", b"\n \n"])
def test_empty_beir_file(tmp_path, which, content):
    from gpusparse.beir import read_beir

    folder = _beir_folder(tmp_path, [BEIR_DOC], [BEIR_QUERY])
    (folder / f"{which}.jsonl").write_bytes(content)
    with pytest.raises(InputError, match="no records") as info:
        read_beir(folder)
    check_error(info.value, folder / f"{which}.jsonl", None)


def test_zero_byte_gzipped_beir_file(tmp_path):
    from gpusparse.beir import read_corpus

    (tmp_path / "corpus.jsonl.gz").write_bytes(b"")
    with pytest.raises(InputError, match="0 bytes") as info:
        read_corpus(tmp_path / "corpus.jsonl.gz")
    check_error(info.value, tmp_path / "corpus.jsonl.gz", None)


# -- fuzz: the reader either refuses a line cleanly or reads what a plain parse reads ----------

_F32_MAX = float(np.finfo(np.float32).max)
FUZZ_TOKENS = ["cat", "dog", "the", "7", "zzznotatokenzzz"]  # "zzz...": unknown in BERT's vocabulary
_GOOD_WEIGHT = st.one_of(st.floats(0, 10).map(json.dumps), st.integers(0, 100).map(str))
_WEIGHT = st.one_of(
    *[_GOOD_WEIGHT] * 12,  # most weights valid, so that most vectors are
    st.floats(allow_nan=True, allow_infinity=True).map(json.dumps),  # json writes NaN, Infinity
    st.integers(-(10**40), 10**40).map(str),
    st.sampled_from(
        [
            *["0", "-0.0", "1e-50", "1e-46", "3.4028234663852886e38", "3.4028236e38", "3e38", "1e39", "-1e39"],
            *["1e400", "2E0", "true", "false", "null", '"1.0"', "[1.0]", "{}", '{"a": 1}', "1" + "0" * 5000],
        ]
    ),
)
_GOOD_ID = st.one_of(st.sampled_from(["a", "b", "c"]), st.from_regex(r"[A-Za-z0-9_\-]{1,4}", fullmatch=True))
_ID = st.one_of(
    _GOOD_ID.map(json.dumps),  # "a", "b", "c" repeat across lines: duplicate ids
    _GOOD_ID.map(json.dumps),
    st.text(max_size=4).map(json.dumps),  # any code point, escaped: controls, spaces, format characters
    st.integers(-(10**30), 10**30).map(str),
    st.sampled_from(["1.5", "true", "null", "[]", "{}", '"\\u0000"', '"\\ud800"', '"a\\u200bb"', "1" + "0" * 5000]),
)
_PAIRS = st.lists(st.tuples(st.sampled_from(FUZZ_TOKENS[:4] * 5 + FUZZ_TOKENS[4:]), _WEIGHT), max_size=6)
_VECTOR = st.one_of(
    *[_PAIRS.map(lambda pairs: "{" + ", ".join(f"{json.dumps(t)}: {w}" for t, w in pairs) + "}")] * 4,
    st.sampled_from(["[]", "null", '"cat"', "1", "[" * 100_000 + "]" * 100_000]),
)
_KEY_VALUES = {"id": _ID, "_id": _ID, "vector": _VECTOR, "contents": st.just('"text"')}
_KEYS = st.one_of(
    *[st.just(["id", "vector"])] * 3,
    st.just(["_id", "contents", "vector"]),
    st.lists(st.sampled_from(list(_KEY_VALUES)), max_size=5),  # keys repeated or missing
)


# Valid values included, at their edges: float32's largest, below its range, zeros, repeats.
_VALID_WEIGHT = st.one_of(
    _GOOD_WEIGHT, st.sampled_from(["0", "-0.0", "1e-50", "1e-46", "3e38", "3.4028234663852886e38", "1E1"])
)
_VALID_VECTOR = st.lists(st.tuples(st.sampled_from(FUZZ_TOKENS[:4]), _VALID_WEIGHT), min_size=1, max_size=6).map(
    lambda pairs: "{" + ", ".join(f"{json.dumps(t)}: {w}" for t, w in pairs) + "}"
)


@st.composite
def _jsonl_line(draw: st.DrawFn) -> str:
    if draw(st.booleans()):  # a valid record, so that reading (not only refusing) is compared
        return f'{{"id": {json.dumps(draw(_GOOD_ID))}, "vector": {draw(_VALID_VECTOR)}}}'
    keys = draw(_KEYS)
    line = "{" + ", ".join(f"{json.dumps(k)}: {draw(_KEY_VALUES[k])}" for k in keys) + "}"
    mutation = draw(st.sampled_from(["none"] * 12 + ["delete", "insert", "text", "blank"]))
    if mutation == "delete" and line:
        i = draw(st.integers(0, len(line) - 1))
        line = line[:i] + line[i + 1 :]
    elif mutation == "insert":
        i = draw(st.integers(0, len(line)))
        line = line[:i] + draw(st.text(min_size=1, max_size=2)) + line[i:]
    elif mutation == "text":
        line = draw(st.text(max_size=20))
    elif mutation == "blank":
        line = draw(st.sampled_from(["", " ", "\t", "\ufeff"]))
    return line


class _Obj(list):
    """A JSON object as the reference decodes it: all its pairs, repeated keys included."""


def _reference_vector(vec: object, vocab: Vocabulary, unknown: str) -> dict[int, list[float]] | None:
    """Term id -> its weights (in order), or None where the vector must be refused."""
    if not isinstance(vec, _Obj):
        return None
    row: dict[int, list[float]] = {}
    for tok, w in vec:
        tid = vocab.get(tok)
        if tid is None:
            if unknown == "error":
                return None
            continue  # dropped unchecked
        if type(w) not in (int, float):
            return None
        try:
            x = float(w)
        except OverflowError:
            return None
        if not (0 <= x <= _F32_MAX):  # also refuses NaN
            return None
        row.setdefault(tid, []).append(x)
    return row


def _reference_read(data: bytes, vocab: Vocabulary, unknown: str) -> tuple[list[str], list[dict]] | None:
    """json.loads per line, duplicates kept; None where the file must be refused."""
    ids: list[str] = []
    rows: list[dict[int, list[float]]] = []
    for raw_line in data.split(b"\n"):
        if not raw_line.strip():
            continue
        try:
            obj = json.loads(raw_line.decode("utf-8").removeprefix("\ufeff"), object_pairs_hook=_Obj)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None
        if not isinstance(obj, _Obj):
            return None
        keys = [k for k, _ in obj]
        if any(keys.count(k) > 1 for k in ("id", "_id", "vector")):
            return None
        record = dict(obj)
        doc_id = record.get("id", record.get("_id"))
        doc_id = str(doc_id) if type(doc_id) is int else doc_id
        if type(doc_id) is not str or not doc_id or doc_id in ids:
            return None
        if not all(c.isprintable() and not c.isspace() for c in doc_id):
            return None
        row = _reference_vector(record.get("vector"), vocab, unknown)
        if row is None:
            return None
        ids.append(doc_id)
        rows.append(row)
    return (ids, rows) if ids else None


def _float32_sums(weights: list[float]) -> set[float]:
    """Every float32 sum of ``weights`` in some order (the canonicalisation's order is not fixed)."""
    out = set()
    with np.errstate(over="ignore"):
        for order in set(itertools.permutations(weights)):
            total = np.float32(order[0])
            for w in order[1:]:
                total = np.float32(total + np.float32(w))
            out.add(float(total))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lines=st.lists(_jsonl_line(), min_size=1, max_size=2), unknown=st.sampled_from(["error", "skip"]))
def test_fuzz_jsonl_lines(tmp_path_factory, lines, unknown):
    vocab = Vocabulary.bert()
    data = "\n".join(lines).encode("utf-8")
    path = tmp_path_factory.getbasetemp() / "fuzz.jsonl"
    path.write_bytes(data)
    expected = _reference_read(data, vocab, unknown)
    try:
        got = read_vectors(path, vocab, unknown=unknown, progress=False)
    except InputError as exc:
        event("refused")
        msg = str(exc)
        assert "\n" not in msg and exc.path == str(path) and msg.startswith(str(path)), msg
        assert exc.line is not None or "empty collection" in msg, msg
        if expected is not None:  # only a float32 sum of repeated tokens may overflow where the values do not
            assert "overflows float32" in msg, msg
            assert any(np.inf in _float32_sums(ws) for row in expected[1] for ws in row.values()), msg
        return
    assert expected is not None, f"read {got!r}; a plain parse refuses {data[:200]!r}"
    event("read" if got.nnz else "read, no terms")
    ids, rows = expected
    assert got.ids == ids
    for i, row in enumerate(rows):
        a, b = int(got.indptr[i]), int(got.indptr[i + 1])
        got_row = dict(zip(got.indices[a:b].tolist(), got.values[a:b].tolist(), strict=True))
        assert set(got_row) <= set(row)
        for term, weights in row.items():
            sums = _float32_sums(weights)
            assert got_row.get(term, 0.0) in sums, (term, weights, got_row.get(term))
            assert np.isfinite(got_row.get(term, 0.0))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(vector=_VECTOR, unknown=st.sampled_from(["error", "skip"]))
def test_fuzz_parse_vector_is_as_strict_as_the_reader(vector, unknown):
    """parse_vector (for the server) accepts exactly the vectors the reference accepts, with the same terms."""
    from gpusparse.collection import parse_vector
    from gpusparse.formats import decode_json_line

    vocab = Vocabulary.bert()
    try:
        reference = _reference_vector(json.loads(vector, object_pairs_hook=_Obj), vocab, unknown)
    except (ValueError, RecursionError):
        with pytest.raises(InputError):
            decode_json_line(vector)
        return
    try:
        parsed = parse_vector(decode_json_line(vector), vocab, unknown=unknown)  # type: ignore[arg-type]
    except InputError as exc:
        assert reference is None, exc
        assert "\n" not in str(exc) and exc.field == "vector"
        return
    assert reference is not None
    got: dict[int, list[float]] = {}
    for term, weight in zip(parsed.terms.tolist(), parsed.weights.tolist(), strict=True):
        got.setdefault(term, []).append(weight)
    assert got == reference
