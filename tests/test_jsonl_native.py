"""The JSONL reader's native pass (gpusparse._jsonl_native) against the strict path and the
numpy columnar path: the same records, term ids, float32 weight bits, weight problems and
errors on random chunks (unicode and escaped ids and tokens, numbers of every spelling),
and on every malformed or doubtful line it steps aside where the strict path fails. Without
the built module these tests skip (but for the warning's); ``make test`` builds it, and
sets GPUSPARSE_REQUIRE_NATIVE=1 so that a missing module fails there."""

from __future__ import annotations

import json
import os
import threading
import warnings

import numpy as np
import pytest

from gpusparse import InputError, jsonl_native
from gpusparse import jsonl_chunks as jc
from gpusparse import jsonl_columns as jcol

from .test_formats import BAD_JSONL
from .test_jsonl_chunks import IDS, TOKENS, UNKNOWN, VOCAB, _random_chunk, assert_same_chunk
from .test_jsonl_columns import ADVERSARIAL, DOUBTFUL, _numbers, mutated_chunks

native = pytest.mark.skipif(
    not jsonl_native.NATIVE,
    reason="gpusparse._jsonl_native is not built (pip install -e . or python setup.py build_ext --inplace)",
)


def test_native_module_built_where_required():
    # make test (CI) installs the package, which compiles the module: there it must be present
    if os.environ.get("GPUSPARSE_REQUIRE_NATIVE") == "1":
        assert jsonl_native.NATIVE, "gpusparse._jsonl_native is not built: run pip install -e ."


def _same(data: bytes, mode: str, *, taken: bool) -> jc.ChunkResult:
    """parse_chunk equals the strict path; the native pass takes the chunk (``taken``) or,
    where the strict path fails, refuses it."""
    strict = jc._strict_chunk(data, VOCAB.lookup, mode)
    assert_same_chunk(jc.parse_chunk(data, IDS, mode), strict)
    if taken:
        res = jc._native_chunk(data, IDS, mode)
        assert res.parser == "native"
        assert_same_chunk(res, strict)
    if strict.error is not None:
        with pytest.raises((jc._Fallback, InputError)):
            jc._native_chunk(data, IDS, mode)
    return strict


@native
@pytest.mark.parametrize("seed", range(40))
def test_native_equals_strict_and_columns_on_random_chunks(seed, monkeypatch):
    unknown = seed % 2 == 1
    mode = "skip" if unknown else "error"
    data = _random_chunk(seed, unknown=unknown, bad=seed % 3 == 0, repeats=seed % 4 == 0)
    strict = jc._strict_chunk(data, VOCAB.lookup, mode)
    # an unknown token spelled with escapes is dropped after the pass: with a negative or
    # too large weight in the chunk (the read fails anyway) the pass leaves the chunk
    escaped_unknown = mode == "skip" and b"\\u00fcnkn" in data and strict.bad_weights != (None, None, None)
    _same(data, mode, taken=not escaped_unknown)
    monkeypatch.setattr(jcol, "_long_numbers", lambda data: False)  # the columnar path reads them all
    if not escaped_unknown:
        assert_same_chunk(jc._native_chunk(data, IDS, mode), jc._columns_chunk(data, IDS, mode))


def _awkward_chunk(seed: int, n: int = 60) -> bytes:
    """Lines with unicode and escaped ids, tokens spelled with every escape, other fields of
    every JSON scalar type, odd but valid whitespace."""
    rng = np.random.default_rng(seed)
    ids = ["é-1", "日本/2", "a\\b", 'q"x', "x/y", "\U0001f600", "plain"]
    pool = TOKENS + UNKNOWN + ["##s", "é"]
    lines = []
    for i in range(n):
        ascii_only = bool(rng.integers(2))
        doc_id = ids[int(rng.integers(len(ids)))] + f"-{i}"
        toks = [pool[j] for j in rng.integers(0, len(pool), int(rng.integers(0, 8)))]
        pairs = []
        for t in toks:
            key = json.dumps(t, ensure_ascii=ascii_only)
            if rng.random() < 0.2 and t.isascii() and t.isalpha():
                key = '"' + "".join(f"\\u{ord(c):04x}" for c in t) + '"'  # every character escaped
            pairs.append(key + " " * int(rng.integers(2)) + ":" + "\t" * int(rng.integers(2)) + _weight(rng))
        other = [
            '"contents": ' + json.dumps('text \\ " / \u2028 é ' * int(rng.integers(3)), ensure_ascii=ascii_only),
            '"n": ' + ["null", "true", "false", "-1.5e3", "0", '"\\/\\b\\f\\n\\r\\t\\u0000"'][int(rng.integers(6))],
        ]
        fields = [json.dumps("id") + ":" + json.dumps(doc_id, ensure_ascii=ascii_only), *other]
        fields.append('"vector" : {' + ", ".join(pairs) + "}")
        rng.shuffle(fields)
        lines.append(" { " + " ,".join(fields) + " }" + "\r" * int(rng.integers(2)))
    return ("\n".join(lines) + "\n").encode()


