"""The queries' C passes (gpusparse._queries_native) against their numpy paths: the same
quantized rows (levels of each row's power-of-two step, half to even, zero levels dropped) and
the same padded layout (written over poisoned buffers), on random rows of every magnitude;
their refusals of inconsistent arrays; the warning when the module is missing. Without the
built module these tests skip (but for the warning's); ``make test`` builds it, and sets
GPUSPARSE_REQUIRE_NATIVE=1 so that a missing module fails there."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import scipy.sparse as sp

from gpusparse import SparseCollection, Vocabulary, queries_native
from gpusparse.quantize import quantize_queries
from gpusparse.queries import _pad, padded_host

native = pytest.mark.skipif(
    not queries_native.NATIVE,
    reason="gpusparse._queries_native is not built (pip install -e . or python setup.py build_ext --inplace)",
)
VOCAB = Vocabulary([f"t{i}" for i in range(500)])


def test_native_module_built_where_required():
    # make test (CI) installs the package, which compiles the module: there it must be present
    if os.environ.get("GPUSPARSE_REQUIRE_NATIVE") == "1":
        assert queries_native.NATIVE, "gpusparse._queries_native is not built: run pip install -e ."


def _rows(rng, n: int, *, spread: int, empty: float = 0.2) -> SparseCollection:
    """``n`` random rows: some empty, magnitudes spread over ``10**±spread`` by row and by term
    (so some levels round to 0 and are dropped); the first row's levels tie at half a level
    (its largest weight 255: a step of 1; weights 2.5, 3.5, 0.5 and 0.25)."""
    m = sp.random(n, 500, density=0.08, format="csr", random_state=np.random.RandomState(rng.integers(1 << 31)))
    m.data = (rng.random(m.nnz) * 10.0 ** rng.integers(-spread, spread + 1, m.nnz)).astype(np.float32)
    for r in np.flatnonzero(rng.random(n) < empty):
        m.data[m.indptr[r] : m.indptr[r + 1]] = 0
    m = m.tolil()
    m[0, :] = 0
    m[0, [3, 10, 11, 40, 41, 90]] = [255.0, 2.5, 3.5, 0.5, 0.25, 1.5]
    m = m.tocsr()
    m.eliminate_zeros()
    return SparseCollection.from_scipy(m, vocab=VOCAB)


def _quantized_both_ways(queries: SparseCollection, bits: int, monkeypatch) -> tuple:
    got = quantize_queries(queries, bits)
    with monkeypatch.context() as mp:
        mp.setattr(queries_native, "_native", None)
        mp.setattr(queries_native, "_warned", True)
        want = quantize_queries(queries, bits)
    return got, want


@native
@pytest.mark.parametrize("bits", [8, 4, 1])
def test_native_quantization_equals_numpys(rng, monkeypatch, bits):
    seen_drop = False
    for n, spread in ((1, 3), (2, 0), (37, 3), (256, 30), (64, 0)):
        queries = _rows(rng, n, spread=spread)
        got, want = _quantized_both_ways(queries, bits, monkeypatch)
        for name, dtype in (("indptr", np.int64), ("indices", np.int32), ("values", np.float32)):
            g, w = getattr(got, name), getattr(want, name)
            assert g.dtype == dtype and w.dtype == dtype
            np.testing.assert_array_equal(g, w, err_msg=f"{name}, {n} rows, spread {spread}")
        assert got.ids == queries.ids and got.vocab is queries.vocab
        seen_drop |= len(got.values) < len(queries.values)
    assert seen_drop  # some levels were 0


@native
def test_native_quantization_of_a_slice_and_of_no_rows(rng, monkeypatch):
    """A slice whose row pointers do not start at 0, and a batch of no queries."""
    queries = _rows(rng, 40, spread=2)
    part = queries[7:19]
    got, want = _quantized_both_ways(part, 8, monkeypatch)
    np.testing.assert_array_equal(got.to_scipy().toarray(), want.to_scipy().toarray())
    got, want = _quantized_both_ways(queries[3:3], 8, monkeypatch)
    assert len(got) == len(want) == 0 and got.indptr.tolist() == [0]


@native
def test_native_padding_equals_numpys_over_poisoned_buffers(rng, monkeypatch):
    for n in (1, 2, 256):
        queries = _rows(rng, n, spread=1)
        longest = int(np.diff(queries.indptr).max()) if n else 0
        for width in {longest, longest + 3}:
            got = (np.full((n, width), 7777, np.int64), np.full((n, width), np.nan, np.float32))
            want = (np.full((n, width), -5, np.int64), np.full((n, width), np.inf, np.float32))
            _pad(queries.indptr, queries.indices, queries.values, *got)
            with monkeypatch.context() as mp:
                mp.setattr(queries_native, "_native", None)
                mp.setattr(queries_native, "_warned", True)
                _pad(queries.indptr, queries.indices, queries.values, *want)
                numpy_padded = padded_host(queries)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(got[0][:, :longest], numpy_padded[0])
            np.testing.assert_array_equal(got[1][:, :longest], numpy_padded[1])
            for g, w in zip(padded_host(queries), numpy_padded, strict=True):
                np.testing.assert_array_equal(g, w)
                assert g.dtype == w.dtype


@native
def test_native_passes_refuse_inconsistent_arrays():
    ptr = np.array([0, 2, 5], np.int64)
    ind, val = np.arange(5, dtype=np.int32), np.ones(5, np.float32)
    terms, weights = np.empty((2, 3), np.int64), np.empty((2, 3), np.float32)
    with pytest.raises(ValueError, match="row 1 has 3 terms, more than the width 2"):
        queries_native.pad_rows(ptr, ind, val, terms[:, :2].copy(), weights[:, :2].copy())
    with pytest.raises(ValueError, match="must not decrease"):
        queries_native.pad_rows(
            np.array([0, 3, 2, 5]), ind, val, np.empty((3, 3), np.int64), np.empty((3, 3), np.float32)
        )
    with pytest.raises(ValueError, match="does not end"):
        queries_native.quantized_rows(np.array([0, 2, 4]), ind, val, 8)
    with pytest.raises(ValueError, match="must match"):
        queries_native.pad_rows(ptr, ind, val, terms, np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="bits"):
        queries_native.quantized_rows(ptr, ind, val, 0)
    queries_native.pad_rows(ptr, ind, val, terms, weights)
    assert terms.tolist() == [[0, 1, -1], [2, 3, 4]] and weights.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_a_missing_module_warns_once_and_takes_numpy(rng, monkeypatch):
    monkeypatch.setattr(queries_native, "_native", None)
    monkeypatch.setattr(queries_native, "_warned", False)
    queries = _rows(rng, 5, spread=1)
    with pytest.warns(queries_native.NativeQueriesWarning, match="pip install -e"):
        quantize_queries(queries, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        padded_host(queries)  # said once already
    assert queries_native.quantized_rows(queries.indptr, queries.indices, queries.values, 8) is None
