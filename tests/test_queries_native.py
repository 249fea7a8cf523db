"""The queries' C passes (gpusparse._queries_native) against their numpy paths: the same
quantized rows (levels of each row's power-of-two step, half to even, zero levels dropped), the
same padded layout (written over poisoned buffers), and the same staged CUDA-graph batch (the
longest row; row pointers, terms and weights copied into poisoned views), on random rows of every
magnitude;
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
from gpusparse.engines.tiled.graphs import csr_batch
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


def _staged(batch, n: int, room: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``batch.fill`` into poisoned views of a staging buffer with room for ``room`` terms."""
    ptr = np.full(n + 1, -7, np.int32)
    ind, val = np.full(room, -7, np.int32), np.full(room, np.nan, np.float32)
    batch.fill(ptr, ind, val)
    return ptr, ind, val


@native
@pytest.mark.parametrize("start", [0, 5])
def test_staged_batch_same_both_ways(rng, monkeypatch, start):
    """A CUDA graph's batch (:func:`csr_batch`): the longest row and the staged rows by the C passes
    equal numpy's, for row pointers that start past 0 too."""
    for n in (1, 7, 64, 300):
        q = _rows(rng, n, spread=3)
        lengths, indptr = np.diff(q.indptr), q.indptr + start
        got = csr_batch(indptr, q.indices, q.values, 8)
        with monkeypatch.context() as mp:
            mp.setattr(queries_native, "_native", None)
            mp.setattr(queries_native, "_warned", True)
            want = csr_batch(indptr, q.indices, q.values, 8)
            staged_numpy = _staged(want, n, want.nnz + 9)
        assert got.longest == want.longest == int(lengths.max()) and got.nnz == want.nnz == int(lengths.sum())
        staged = _staged(got, n, got.nnz + 9)
        for g, w in zip(staged, staged_numpy, strict=True):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(staged[0], np.concatenate([[0], np.cumsum(lengths)]))
        np.testing.assert_array_equal(staged[1][: got.nnz], q.indices)
        np.testing.assert_array_equal(staged[2][: got.nnz], q.values)
        assert (staged[1][got.nnz :] == -7).all() and np.isnan(staged[2][got.nnz :]).all()  # past the terms: untouched


@native
def test_staging_passes_refuse_inconsistent_arrays():
    ptr = np.array([0, 2, 5], np.int64)
    ind, val = np.arange(5, dtype=np.int32), np.ones(5, np.float32)
    assert queries_native.longest_row(ptr) == 3 and queries_native.longest_row(np.array([4], np.int64)) == 0
    with pytest.raises(ValueError, match="must not decrease"):
        queries_native.longest_row(np.array([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="at least one entry"):
        queries_native.longest_row(np.array([], np.int64))
    out_ptr, out_ind, out_val = np.empty(3, np.int32), np.empty(5, np.int32), np.empty(5, np.float32)
    with pytest.raises(ValueError, match="no room"):
        queries_native.stage_rows(ptr, ind, val, out_ptr, out_ind[:4], out_val)
    with pytest.raises(ValueError, match="rows \\+ 1"):
        queries_native.stage_rows(ptr, ind, val, out_ptr[:2], out_ind, out_val)
    with pytest.raises(ValueError, match="does not end"):
        queries_native.stage_rows(np.array([0, 2, 4]), ind, val, out_ptr, out_ind, out_val)
    with pytest.raises(ValueError, match="must not decrease"):
        queries_native.stage_rows(np.array([0, 3, 2, 5]), ind, val, np.empty(4, np.int32), out_ind, out_val)
    assert queries_native.stage_rows(ptr, ind, val, out_ptr, out_ind, out_val) == 3  # the longest row
    assert queries_native.stage_rows(np.array([7, 7, 7], np.int64), ind[:0], val[:0], out_ptr, out_ind, out_val) == 0
    assert out_ptr.tolist() == [0, 0, 0]
    assert queries_native.stage_rows(ptr, ind, val, out_ptr, out_ind, out_val) == 3
    assert out_ptr.tolist() == [0, 2, 5] and out_ind.tolist() == [0, 1, 2, 3, 4] and out_val.tolist() == [1] * 5