def _weight(rng: np.random.Generator) -> str:
    forms = ["0", "-0", "0.0", "-0.0", "1e-45", "1.4e-45", "5e-324", "2.5E+3", "1.5e-3", "3", "12345678901234567890"]
    if rng.random() < 0.5:
        return forms[int(rng.integers(len(forms)))]
    x = float(rng.random()) * 10.0 ** int(rng.integers(-40, 30))
    return [repr(x), repr(float(np.float32(x))), f"{x:.{int(rng.integers(0, 25))}e}"][int(rng.integers(3))]


@native
@pytest.mark.parametrize("seed", range(20))
def test_native_equals_strict_on_awkward_chunks(seed):
    data = _awkward_chunk(seed)
    for mode in ("error", "skip"):
        strict = jc._strict_chunk(data, VOCAB.lookup, mode)
        if mode == "skip" or strict.error is None:
            _same(data, mode, taken=True)
        else:
            _same(data, mode, taken=False)  # an unknown token: the strict path names it


@native
@pytest.mark.parametrize("seed", range(6))
def test_native_weights_bit_identical_to_python_float(seed):
    texts = [t.decode() for t in _numbers(seed) + ADVERSARIAL]
    texts = [t for t in texts if len(t) < 300 and abs(float(t)) < 1e300]  # finite in float64
    lines = [f'{{"id": "d{i}", "vector": {{"cat": {t}}}}}' for i, t in enumerate(texts)]
    data = ("\n".join(lines) + "\n").encode()
    res = jc._native_chunk(data, IDS, "error")
    want = np.array([float(json.loads(t)) for t in texts])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(res.weights.view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert_same_chunk(res, jc._strict_chunk(data, VOCAB.lookup, "error"))


def _one_line(line: str | bytes) -> bytes:
    good = json.dumps({"id": "g1", "vector": {"cat": 1.0}}) + "\n"
    line = line if isinstance(line, bytes) else line.encode()
    return good.encode() + line + b"\n" + good.replace("g1", "g2").encode()


@native
@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_native_bad_lines_refused(case):
    _same(_one_line(BAD_JSONL[case][0]), "error", taken=False)  # (a sum of repeated tokens overflows later)


# Doubtful but well-formed lines the native pass reads itself (the others it leaves to the next path).
NATIVE_TAKES = {
    "id-and-underscore-id", "crlf", "tabs-and-spaces", "empty-vector", "empty-vector-spaces", "repeated-token",
    "same-token-two-spellings", "escaped-slash-token", "long-escaped-token", "quote-and-backslash-tokens",
    "backslash-run-before-quote", "escaped-quote-in-contents", "colon-comma-brace-in-contents",
    "unicode-id-escaped", "integer-id", "key-vector-as-token", "minus-zero-int", "minus-zero-float",
    "weight-exponent",
}  # fmt: skip


@native
@pytest.mark.parametrize("case", sorted(DOUBTFUL))
@pytest.mark.parametrize("mode", ["error", "skip"])
def test_native_doubtful_lines_same_as_strict(case, mode):
    _same(_one_line(DOUBTFUL[case]), mode, taken=case in NATIVE_TAKES)


@native
@pytest.mark.parametrize(
    "raw",
    [
        b'{"id": "x", "contents": "\xff", "vector": {"cat": 1}}',
        b'{"id": "x\xc3", "vector": {"cat": 1}}',
        b'{"id": "x", "vector": {"ca\xfft": 1}}',
        b'{"id": "x", "vector": {"\xc3": 1}}',
        b'{"id": "x", "contents": "\xed\xa0\x80", "vector": {"cat": 1}}',  # an encoded surrogate
        b'{"id": "x", "contents": "\xc0\xaf", "vector": {"cat": 1}}',  # overlong
        b'{"id": "x", "contents": "\xf4\x90\x80\x80", "vector": {"cat": 1}}',  # beyond U+10FFFF
        b'{"id": "x", "contents": "a\tb", "vector": {"cat": 1}}',  # a control character in a string
        b'{"id": "x", "contents": "\\x", "vector": {"cat": 1}}',  # a bad escape
        b'{"id": "x", "contents": "\\u12g4", "vector": {"cat": 1}}',
        b'{"id": "x", "vector": {"cat": 01}}',
        b'{"id": "x", "vector": {"cat": 1.}}',
        b'{"id": "x", "vector": {"cat": .5}}',
        b'{"id": "x", "vector": {"cat": +1}}',
        b'{"id": "x", "vector": {"cat": 1e}}',
        b'{"id": "x", "vector": {"cat": 1,}}',
        b'{"id": "x", "vector": {"cat": 1}, }',
        b'{"id": "x" "vector": {"cat": 1}}',
        b'\x0b{"id": "x", "vector": {"cat": 1}}',  # whitespace to bytes.strip(), not to JSON
        b'{"id": "x", "n": tru, "vector": {"cat": 1}}',
        b'{"id": -0, "vector": {"cat": 1}}',  # str(int("-0")) is "0"
    ],
)
def test_native_refuses_what_json_refuses(raw):
    _same(_one_line(raw), "error", taken=False)


def test_native_utf8_check_agrees_with_python():
    if not jsonl_native.NATIVE:
        pytest.skip("gpusparse._jsonl_native is not built")
    # every 1-4 byte sequence from a sample of lead bytes: taken exactly when Python decodes it
    rng = np.random.default_rng(7)
    for _ in range(3000):
        raw = bytes(rng.integers(0x80, 0x100, int(rng.integers(1, 5))).tolist())
        if rng.random() < 0.5:
            raw = bytes([raw[0]]) + bytes(rng.integers(0x80, 0xC0, len(raw) - 1).tolist())
        data = b'{"id": "x", "contents": "' + raw + b'", "vector": {"cat": 1}}\n'
        try:
            raw.decode("utf-8")
            ok = True
        except UnicodeDecodeError:
            ok = False
        assert (jsonl_native.native_columns(data, IDS.table, VOCAB.lookup, "error") is not None) == ok, raw


@native
@pytest.mark.parametrize("seed", range(30))
def test_native_mutated_chunks_same_as_strict(seed):
    for data in mutated_chunks(seed):
        for mode in ("error", "skip"):
            _same(data, mode, taken=False)


@native
def test_native_many_pending_tokens_and_threads():
    # more escaped spellings than the pass keeps for Python: the next path reads the chunk;
    # several threads at once (the pass runs without the GIL) read the same as one
    line = '{"id": "d%d", "vector": {"\\u0063at": 1, "\\u0064og": 2.5}}'
    many = ("\n".join(line % i for i in range(3000)) + "\n").encode()
    assert jsonl_native.native_columns(many, IDS.table, VOCAB.lookup, "error") is None
    _same(many, "error", taken=False)
    data = b"".join(_random_chunk(300 + s, n=200) for s in range(4))
    want = jc._native_chunk(data, IDS, "error")
    got: list[jc.ChunkResult] = []
    threads = [threading.Thread(target=lambda: got.append(jc._native_chunk(data, IDS, "error"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4
    for res in got:
        assert_same_chunk(res, want)


@native
def test_native_pending_unknown_tokens_skipped_or_refused():
    long_unknown = "z" * 40
    data = _one_line('{"id": "x", "vector": {"' + long_unknown + '": 1, "\\u0063at": 2, "\\u007a\\u007a": 3}}')
    _same(data, "skip", taken=True)
    _same(data, "error", taken=False)
    res = jc._native_chunk(data, IDS, "skip")
    assert res.unknown_skipped == 2 and res.lengths.tolist() == [1, 1, 1]


def test_missing_module_warns_once_and_reads_by_numpy(monkeypatch):
    monkeypatch.setattr(jsonl_native, "_native", None)
    monkeypatch.setattr(jsonl_native, "_warned", False)
    with pytest.warns(jsonl_native.NativeReaderWarning, match=r"pip install -e \.") as caught:
        ids = jc.TokenIds(VOCAB)
        jc.TokenIds(VOCAB)  # once per process
    assert len([w for w in caught if w.category is jsonl_native.NativeReaderWarning]) == 1
    data = _random_chunk(5)
    res = jc.parse_chunk(data, ids, "error")
    assert res.parser == "columnar"
    assert_same_chunk(res, jc._strict_chunk(data, VOCAB.lookup, "error"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jc.TokenIds(VOCAB)  # no second warning


@native
def test_native_bounds_count_newlines_and_colons():
    rng = np.random.default_rng(3)
    for n in [0, 1, 31, 32, 33, 255 * 32 - 1, 255 * 32, 255 * 32 + 1, 3 * 255 * 32 + 17, 100_000]:
        data = bytes(rng.choice(np.frombuffer(b"\n:ab", np.uint8), n).tolist())
        assert jsonl_native._native.bounds(data) == (data.count(b"\n"), data.count(b":")), n
    assert jsonl_native._native.bounds(b"\n" * 100_000) == (100_000, 0)  # 8-bit counters never wrap
