"""Exactness of every search path against the float64 dense brute force."""

from __future__ import annotations

import os

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import Index, InputError, SparseCollection, Vocabulary
from gpusparse.engines import names as available_kernels
from gpusparse.engines import plan_chunks

from .reference import canonical_scores, order_sensitive_collection, random_collection, reference_topk

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

SHAPES = [
    # n_docs, n_queries, n_terms, doc nnz, query nnz, empty fraction
    pytest.param(1, 3, 5, 3, 2, 0.0, id="one-doc"),
    pytest.param(40, 4, 1, 1, 1, 0.0, id="one-term"),
    pytest.param(200, 9, 50, 6, 4, 0.1, id="small-with-empties"),
    pytest.param(700, 17, 300, 12, 8, 0.05, id="medium"),
    pytest.param(1500, 5, 2000, 30, 20, 0.0, id="wide-vocab"),
]


def skip_unrunnable(kernel: str, device: str) -> None:
    """Triton kernels run on CUDA, or on the CPU only under Triton's interpreter."""
    from gpusparse.kernels import triton_available

    if kernel in ("scatter", "docpar"):
        if not triton_available():
            if torch.cuda.is_available():  # Triton is a dependency on CUDA machines: its absence is a failure
                pytest.fail("CUDA is available but Triton is not: the Triton engines would go untested", pytrace=False)
            pytest.skip("needs Triton")
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels run on the CPU only under TRITON_INTERPRET=1")


def check(index: Index, docs: SparseCollection, queries: SparseCollection, k: int, **kw) -> None:
    """The search equals the canonical reference bit for bit: ids, order and float32 scores."""
    res = index.search(queries, k, **kw)
    ref_s, ref_i = reference_topk(canonical_scores(docs, queries), k)
    assert res.scores.shape == (len(queries), k) and res.ids.shape == (len(queries), k)
    assert res.scores.dtype == torch.float32 and res.ids.dtype == torch.int64
    np.testing.assert_array_equal(res.ids.cpu().numpy(), ref_i)
    np.testing.assert_array_equal(res.scores.cpu().numpy(), ref_s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["auto", *available_kernels()])
@pytest.mark.parametrize("quantized", [True, False], ids=["ties", "continuous"])
@pytest.mark.parametrize(("n_docs", "n_q", "n_terms", "d_nnz", "q_nnz", "empty"), SHAPES)
def test_search_matches_brute_force(rng, n_docs, n_q, n_terms, d_nnz, q_nnz, empty, quantized, kernel, device):
    skip_unrunnable(kernel, device)
    docs = random_collection(rng, n_docs, n_terms, d_nnz, quantized=quantized, empty_fraction=empty)
    queries = random_collection(rng, n_q, n_terms, q_nnz, quantized=quantized, empty_fraction=empty)
    index = Index.build(docs, device=device)
    for k in sorted({1, 3, 10, n_docs, n_docs + 7}):
        check(index, docs, queries, k, kernel=kernel)


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_keeps_every_array(rng, device):
    """One copy for many arrays: each comes back with its dtype, shape and values, whatever
    their sizes (odd byte counts, empty) and the order."""
    from gpusparse.transfer import to_device

    arrays = [
        rng.random(5),
        rng.integers(-(2**40), 2**40, (3, 7)),
        rng.integers(-5, 5, 3).astype(np.int32),
        np.zeros((0, 4), dtype=np.float32),
        rng.random((2, 3)).astype(np.float32),
        rng.random(7) > 0.5,
        np.arange(1, dtype=np.int64),
    ]
    got = to_device(arrays, torch.device(device))
    for a, t in zip(arrays, got, strict=True):
        assert t.device.type == device and tuple(t.shape) == a.shape
        np.testing.assert_array_equal(t.cpu().numpy(), a)
        assert t.cpu().numpy().dtype == a.dtype


