"""A small batch's host preparation before its launch (issue 23): query quantisation, the score
bound check, the padded batch, the fixed-point parameters and the integer-weights check are
bit-identical to the computation they replaced (frozen below, as it was at a93d098), on random
batches with edge cases: empty queries, one term, weights at 1e-4 and 3.5, huge and tiny
weights (fixed_point_host then raises), batch sizes around the scalar path's limit, 8-bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.config import engine_config, override_config
from gpusparse.engines.tiled import engine as engine_mod
from gpusparse.engines.tiled.engine import layout_for_search
from gpusparse.engines.tiled.fixed_point import (
    FIXED_MAX_DELTA,
    SCALAR_ROWS,
    _match_floor_host,
    fixed_point_host,
    integer_weights_host,
)
from gpusparse.engines.tiled.graphs import query_width
from gpusparse.errors import InputError
from gpusparse.kernels.tile_candidates import ACC_TOP
from gpusparse.layout.statistics import max_score, max_scores_host, min_weight
from gpusparse.quantize import power_of_two_step, power_of_two_steps, quantize_queries
from gpusparse.queries import F32_MAX, check_score_bound, padded_host, prepare_queries, prepare_queries_deferred

V = 64  # terms
VOCAB = Vocabulary.integer(V)

# -- the computation as it was (a93d098), kept small ------------------------------------------


def old_steps(m: np.ndarray, bits: int) -> np.ndarray:
    top = (1 << bits) - 1
    steps = np.ones(m.shape)
    pos = m > 0
    s = np.ldexp(1.0, np.ceil(np.log2(m[pos] / top)).astype(np.int64))
    over = m[pos] / s > top
    while over.any():
        s[over] *= 2
        over = m[pos] / s > top
    steps[pos] = s
    return steps


def old_quantize(q: SparseCollection, bits: int) -> SparseCollection:
    indptr, values = q.indptr.astype(np.int64), q.values.astype(np.float64)
    lens, n = np.diff(indptr), len(q)
    row_max, nonempty = np.zeros(n), lens > 0
    if values.size:
        row_max[nonempty] = np.maximum.reduceat(values, indptr[:-1][nonempty])
    step_of = np.repeat(old_steps(row_max, bits), lens)
    lev = np.clip(np.round(values / step_of), 0, (1 << bits) - 1)
    keep = lev > 0
    new_indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(np.repeat(np.arange(n), lens)[keep], minlength=n), out=new_indptr[1:])
    new_values = (lev[keep] * step_of[keep]).astype(np.float32)
    return SparseCollection(new_indptr, q.indices[keep], new_values, vocab=q.vocab, ids=q.ids, check_ids=False,
                            copy=False)  # fmt: skip


def old_bad_rows(q: SparseCollection, max_scores: np.ndarray) -> np.ndarray:
    products = q.values.astype(np.float64) * np.asarray(max_scores, dtype=np.float64)[q.indices]
    rows = np.repeat(np.arange(len(q)), np.diff(q.indptr))
    bounds = np.bincount(rows, weights=products, minlength=len(q)).astype(np.float64)
    return bounds * (1.0 + (np.diff(q.indptr) + 1) * 2.0**-23) > F32_MAX


def old_padded(q: SparseCollection, widen) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.diff(q.indptr).astype(np.int64)
    b = len(lengths)
    width = widen(int(lengths.max()) if b else 0)
    real = np.arange(width) < lengths[:, None]
    terms = np.full((b, width), -1, dtype=np.int64)
    terms[real] = q.indices
    weights = np.zeros((b, width), dtype=np.float32)
    weights[real] = q.values
    return terms, weights, lengths


def old_fixed_point_host(index, terms, weights, n_terms, acc, weight_bits) -> dict:
    max_scores = max_scores_host(index)
    w64 = weights.astype(np.float64)
    ub = np.einsum("ij,ij->i", w64, max_scores[terms]) if terms.size else np.zeros(len(terms))
    mant, expo = np.frexp(ub)
    e = int(math.log2(ACC_TOP[acc])) - expo + (mant == 0.5)
    scale = np.where(ub > 0, np.ldexp(1.0, np.clip(e, -1000, 1000)), 1.0)
    n = n_terms.astype(np.float64)
    canon = (ub * scale) * 2 * (n + 1) * 2.0**-53
    b = terms.shape[0]
    qmin = np.where(terms >= 0, weights, np.inf).min(1) if terms.shape[1] else np.full(b, np.inf)
    floor = qmin.astype(np.float64) * min_weight(index)
    if weight_bits is None:
        delta = np.ceil(2 * (n / 2 + 1) + 2 * canon + 2)
        return {"scale": scale, "delta": delta.astype(np.int64), "lb": floor}
    qmax = (weights.max(1) if terms.shape[1] else np.zeros(len(scale))) * scale
    qsum = w64.sum(1) * scale
    _, qexpo = np.frexp(qmax)
    c = np.where(qmax > 0, 31 - qexpo, 0)
    err = n + n * max_score(index) * np.ldexp(0.5, -c) + qsum * 2.0 ** -(weight_bits + 1)
    err += n * np.ldexp(0.25, -(weight_bits + c))
    delta = np.ceil(2 * (err + 1) + 2 * canon + 2)
    shift = weight_bits + c
    if (shift < 0).any() or (shift > 62).any() or (delta > FIXED_MAX_DELTA).any():
        raise ValueError("weights outside the fixed-point range")
    return {"scale": scale, "delta": delta.astype(np.int64), "mult": np.ldexp(scale, c),
            "shift": shift.astype(np.int32), "lb": floor}  # fmt: skip


def old_integer_weights(layout, weights, scale, acc) -> bool:
    if not layout.quantized or acc != "u32":
        return False
    w = weights.astype(np.float64) * (scale * layout.step)[:, None]
    return bool((w == np.round(w)).all())


# -- random batches ---------------------------------------------------------------------------


def random_weights(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "splade":  # clamped to [1e-4, 3.5], both ends hit
        w = np.clip(np.log1p(np.exp(rng.normal(-1.0, 1.5, n))), 1e-4, 3.5)
        w[rng.random(n) < 0.1] = 1e-4
        w[rng.random(n) < 0.1] = 3.5
    elif kind == "powers":  # powers of two and half-steps: exact levels and ties
        w = np.ldexp(rng.choice([1.0, 1.5, 0.75, 255.0, 127.5], n), rng.integers(-10, 3, n))
    elif kind == "wide":  # tiny to huge
        w = rng.random(n) * 10.0 ** rng.integers(-38, 20, n)
    elif kind == "tiny":  # float32 subnormals (steps below 2**-149: levels exact, none underflows)
        return np.ldexp(rng.random(n) + 0.5, rng.integers(-149, -138, n)).astype(np.float32)
    else:  # "equal": ties everywhere
        w = np.full(n, 0.7)
    return np.maximum(w, 1e-38).astype(np.float32)


def random_queries(rng: np.random.Generator, b: int, kind: str) -> SparseCollection:
    lens = rng.choice([0, 1, 2, 5, 17, 40, V], b)
    indices = [np.sort(rng.choice(V, size=n, replace=False)) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(lens)])
    flat = np.concatenate(indices).astype(np.int32) if b else np.zeros(0, np.int32)
    return SparseCollection(indptr, flat, random_weights(rng, int(lens.sum()), kind), vocab=VOCAB)


def random_index(rng: np.random.Generator, kind: str, quantize: int | None) -> Index:
    n_docs = 200
    lens = rng.integers(1, 20, n_docs)
    terms = np.concatenate([np.sort(rng.choice(V, size=n, replace=False)) for n in lens]).astype(np.int32)
    weights = random_weights(rng, int(lens.sum()), kind if kind != "equal" else "splade")
    if kind == "outlier":  # one weight that dwarfs the rest: fixed-point products out of range
        weights = random_weights(rng, int(lens.sum()), "splade")
        weights[0] = 1e30
    indptr = np.concatenate([[0], np.cumsum(lens)])
    return Index.from_csr(indptr, terms, weights, VOCAB, device="cpu", quantize=quantize)


BATCHES = [0, 1, 2, 3, SCALAR_ROWS, SCALAR_ROWS + 1, 37]
KINDS = ["splade", "powers", "wide", "tiny", "equal"]


def same_arrays(got, want) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_host_preparation_is_bit_identical_to_the_old_computation(bits, kind):
    rng = np.random.default_rng([bits or 0, KINDS.index(kind)])
    seen = set()  # the outcomes met (checked below: the comparisons above saw each)
    for index_kind in ("splade", "wide", "outlier"):
        index = random_index(rng, index_kind, bits)
        for acc in ("u32", "carry"):
            layout = layout_for_search(index, acc=acc)
            for b in BATCHES:
                q = random_queries(rng, b, kind)
                ms = max_scores_host(index)
                want_bad = old_bad_rows(old_q := (q if bits is None else old_quantize(q, bits)), ms)
                if want_bad.any():
                    with pytest.raises(InputError, match=f"query {q.ids[int(np.argmax(want_bad))]!r}: its weights"):
                        prepare_queries(q, VOCAB, index.quantization, ms)
                    seen.add("refused")
                    continue
                got_q = prepare_queries(q, VOCAB, index.quantization, ms)
                for name in ("indptr", "indices", "values"):
                    same_arrays(getattr(got_q, name), getattr(old_q, name))
                assert got_q.ids == q.ids and got_q.vocab is q.vocab
                padded = padded_host(got_q, query_width)
                for g, w in zip(padded, old_padded(old_q, query_width), strict=True):
                    same_arrays(g, w)
                terms, weights, lengths = padded
                for wb in dict.fromkeys((None, layout.weight_bits)):
                    try:
                        want = old_fixed_point_host(index, terms, weights, lengths, acc, wb)
                    except ValueError:
                        with pytest.raises(ValueError, match="outside the fixed-point range"):
                            fixed_point_host(index, terms, weights, lengths, acc, wb)
                        seen.add("out of range")
                        continue
                    got = fixed_point_host(index, terms, weights, lengths, acc, wb)
                    assert list(got) == list(want)
                    for name in want:
                        same_arrays(got[name], want[name])
                    same_arrays(_match_floor_host(index, terms, weights), want["lb"])
                    int_w = integer_weights_host(layout, weights, got["scale"], acc)
                    assert int_w == old_integer_weights(layout, weights, want["scale"], acc)
                    seen.update({"scalar rows" if 0 < b <= SCALAR_ROWS else "numpy rows", f"integer {int_w}"})
    assert {"scalar rows", "numpy rows", "integer False"} <= seen
    if bits is None:
        assert "out of range" in seen
    else:
        assert "integer True" in seen
    assert ("refused" in seen) == (kind == "wide")


def test_an_outlier_document_weight_is_out_of_range_with_fixed_point_weights_only():
    """One document weight of 1e30: fixed-point document weights cannot hold the others (the
    caller then takes float64 products), float32 weights still can; 8-bit queries against an
    8-bit index take integer products."""
    rng = np.random.default_rng(5)
    index = random_index(rng, "outlier", None)
    layout = layout_for_search(index, acc="u32")
    q = random_queries(rng, 3, "splade")
    terms, weights, lengths = padded_host(q, query_width)
    with pytest.raises(ValueError):
        fixed_point_host(index, terms, weights, lengths, "u32", layout.weight_bits)
    fixed_point_host(index, terms, weights, lengths, "u32", None)
    quantized = random_index(rng, "splade", 8)
    layout = layout_for_search(quantized, acc="u32")
    q = quantize_queries(random_queries(rng, 2, "splade"), 8)
    terms, weights, lengths = padded_host(q, query_width)
    scale = fixed_point_host(quantized, terms, weights, lengths, "u32", None)["scale"]
    assert integer_weights_host(layout, weights, scale, "u32")


@pytest.mark.parametrize("largest", [None, 2.0])
def test_score_bound_refusal_names_the_query_near_the_limit(largest):
    """Weights near float32's largest fail the cheap proof and reach the exact sums: the first
    query whose bound overflows is named, one just below the limit passes; the same with the
    maxima's largest given (as a search passes the index's, kept with it)."""
    ms = np.ones(V)
    ms[3] = 2.0
    ok = np.float32(F32_MAX / 2) / 2
    q = SparseCollection([0, 1, 3, 3, 4], [0, 1, 2, 3], [1.0, ok, ok, 3e38], ids=["a", "b", "c", "d"], vocab=VOCAB)
    with pytest.raises(InputError, match="query 'd': its weights are too large"):
        check_score_bound(q, ms, largest)
    check_score_bound(q[0:3], ms, largest)
    assert not old_bad_rows(q[0:3], ms).any() and old_bad_rows(q, ms)[3]


def test_quantized_weight_that_rounds_to_inf_is_refused():
    """A weight near float32's largest can round up to a level whose value overflows: the query is
    refused, naming it (before: the same InputError from the collection's constructor)."""
    q = SparseCollection([0, 1], [3], [np.float32(3.4e38)], ids=["big"], vocab=VOCAB)
    index = Index.from_csr(np.array([0, 1]), np.array([3], np.int32), np.ones(1, np.float32), VOCAB, quantize=8)
    with pytest.raises(InputError, match="query 'big'"), np.errstate(over="ignore"):
        prepare_queries(q, VOCAB, index.quantization, np.ones(V))


@pytest.mark.parametrize("scale", [1.0, 1e10, 1e20, 1e30, 3.4e38 / 255, 1.7e38])
def test_deferred_quantization_refuses_exactly_what_the_host_quantization_refuses(rng, scale):
    """An engine that quantizes queries itself gets them unquantized only where no quantized
    query could be refused (the proof from the raw weights); otherwise they are quantized and
    checked here: refused where prepare_queries refuses, the same queries where it passes. With
    ``defer`` off, or an index not quantized, nothing is deferred."""
    ms = rng.uniform(0.5, 2.0, size=V)
    index = Index.from_csr(np.array([0, 1]), np.array([3], np.int32), np.ones(1, np.float32), VOCAB, quantize=8)
    vals = (rng.uniform(0.01, 1.0, size=12) * scale).astype(np.float32)
    q = SparseCollection(np.arange(0, 13, 3), rng.choice(V, size=12, replace=False).reshape(4, 3).ravel() % V,
                         vals, vocab=VOCAB)  # fmt: skip
    try:
        want = prepare_queries(q, VOCAB, index.quantization, ms)
    except InputError:
        with pytest.raises(InputError):
            prepare_queries_deferred(q, VOCAB, index.quantization, ms, defer=True)
        return
    got, bits = prepare_queries_deferred(q, VOCAB, index.quantization, ms, defer=True)
    if bits is None:  # not proven: quantized here
        assert scale > 1e10
        np.testing.assert_array_equal(got.values, want.values)
    else:
        assert bits == 8 and got is q and scale <= 1e20
        np.testing.assert_array_equal(quantize_queries(got, bits).values, want.values)
    assert prepare_queries_deferred(q, VOCAB, index.quantization, ms)[1] is None
    assert prepare_queries_deferred(q, VOCAB, None, ms, defer=True)[1] is None


@pytest.mark.parametrize("bits", [1, 2, 4, 7, 8])
def test_steps_are_exact_at_the_boundaries(bits):
    """At ``top · 2**k`` and one float64 ulp either side (where log2 rounds), every step is the
    smallest that fits, equal to the scalar step and to the old vectorised one."""
    top = (1 << bits) - 1
    at = np.ldexp(float(top), np.arange(-150, 130, 7))
    m = np.concatenate([at, np.nextafter(at, 0), np.nextafter(at, np.inf), np.ldexp(1.0, np.arange(-149, 128, 5))])
    got = power_of_two_steps(m, bits)
    np.testing.assert_array_equal(got, old_steps(m, bits))
    np.testing.assert_array_equal(got, [power_of_two_step(float(x), bits) for x in m])
    assert (m / got <= top).all() and (m / (got / 2) > top).all()


def test_the_layout_a_search_resolves_to_follows_the_settings():
    """layout_for_search keeps its answer per arguments and settings: the same layout while the
    settings stand, the one the new settings resolve to under override_config (and the first
    again after the block), and nothing kept once the index's derived state is reset."""
    rng = np.random.default_rng(3)
    index = random_index(rng, "splade", None)

    def resolved(**kw):  # without the kept answers
        return engine_mod._layout_for_search(index, engine_config(), None, "auto", "u32", None, True, **kw)

    first = layout_for_search(index, acc="u32")
    assert layout_for_search(index, acc="u32") is first is resolved()
    for change in ({"dense_min": 0.3}, {"fixed_point": False}, {"dense_min": None}):
        with override_config(**change):
            other = layout_for_search(index, acc="u32")
            assert other is not first and other is resolved() and layout_for_search(index, acc="u32") is other
        assert layout_for_search(index, acc="u32") is first
    assert layout_for_search(index, acc="u32", forward=False) is first  # a CPU: no forward copy either way
    assert layout_for_search(index, tile_bits=first.tile_bits - 1, acc="u32").tile_bits == first.tile_bits - 1
    index.derived.reset()
    assert not index.derived.chosen and not index.derived.layouts
    again = layout_for_search(index, acc="u32")
    assert again is not first and again is resolved()
