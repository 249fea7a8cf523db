"""The columnar JSONL reader (no Python object a posting) against the strict one: weights
bit-identical to Python's ``float()`` on random and adversarial numbers; the same records,
term ids and float32 weights on random chunks full of awkward spellings; and on every
malformed or doubtful chunk it steps aside (``None``) where the strict path fails, so the
error and its line are the strict path's."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from gpusparse import InputError, Vocabulary, jsonl_keys, jsonl_numbers
from gpusparse import jsonl_chunks as jc
from gpusparse import jsonl_columns as jcol

from .test_formats import BAD_JSONL
from .test_jsonl_chunks import IDS, VOCAB, _random_chunk, assert_same_chunk

TABLE = IDS.table


def _parse(texts: list[bytes]) -> np.ndarray | None:
    """parse_numbers on ``texts`` written one after the other, separated by commas."""
    pad = 24
    padded = b" " * pad + b",".join(texts) + b" " * pad
    ends = np.cumsum([len(t) + 1 for t in texts]) - 1 + pad
    starts = ends - np.array([len(t) for t in texts])
    neg = np.frombuffer(padded, np.uint8)[starts] == 45
    return jsonl_numbers.parse_numbers(padded, starts, ends, neg)


def _python(text: bytes) -> float:
    """How the strict path reads a JSON number: json gives an int or a float, array('d') a double."""
    value = json.loads(text)
    return float(value)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _numbers(seed: int, n: int = 3000) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out: list[bytes] = []
    for _ in range(n):
        kind = int(rng.integers(9))
        x = float(rng.random()) * 10.0 ** int(rng.integers(-8, 8))
        if kind == 0:
            s = repr(x)  # up to 17 digits
        elif kind == 1:
            s = repr(float(np.float32(x)))
        elif kind == 2:
            s = np.format_float_positional(np.float32(x), trim="-")
        elif kind == 3:
            s = f"{x:.{int(rng.integers(0, 20))}f}"  # many digits, trailing zeros
        elif kind == 4:
            s = f"{x:.{int(rng.integers(0, 17))}e}".replace("e", "eE"[int(rng.integers(2))])
        elif kind == 5:
            s = str(int(rng.integers(0, 2**62)) >> int(rng.integers(0, 62)))  # integers of any length
        elif kind == 6:
            digits = "".join(str(d) for d in rng.integers(0, 10, int(rng.integers(1, 25))))
            point = int(rng.integers(1, len(digits) + 1))
            s = (digits[:point].lstrip("0") or "0") + ("." + digits[point:] if point < len(digits) else "")
        elif kind == 7:
            s = "0." + "0" * int(rng.integers(0, 12)) + str(int(rng.integers(1, 10**9)))
        else:
            # near halfway between doubles: 2**53 + 1 and friends, written with a decimal point
            m = 2**53 + int(rng.integers(-3, 4))
            s = f"{m}" if rng.random() < 0.5 else f"{m // 10}.{m % 10}"
        if rng.random() < 0.2:
            s = "-" + s
        out.append(s.encode())
    return out


ADVERSARIAL = [
    b"0",
    b"-0",
    b"0.0",
    b"-0.0",
    b"-0e0",
    b"0e-5",
    b"1",
    b"-1",
    b"1.0",
    b"10",
    b"100.000",
    b"1e-45",
    b"1.4e-45",
    b"1e-46",
    b"1e-50",
    b"5e-324",
    b"2.2250738585072014e-308",
    b"3.4028234e38",
    b"3.4028235e38",
    b"3.4028236e38",
    b"1.7976931348623157e308",
    b"1e39",
    b"-1e39",
    b"9007199254740992",
    b"9007199254740993",
    b"9007199254740994",
    b"900719925474099.3",
    b"90071992547409.93",
    b"9999999999999999",
    b"99999999999999999",
    b"0.1",
    b"0.2",
    b"0.3",
    b"0.30000000000000004",
    b"0.1000000000000000055511151231257827",
    b"123456789012345678901234567890",
    b"1" + b"0" * 30,
    b"0.000000000000000000001",
    b"1.5E+3",
    b"1.5e-3",
    b"2.5",
    b"0.5",
    b"1.0000000000000002",
    b"4.35",
    b"0.06799986",
    b"1.3642006",
    b"0.8394725322723389",
    b"1234567890123456",
    b"0.0000000000000001",
    b"1" + b"0" * 22,
    b"1" + b"0" * 23,
    b"12345678.12345678",
    b"1234567.812345678",
]


@pytest.mark.parametrize("seed", range(6))
def test_numbers_equal_python_float(seed):
    texts = _numbers(seed) + ADVERSARIAL
    got = _parse(texts)
    assert got is not None
    want = [_python(t) for t in texts]
    bad = [(t, g, w) for t, g, w in zip(texts, got.tolist(), want, strict=True) if _bits(g) != _bits(w)]
    assert bad == []
    # and through float32, as a read stores them (bits, so -0.0 and 0.0 differ)
    with np.errstate(over="ignore"):
        f32 = np.array(want).astype(np.float32)
        np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32), f32.view(np.uint32))


def test_integer_minus_zero_is_zero_but_float_minus_zero_is_not():
    got = _parse([b"-0", b"-0.0", b"-0e0", b"0"])
    assert [_bits(x) for x in got.tolist()] == [_bits(0.0), _bits(-0.0), _bits(-0.0), _bits(0.0)]


@pytest.mark.parametrize("text", [b"1e400", b"-1e400", b"1" + b"0" * 400, b"1" + b"0" * 5000])
def test_numbers_beyond_float64_are_refused(text):
    assert _parse([b"1.5", text]) is None


@pytest.mark.parametrize("seed", range(40))
def test_columns_equal_strict_on_random_chunks(seed, monkeypatch):
    monkeypatch.setattr(jcol, "_long_numbers", lambda data: False)  # the columnar path reads them all
    unknown = seed % 2 == 1
    mode = "skip" if unknown else "error"
    data = _random_chunk(seed, unknown=unknown, bad=seed % 3 == 0, repeats=seed % 4 == 0)
    assert jcol.columns_of_chunk(data, TABLE, VOCAB.lookup, mode) is not None  # the columnar path takes it
    assert_same_chunk(jc._columns_chunk(data, IDS, mode), jc._strict_chunk(data, VOCAB.lookup, mode))
    assert_same_chunk(jc.parse_chunk(data, IDS, mode), jc._strict_chunk(data, VOCAB.lookup, mode))


@pytest.mark.parametrize("seed", range(12))
def test_parse_chunk_equals_strict_with_infinite_and_unknown(seed):
    data = _random_chunk(100 + seed, unknown=True, repeats=True, bad=True, infinite=True)
    for mode in ("error", "skip"):
        assert_same_chunk(jc.parse_chunk(data, IDS, mode), jc._strict_chunk(data, VOCAB.lookup, mode))


def _check_line(line: str | bytes, mode: str = "error") -> jc.ChunkResult:
    """A bad or doubtful line between good ones: parse_chunk gives the strict path's result;
    where the strict path fails, the columnar path refused the chunk."""
    good = json.dumps({"id": "g1", "vector": {"cat": 1.0}}) + "\n"
    line = line if isinstance(line, bytes) else line.encode()
    data = good.encode() + line + b"\n" + good.replace("g1", "g2").encode()
    strict = jc._strict_chunk(data, VOCAB.lookup, mode)
    assert_same_chunk(jc.parse_chunk(data, IDS, mode), strict)
    if strict.error is not None:
        with pytest.raises((jc._Fallback, InputError)):
            jc._columns_chunk(data, IDS, mode)
    return strict


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_bad_lines_refused(case):
    _check_line(BAD_JSONL[case][0])


DOUBTFUL = {
    "escaped-id-key-repeated": '{"id": "x", "vector": {"cat": 1}, "\\u0069d": "y"}',
    "escaped-vector-key-repeated": '{"id": "x", "vector": {"cat": 1}, "v\\u0065ctor": {"dog": 1}}',
    "escaped-vector-key": '{"id": "x", "v\\u0065ctor": {"dog": 1}}',
    "null-id-and-underscore-id": '{"id": null, "_id": "y", "vector": {"cat": 1}}',
    "underscore-id-repeated": '{"_id": "x", "_id": "y", "vector": {"cat": 1}}',
    "id-and-underscore-id": '{"_id": "u", "id": "x", "vector": {"cat": 1}}',
    "two-objects-one-line": '{"id": "a", "vector": {"cat": 1}} {"id": "b", "vector": {"cat": 1}}',
    "two-objects-comma": '{"id": "a", "vector": {"cat": 1}}, {"id": "b", "vector": {"cat": 1}}',
    "weight-true": '{"id": "x", "vector": {"cat": true}}',
    "weight-false": '{"id": "x", "vector": {"cat": false}}',
    "weight-nested": '{"id": "x", "vector": {"cat": {"a": 1}}}',
    "weight-string-with-comma": '{"id": "x", "vector": {"cat": "1,5"}}',
    "other-object": '{"id": "x", "meta": {"a": 1}, "vector": {"cat": 1}}',
    "contents-list": '{"id": "x", "contents": ["a", "b"], "vector": {"cat": 1}}',
    "byte-order-mark": '\ufeff{"id": "x", "vector": {"cat": 1}}',
    "crlf": '{"id": "x", "vector": {"cat": 1}}\r',
    "tabs-and-spaces": '{ "id" :\t"x" ,\t"vector" : {\t"cat"\t:\t1.5\t, "dog" :2 } }',
    "empty-vector": '{"id": "x", "vector": {}}',
    "empty-vector-spaces": '{"id": "x", "vector": { }}',
    "repeated-token": '{"id": "x", "vector": {"cat": 1, "dog": 2, "cat": 3}}',
    "same-token-two-spellings": '{"id": "x", "vector": {"\\u0643": 1, "ك": 2}}',
    "escaped-slash-token": '{"id": "x", "vector": {"\\/": 1, "cat": 2}}',
    "long-escaped-token": '{"id": "x", "vector": {"\\u0063\\u006c\\u0061\\u0073\\u0073": 1}}',  # "class"
    "quote-and-backslash-tokens": '{"id": "x", "vector": {"\\"": 1, "\\\\": 2, "cat": 3}}',
    "backslash-run-before-quote": '{"id": "x", "contents": "a\\\\\\\\", "vector": {"cat": 1}}',
    "escaped-quote-in-contents": '{"id": "x", "contents": "say \\"vector\\": {", "vector": {"cat": 1}}',
    "colon-comma-brace-in-contents": '{"id": "x", "contents": "a:b,c{d}[e]", "vector": {"cat": 1}}',
    "unicode-id-escaped": '{"id": "\\u00e9t\\u00e9", "vector": {"cat": 1}}',
    "integer-id": '{"id": 17, "vector": {"cat": 1}}',
    "key-vector-as-token": '{"id": "x", "vector": {"vector": 1, "id": 2, "cat": 3}}',
    "minus-zero-int": '{"id": "x", "vector": {"cat": -0}}',
    "minus-zero-float": '{"id": "x", "vector": {"cat": -0.0}}',
    "unknown-long-token": '{"id": "x", "vector": {"' + "z" * 40 + '": 1, "cat": 2}}',
    "weight-exponent": '{"id": "x", "vector": {"cat": 1.5e-3, "dog": 2E+2}}',
    "string-across-lines": '{"id": "x", "contents": "a',
    "object-across-lines": '{"id": "x", "vector": {"cat": 1},',
}


# Doubtful but well-formed: the columnar path reads these itself (and the same as the strict path).
TAKEN = {
    "id-and-underscore-id", "crlf", "tabs-and-spaces", "empty-vector", "empty-vector-spaces", "repeated-token",
    "same-token-two-spellings", "escaped-slash-token", "long-escaped-token", "quote-and-backslash-tokens",
    "backslash-run-before-quote", "escaped-quote-in-contents", "colon-comma-brace-in-contents",
    "unicode-id-escaped", "integer-id", "key-vector-as-token", "minus-zero-int", "minus-zero-float",
    "weight-exponent", "null-id-and-underscore-id",
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DOUBTFUL))
@pytest.mark.parametrize("mode", ["error", "skip"])
def test_doubtful_lines_same_as_strict(case, mode):
    strict = _check_line(DOUBTFUL[case], mode)
    if case in TAKEN:
        assert strict.error is None or case == "null-id-and-underscore-id"
        good = json.dumps({"id": "g1", "vector": {"cat": 1.0}}) + "\n"
        data = (good + DOUBTFUL[case] + "\n").encode()
        assert jcol.columns_of_chunk(data, TABLE, VOCAB.lookup, mode) is not None, case


@pytest.mark.parametrize(
    "raw",
    [
        b'{"id": "x", "contents": "\xff", "vector": {"cat": 1}}',  # not UTF-8 outside the vector
        b'{"id": "x\xc3", "vector": {"cat": 1}}',
        b'{"id": "x", "vector": {"ca\xfft": 1}}',  # in a token
        b'{"id": "x", "vector": {"\xc3": 1}}',
    ],
)
def test_not_utf8_refused(raw):
    strict = _check_line(raw)
    assert strict.error is not None and strict.error[0] == "not UTF-8 text"


def test_chunks_of_long_weights_go_to_orjson():
    # json.dumps of float64 weights (17 significant digits) is read faster by orjson: the
    # columnar path leaves such chunks, and they read the same
    weights = [0.123, 1.7, 2.5e-3, 0.9]
    vec = {t: float(np.float32(w)) for t, w in zip(["cat", "dog", "the", "##ing"], weights, strict=True)}
    data = "".join(json.dumps({"id": f"d{i}", "vector": vec}) + "\n" for i in range(3)).encode()
    assert jcol.columns_of_chunk(data, TABLE, VOCAB.lookup, "error") is None
    assert_same_chunk(jc.parse_chunk(data, IDS, "error"), jc._strict_chunk(data, VOCAB.lookup, "error"))


def test_only_empty_vectors():
    data = b'{"id": "a", "vector": {}}\n{"id": "b", "vector": { }}\n'
    assert jcol.columns_of_chunk(data, TABLE, VOCAB.lookup, "error") is not None
    assert_same_chunk(jc._columns_chunk(data, IDS, "error"), jc._strict_chunk(data, VOCAB.lookup, "error"))


def test_the_columnar_path_takes_typical_lines():
    # spellings real files use: json.dumps (spaces, \\u escapes, 17-digit weights) and compact
    # orjson (UTF-8, shortest float32); ids as strings or integers; a blank line
    vec = {"cat": 0.8394725322723389, "ك": 1.25, "日": 3, '"': 0.5, "\\": 2.0, "##ing": 1e-05}
    lines = [
        json.dumps({"id": "a", "contents": 'x "y" \\ é', "vector": vec}),
        json.dumps({"id": 7, "vector": vec}, ensure_ascii=False, separators=(",", ":")),
        "",
        json.dumps({"_id": "b", "vector": {}}),
    ]
    data = ("\n".join(lines) + "\n").encode()
    assert jcol.columns_of_chunk(data, TABLE, VOCAB.lookup, "error") is not None
    assert_same_chunk(jc._columns_chunk(data, IDS, "error"), jc._strict_chunk(data, VOCAB.lookup, "error"))


def test_key_table_first_of_repeated_tokens_and_all_spellings():
    vocab = Vocabulary(["a", "é", "b", "a", '"', "\\", "\x01", "日本"])
    table = jsonl_keys.KeyTable(vocab.tokens())
    spell = [b"a", b"\xc3\xa9", b"\\u00e9", b"b", b'\\"', b"\\\\", b"\\u0001", "日本".encode(), b"\\u65e5\\u672c"]
    want = [0, 1, 1, 2, 4, 5, 6, 7, 7]
    padded = b" " * 8 + b"".join(s + b" " * 24 for s in spell) + b" " * 32
    starts = 8 + np.cumsum([0] + [len(s) + 24 for s in spell[:-1]])
    sizes = np.array([len(s) for s in spell])
    got = table.find(jsonl_keys.key_words(jsonl_numbers.rows_view(padded, 24), starts, sizes))
    assert got.tolist() == want
    rows = jsonl_numbers.rows_view(b"zz" + b" " * 40, 24)
    missing = table.find(jsonl_keys.key_words(rows, np.array([0]), np.array([2])))
    assert missing.tolist() == [-1]


MUTATIONS = [b'"', b"\\", b":", b",", b"{", b"}", b"[", b"]", b" ", b"\n", b"\t", b"\r", b"0", b"9", b"-", b".",
             b"e", b"E", b"+", b"t", b"n", b"x", b"\xff", b"\xc3", b"\x00", b"\x0c", b"", b'\\"', b"\\u"]  # fmt: skip


def mutated_chunks(seed: int, rounds: int = 10):
    """Ten copies of a random chunk, each with 1-3 bytes inserted, deleted or replaced anywhere."""
    rng = np.random.default_rng(1000 + seed)
    base = bytearray(_random_chunk(2000 + seed, n=12, repeats=True))
    for _ in range(rounds):
        data = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(len(data)))
            data[at : at + int(rng.integers(0, 2))] = MUTATIONS[int(rng.integers(len(MUTATIONS)))]
        yield bytes(data)


@pytest.mark.parametrize("seed", range(30))
def test_mutated_chunks_same_as_strict(seed):
    # a few bytes inserted, deleted or replaced anywhere: whatever the columnar path takes
    # it reads as the strict path does, and it takes nothing the strict path refuses
    for data in mutated_chunks(seed):
        for mode in ("error", "skip"):
            strict = jc._strict_chunk(data, VOCAB.lookup, mode)
            assert_same_chunk(jc.parse_chunk(data, IDS, mode), strict)
            if strict.error is not None:
                with pytest.raises((jc._Fallback, InputError)):
                    jc._columns_chunk(data, IDS, mode)


def test_key_table_finds_every_token_of_bert():
    # every spelling in the table is found where it is, not only by the one-by-one look-up
    spellings = jsonl_keys._spellings(VOCAB.tokens())
    raw = list(spellings)
    padded = b"".join(k.ljust(24, b" ") for k in raw) + b" " * 24
    got = TABLE.find(
        jsonl_keys.key_words(
            jsonl_numbers.rows_view(padded, 24), np.arange(len(raw)) * 24, np.array([len(k) for k in raw])
        )
    )
    assert got.tolist() == list(spellings.values())
    assert TABLE.probes > 1  # collisions happened, and were probed past