@pytest.mark.parametrize("batch_size", [None, 4])
def test_rows_flagged_for_another_search_are_replaced(rng, monkeypatch, batch_size):
    """A batch's rows that its deferred search flags (a GPU search's overflowing rows) hold
    garbage until searched again after the host sync; the output must not show it."""
    from gpusparse import engines

    from .distributed_worker import flagging

    docs = random_collection(rng, 300, 60, 8, quantized=True)
    queries = random_collection(rng, 11, 60, 5, quantized=True, empty_fraction=0.1)
    index = Index.build(docs)
    monkeypatch.setattr(engines, "choose", flagging(engines.choose, 1))
    check(index, docs, queries, 20, kernel="reference", batch_size=batch_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", available_kernels())
def test_chunking_does_not_change_results(rng, device, kernel):
    if device == "cpu" and kernel != "reference":
        pytest.skip("many small chunks are too slow for Triton's interpreter; covered on CUDA")
    skip_unrunnable(kernel, device)
    docs = random_collection(rng, 3000, 400, 20, quantized=True)
    queries = random_collection(rng, 23, 400, 10, quantized=True, empty_fraction=0.1)
    index = Index.build(docs, device=device)
    full = index.search(queries, 50, kernel=kernel)
    for batch_size, budget in [(1, None), (5, 1 << 16), (None, 1 << 16), (23, 200_000), (7, 1 << 17)]:
        part = index.search(queries, 50, batch_size=batch_size, memory_budget=budget, kernel=kernel)
        assert torch.equal(part.ids, full.ids) and torch.equal(part.scores, full.scores)
    check(index, docs, queries, 50, memory_budget=1 << 16, batch_size=3, kernel=kernel)


def test_plan_chunks_respects_budget():
    for n_q, n_d, budget, bs in [(256, 10**6, 1 << 30, None), (1000, 8_841_823, 1 << 30, 256), (3, 10, 1 << 16, None)]:
        bq, dc = plan_chunks(n_q, n_d, budget, bs)
        assert 1 <= bq <= max(1, n_q) and 1 <= dc <= n_d
        assert bq * dc * 20 <= budget


def test_tie_break_is_lower_doc_id_first():
    # Ten identical documents: every query ties on all of them.
    docs = SparseCollection.from_dicts([{"capital": 1.0, "france": 2.0}] * 10)
    index = Index.build(docs)
    res = index.search([{"france": 1.5}], k=4)
    assert res.ids.tolist() == [[0, 1, 2, 3]]
    assert res.scores.tolist() == [[3.0] * 4]


def test_padding_when_fewer_matches_than_k():
    docs = SparseCollection.from_dicts([{"capital": 1.0}, {"paris": 2.0}, {}, {"capital": 0.5, "paris": 1.0}])
    index = Index.build(docs)
    res = index.search([{"capital": 1.0}, {}, {"zebra": 1.0}], k=6)
    assert res.ids.tolist() == [[0, 3, -1, -1, -1, -1], [-1] * 6, [-1] * 6]
    assert res.scores[0, :2].tolist() == [1.0, 0.5]
    assert res.scores[0, 2:].eq(0).all() and res.scores[1:].eq(0).all()


def test_retrieve_returns_string_ids():
    docs = SparseCollection.from_dicts([{"capital": 1.0}, {"capital": 2.0, "paris": 1.0}], ids=["d1", "d2"])
    queries = SparseCollection.from_dicts([{"capital": 1.0, "paris": 1.0}], ids=["q1"])
    assert Index.build(docs).retrieve(queries, k=5) == {"q1": [("d2", 3.0), ("d1", 1.0)]}


def test_scipy_queries_against_token_index(rng):
    docs = random_collection(rng, 100, 50, 5)
    index = Index.build(docs)
    q = sp.random(4, 50, density=0.2, format="csr", dtype=np.float32, random_state=int(rng.integers(1 << 31)))
    check(index, docs, SparseCollection.from_scipy(q), 10)
    res = index.search(q, 10)  # a bare scipy matrix works too
    assert res.ids.shape == (4, 10)


def test_vocabulary_mismatch_is_refused():
    docs = SparseCollection.from_dicts([{"capital": 1.0}])
    index = Index.build(docs)
    other = Vocabulary(["capital", "france"])
    queries = SparseCollection.from_dicts([{"capital": 1.0}], vocab=other)
    with pytest.raises(InputError, match="vocabulary"):
        index.search(queries, 1)
    too_wide = sp.csr_matrix(np.ones((1, len(Vocabulary.bert()) + 1), np.float32))
    with pytest.raises(InputError, match="vocabulary"):
        index.search(too_wide, 1)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_bad_k_is_refused(bad):
    index = Index.build(SparseCollection.from_dicts([{"capital": 1.0}]))
    with pytest.raises(ValueError, match="k must be"):
        index.search([{"capital": 1.0}], bad)


def test_unknown_kernel_is_refused():
    index = Index.build(SparseCollection.from_dicts([{"capital": 1.0}]))
    with pytest.raises(ValueError, match="unknown kernel"):
        index.search([{"capital": 1.0}], 1, kernel="magic")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_cpu_at_scale(rng):
    docs = random_collection(rng, 50_000, 3000, 40)
    queries = random_collection(rng, 64, 3000, 20)
    cpu = Index.build(docs).search(queries, 100)
    gpu = Index.build(docs, device="cuda").search(queries, 100, memory_budget=1 << 24)
    assert torch.equal(cpu.ids, gpu.ids) and torch.equal(cpu.scores, gpu.scores)


def test_exact_scores_are_canonical(rng):
    from gpusparse.exact import exact_scores
    from gpusparse.queries import query_batch

    docs = random_collection(rng, 400, 120, 15, empty_fraction=0.05)
    queries = random_collection(rng, 9, 120, 12, empty_fraction=0.1)
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    rows = torch.from_numpy(rng.integers(0, 9, 500))
    cand = torch.from_numpy(rng.integers(0, 400, 500))
    got = exact_scores(index, batch, rows, cand, max_cells=64)  # tiny steps: many pieces
    ref = canonical_scores(docs, queries)[rows.numpy(), cand.numpy()].astype(np.float32)
    np.testing.assert_array_equal(got.numpy(), ref)


def order_sensitive_data(rng: np.random.Generator, n_docs: int = 300, n_terms: int = 40):
    """Documents whose float32 score depends on the summation order, all-ones queries (and a
    scaled one), and the proof that ascending term order is what the reference pins."""
    docs = order_sensitive_collection(rng, n_docs, n_terms)
    queries = SparseCollection.from_scipy(
        sp.csr_matrix(np.vstack([np.ones(n_terms), np.full(n_terms, 0.5), np.full(n_terms, 4.0)]).astype(np.float32))
    )
    ascending = canonical_scores(docs, queries).astype(np.float32)
    reversed_terms = SparseCollection.from_scipy(docs.to_scipy()[:, ::-1])
    descending = canonical_scores(reversed_terms, SparseCollection.from_scipy(queries.to_scipy()[:, ::-1]))
    assert np.count_nonzero(ascending != descending.astype(np.float32)) > n_docs // 10  # the order matters
    return docs, queries, ascending


def test_exact_scores_sum_in_ascending_term_order(rng):
    """The canonical definition, pinned: float64 sum over the query's terms in ascending term
    order, rounded once to float32, on inputs where another order rounds differently."""
    from gpusparse.exact import exact_scores
    from gpusparse.queries import query_batch

    docs, queries, ascending = order_sensitive_data(rng)
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    rows = torch.arange(3).repeat_interleave(len(docs))
    cand = torch.arange(len(docs)).repeat(3)
    got = exact_scores(index, batch, rows, cand, max_cells=64)
    np.testing.assert_array_equal(got.numpy().reshape(3, -1), ascending)


def test_exact_scores_over_many_magnitudes(rng):
    """Weights spanning 2^-40 .. 2^20: the canonical sum equals the ascending-order reference."""
    from gpusparse.exact import exact_scores
    from gpusparse.queries import query_batch

    base_d = random_collection(rng, 300, 80, 15).to_scipy()
    base_q = random_collection(rng, 6, 80, 20).to_scipy()
    for m in (base_d, base_q):
        m.data = (m.data * 2.0 ** rng.integers(-40, 21, m.data.size)).astype(np.float32)
    docs, queries = SparseCollection.from_scipy(base_d), SparseCollection.from_scipy(base_q)
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    rows = torch.arange(6).repeat_interleave(300)
    cand = torch.arange(300).repeat(6)
    got = exact_scores(index, batch, rows, cand, max_cells=256)
    np.testing.assert_array_equal(got.numpy().reshape(6, -1), canonical_scores(docs, queries).astype(np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", available_kernels())
def test_search_reports_the_ascending_order_score(rng, kernel, device):
    """Every engine ranks and scores order-sensitive documents by the canonical sum."""
    skip_unrunnable(kernel, device)
    docs, queries, _ = order_sensitive_data(rng, n_docs=120)
    index = Index.build(docs, device=device)
    for k in (1, 10, 120):
        check(index, docs, queries, k, kernel=kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_select_exact_topk_from_perturbed_scores(rng, dtype):
    """Any approximation within the float32/float64 error bound yields the exact top-k."""
    from gpusparse.exact import select_exact_topk
    from gpusparse.queries import query_batch

    docs = random_collection(rng, 600, 60, 10)
    queries = random_collection(rng, 7, 60, 8)
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    exact = canonical_scores(docs, queries)
    u = 2.0**-24 if dtype == torch.float32 else 2.0**-53
    n = batch.n_terms.numpy()[:, None].astype(np.float64)
    # Worst-case-like perturbation: each score moved by up to (n)·u relative, randomly.
    noisy = exact * (1 + rng.uniform(-1, 1, exact.shape) * n * u)
    approx = torch.from_numpy(noisy).to(dtype)
    for k in (1, 5, 40, 600):
        s, i = select_exact_topk(index, batch, approx, k, 0)
        ref_s, ref_i = reference_topk(exact, min(k, 600))
        np.testing.assert_array_equal(np.where(s.numpy() > 0, i.numpy(), -1), ref_i)
        np.testing.assert_array_equal(np.where(s.numpy() > 0, s.numpy(), 0), ref_s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", available_kernels())
def test_index_without_postings(kernel, device):
    skip_unrunnable(kernel, device)
    index = Index.build(SparseCollection.from_dicts([{}, {}, {}]), device=device)
    res = index.search([{"capital": 1.0}, {}], k=2, kernel=kernel)
    assert res.ids.tolist() == [[-1, -1], [-1, -1]] and res.scores.eq(0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", available_kernels())
def test_scores_equal_after_float32_rounding_tie_break_by_id(kernel, device):
    """Doc 1 scores 1e-9 more than doc 0 in float64, but both round to 1.0 in float32:
    the contract ranks by the float32 score, so the lower id (doc 0) comes first."""
    skip_unrunnable(kernel, device)
    docs = SparseCollection.from_dicts([{"capital": 1.0}, {"capital": 1.0, "paris": 1e-9}, {"france": 1.0}])
    res = Index.build(docs, device=device).search([{"capital": 1.0, "paris": 1.0}], k=1, kernel=kernel)
    assert res.ids.tolist() == [[0]] and res.scores.tolist() == [[1.0]]


def test_a_search_is_resolved_once_per_arguments_and_settings(rng):
    """Index.search keeps what its arguments resolve to (per arguments and settings): the same
    results as the free function for fresh queries each time, a new resolution for other
    arguments, settings or search device, a bad k refused after a good one was kept, nothing
    kept after a reset, and at most SEARCHES_KEPT kept."""
    from gpusparse.config import override_config
    from gpusparse.layout.derived import SEARCHES_KEPT
    from gpusparse.search import search as free_search

    docs = random_collection(rng, 300, 80, 8)
    index = Index.build(docs)
    searches = index.derived.searches
    for _ in range(3):
        queries = random_collection(rng, 5, 80, 4)
        res = index.search(queries, 7)
        want = free_search(index, queries, 7)
        assert torch.equal(res.ids, want.ids) and torch.equal(res.scores, want.scores) and res.engine == want.engine
    assert len(searches) == 1
    (first,) = searches.values()
    index.search(queries, 7)
    assert list(searches.values()) == [first]
    index.search(queries, 7, batch_size=2)
    index.search(queries, 8)
    assert len(searches) == 3
    with override_config(accumulator="carry"):
        res = index.search(queries, 7)
        assert torch.equal(res.ids, free_search(index, queries, 7).ids)
    (config, kept) = searches[next(k for k in searches if k[2] == 7 and k[3] is None)]
    assert kept is not first[1] and config is not first[0]  # resolved again under the block's settings
    index.search(queries, 1)
    with pytest.raises(ValueError, match="k must be"):
        index.search(queries, True)
    index.search_device = torch.device("cpu")
    n = len(searches)
    index.search(queries, 7)
    assert len(searches) == n + 1
    for k in range(1, SEARCHES_KEPT + 3):
        index.search(queries, k, batch_size=3)
    assert len(searches) == SEARCHES_KEPT
    index.derived.reset()
    assert not searches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_search_on_a_bare_cuda_device_is_resolved_each_time(rng):
    """``device="cuda"`` names whichever device is current at each call: what it resolves to is
    not kept; the index's own device (``device=None`` or ``"cuda:N"``) is. Results the same."""
    docs = random_collection(rng, 300, 80, 8)
    index = Index.build(docs, device="cuda")
    queries = random_collection(rng, 5, 80, 4)
    bare = index.search(queries, 7, device="cuda")
    assert not index.derived.searches
    named = index.search(queries, 7, device=f"cuda:{torch.cuda.current_device()}")
    own = index.search(queries, 7)
    assert len(index.derived.searches) == 2
    for res in (named, own):
        assert torch.equal(res.ids, bare.ids) and torch.equal(res.scores, bare.scores)


class _Repeating:
    """An engine (the reference one inside) whose results carry a repeat
    (:attr:`BatchResult.repeat`), as the tiled engine's graphed batches do: a repeat serves a batch
    of as many queries as the batch that made it, delivered to the host, its first row flagged and
    poisoned until searched again; it declines any other (``None``). Calls are recorded."""

    name, auto_rank, quantizes_queries = "repeating", 0, False

    def __init__(self, inner) -> None:
        self.inner, self.general, self.repeats, self.dropped = inner, [], [], 0

    def unavailable(self, device, *, auto=False):
        return None

    def search_batch(self, index, queries, k, plan):
        self.general.append(len(queries))
        res = self.inner.search_batch(index, queries, k, plan)
        return res._replace(repeat=lambda q, bits: self._repeat(index, k, plan, len(queries), q, bits))

    def _repeat(self, index, k, plan, rows, queries, bits):
        from gpusparse.engines.base import BatchResult

        self.repeats.append((len(queries), bits))
        if len(queries) != rows:
            return None
        scores, ids = self.inner.search_batch(index, queries, k, plan).resolved()
        scores, ids = scores.clone(), ids.clone()
        scores[0], ids[0] = -1.0, 12345  # garbage until searched again
        redo = torch.zeros(len(queries), dtype=torch.bool)
        redo[0] = True

        engine = self

        class Host:
            def take(self, into=()):
                engine.dropped += 1  # (taken by the search's finish, which counts it back)
                return scores, ids, redo

        def again(found):
            assert found.tolist() == [0]
            return self.inner.search_batch(index, queries[0:1], k, plan).resolved()

        return BatchResult(None, None, None, again, host=Host())


def test_a_search_repeats_its_one_batch_by_the_engines_repeat(rng):
    """A Search whose last call was one batch sends the next call's queries to that batch's
    repeat (its flagged rows searched again); where the repeat declines, or the call is several
    batches or shows progress, the batch loop runs as before. Every result exact, padded to k
    past the documents."""
    from gpusparse.engines import choose
    from gpusparse.search import Search

    docs = random_collection(rng, 60, 80, 6)
    index = Index.build(docs)
    for k, width in ((10, 10), (70, 70)):  # 70 > 60 documents: padded
        s = Search(index, k, batch_size=8, kernel="reference")
        engine = s.engine = _Repeating(choose("reference", index.device))
        # (queries, progress, the batches searched the general way, the repeats asked)
        for n, progress, general, repeated in [
            (5, False, [5], []), (5, False, [], [(5, None)]), (6, False, [6], [(6, None)]), (6, False, [], [(6, None)]),
            (20, False, [8, 8, 4], [(20, None)]), (6, False, [6], []), (6, True, [6], []), (6, False, [], [(6, None)]),
        ]:  # fmt: skip
            queries = random_collection(rng, n, 80, 4)
            engine.general.clear()
            engine.repeats.clear()
            res = s(queries, progress=progress)
            assert (engine.general, engine.repeats) == (general, repeated), (n, engine.general, engine.repeats)
            ref_s, ref_i = reference_topk(canonical_scores(docs, queries), k)
            assert res.ids.shape == (n, width) and res.engine == "repeating"
            np.testing.assert_array_equal(res.ids.numpy(), ref_i)
            np.testing.assert_array_equal(res.scores.numpy(), ref_s)
        # weights whose score bound two reductions cannot prove: the repeat's launch is dropped (its
        # results taken, unused), and the batch goes the general way, where its bound is checked in full
        for weight, refused in ((1e31, False), (3e38, True)):
            queries = random_collection(rng, 6, 80, 4)
            queries.values[:] = weight  # 3e38: some query's bound passes float32's largest
            engine.general.clear()
            engine.repeats.clear()
            engine.dropped = 0
            if refused:
                with pytest.raises(InputError, match="too large"):
                    s(queries)
                assert (engine.general, engine.repeats, engine.dropped) == ([], [(6, None)], 1)
                continue
            res = s(queries)
            assert (engine.general, engine.repeats, engine.dropped) == ([6], [(6, None)], 1)
            ref_s, ref_i = reference_topk(canonical_scores(docs, queries), k)
            np.testing.assert_array_equal(res.ids.numpy(), ref_i)
            np.testing.assert_array_equal(res.scores.numpy(), ref_s)
