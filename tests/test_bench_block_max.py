"""bench/block_max.py (issue 23): the tile bounds are true upper bounds, pruning by them is
safe, the running threshold is the k-th best so far, and the reorderings are permutations."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

block_max = pytest.importorskip("block_max")  # bench/ is on pytest's pythonpath
from block_max_order import _left_size, bp_order, top_term_order  # noqa: E402


def _random_docs(rng: np.random.Generator, n: int, v: int, density: float) -> sp.csr_matrix:
    m = sp.random(n, v, density=density, format="csr", random_state=rng, dtype=np.float64)
    m.data = rng.uniform(1e-4, 3.5, size=m.nnz).astype(np.float32)
    return m.astype(np.float32).tocsr()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bits", [0, 2, 4])
def test_the_tile_bound_is_at_least_every_score_in_its_tile(seed, bits):
    rng = np.random.default_rng(seed)
    docs = _random_docs(rng, 203, 40, 0.15)  # 203: the last tile is partial
    queries = _random_docs(rng, 17, 40, 0.3)
    perm = rng.permutation(docs.shape[0])
    bmax, count = block_max.tile_maxima(docs, perm, bits)
    ub = block_max.tile_bounds(queries, bmax)
    scores = (queries.astype(np.float64) @ docs.astype(np.float64).T).toarray()  # [q, N]
    dense = docs.toarray().astype(np.float64)
    tile_of = np.empty(docs.shape[0], dtype=np.int64)
    tile_of[perm] = np.arange(docs.shape[0]) >> bits
    assert ub.shape == (17, -(-203 // (1 << bits)))
    for t in range(ub.shape[1]):
        members = np.flatnonzero(tile_of == t)
        np.testing.assert_array_equal(bmax[t].toarray().ravel(), dense[members].max(axis=0))
        np.testing.assert_array_equal(count[t].toarray().ravel(), (dense[members] > 0).sum(axis=0))
        assert np.all(ub[:, t] >= scores[:, members].max(axis=1) * (1 - 1e-12))
        if len(members) == 1:  # a one-document tile: the bound is its score
            np.testing.assert_allclose(ub[:, t], scores[:, members[0]], rtol=1e-12)
    work = block_max.tile_work(queries, count)
    for q in range(3):
        terms = queries[q].indices
        for t in range(ub.shape[1]):
            assert work[q, t] == (dense[tile_of == t][:, terms] > 0).sum()


@pytest.mark.parametrize("k", [1, 5, 40])
def test_skipping_the_tiles_below_theta_keeps_the_exact_top_k(k):
    rng = np.random.default_rng(7)
    # Clustered documents (disjoint term blocks) so that some tiles do prune.
    blocks = [_random_docs(rng, 64, 10, 0.5) for _ in range(4)]
    docs = sp.block_diag(blocks, format="csr").astype(np.float32)
    queries = sp.hstack([_random_docs(rng, 6, 10, 0.5), sp.csr_matrix((6, 30))], format="csr")
    bmax, _ = block_max.tile_maxima(docs, np.arange(256), 6)
    ub = block_max.tile_bounds(queries, bmax)
    scores = (queries.astype(np.float64) @ docs.astype(np.float64).T).toarray()
    pruned_any = False
    for q in range(6):
        theta = block_max.kth_score(scores[q], k)
        assert theta == np.sort(scores[q])[::-1][k - 1]
        keep = np.repeat(ub[q] >= theta, 64)
        pruned_any |= not keep.all()
        full = np.lexsort((np.arange(256), -scores[q]))[:k]
        kept = np.flatnonzero(keep)
        part = kept[np.lexsort((kept, -scores[q, kept]))][:k]
        np.testing.assert_array_equal(part, full)
    assert pruned_any


def test_running_thresholds_are_the_kth_best_of_the_tiles_visited():
    rng = np.random.default_rng(3)
    n_tiles, tile_of = 9, rng.integers(0, 9, size=500)
    scores = np.where(rng.random(500) < 0.7, rng.random(500), 0.0)
    tops = block_max.per_tile_top(scores, tile_of, n_tiles, 20)
    for t in range(n_tiles):
        expect = np.sort(scores[(tile_of == t) & (scores > 0)])[::-1][:20]
        np.testing.assert_array_equal(tops[t], expect)
    visit = rng.permutation(n_tiles)
    th = block_max.running_thresholds(tops, visit, (1, 7, 20))
    for j in range(n_tiles):
        seen = np.sort(scores[np.isin(tile_of, visit[:j]) & (scores > 0)])[::-1]
        for i, k in enumerate((1, 7, 20)):
            assert th[j, i] == (seen[k - 1] if len(seen) >= k else -np.inf)


def test_measure_shares_are_ordered_final_over_running_and_query_over_group():
    rng = np.random.default_rng(5)
    blocks = [_random_docs(rng, 128, 12, 0.4) for _ in range(4)]
    common = _random_docs(rng, 512, 4, 0.5)  # terms every tile holds, with small weights
    common.data *= 0.01
    docs = sp.hstack([sp.block_diag(blocks), common], format="csr").astype(np.float32)
    picked = docs[rng.choice(512, size=16, replace=False)][:, :48]
    # Every query also has the common terms: every tile is touched.
    queries = sp.hstack([picked, np.full((16, 4), 0.01, np.float32)], format="csr")
    orders = {"clustered": np.arange(512), "random": rng.permutation(512)}
    recs, theta = block_max.measure(docs, queries, orders, (5, 6), ks=(1, 10), groups=(1, 4, 16), chunk=5)
    blocks = block_max.measure_blocks(queries, docs, orders, (5, 6), theta, ks=(1, 10), groups=(1, 4, 16))
    for r, b in zip(recs, blocks, strict=True):  # the final-θ shares agree, by tiles or by blocks
        assert (r["order"], r["tile_bits"], r["k"]) == (b["order"], b["block_bits"], b["k"])
        assert all(r["groups"][g]["final"] == b["groups"][g]["final"] for g in ("1", "4", "16"))
    assert len(recs) == 2 * 2 * 2
    for r in recs:
        g = r["groups"]
        for size in ("1", "4", "16"):
            assert g[size]["running"]["tiles"] <= g[size]["final"]["tiles"]
            assert g[size]["running"]["postings"] <= g[size]["final"]["postings"]
        # A group skips a tile only when every member prunes it (groups cover every query here).
        assert g["1"]["final"]["postings"] >= g["4"]["final"]["postings"] >= g["16"]["final"]["postings"]
    clustered = [r for r in recs if r["order"] == "clustered" and r["k"] == 10]
    assert all(r["tiles_untouched"] == 0 for r in recs)
    # A query's own cluster is one of four: the other three quarters of the tiles prune.
    assert all(r["groups"]["1"]["final"]["tiles"] >= 0.7 for r in clustered)
    shuffled = [r for r in recs if r["order"] == "random" and r["k"] == 10]
    for c, r in zip(clustered, shuffled, strict=True):
        assert c["groups"]["1"]["final"]["tiles"] > r["groups"]["1"]["final"]["tiles"] + 0.3


@pytest.mark.parametrize("n", [1, 2, 3, 100, 257, 1000])
def test_the_reorderings_are_permutations(n):
    rng = np.random.default_rng(n)
    docs = _random_docs(rng, n, 50, 0.1)
    docs.data[docs.indptr[0] : docs.indptr[1]] = 0  # an empty document
    docs.eliminate_zeros()
    for perm in (
        bp_order(docs.indptr, docs.indices, 50, leaf=8, iters=5),
        top_term_order(docs.indptr, docs.indices, docs.data),
    ):
        assert perm.shape == (n,)
        np.testing.assert_array_equal(np.sort(perm), np.arange(n))


def test_graph_bisection_separates_planted_clusters():
    rng = np.random.default_rng(11)
    blocks = [_random_docs(rng, 64, 25, 0.3) for _ in range(4)]
    docs = sp.block_diag(blocks, format="csr").astype(np.float32)
    shuffle = rng.permutation(256)
    mixed = docs[shuffle].tocsr()
    perm = bp_order(mixed.indptr, mixed.indices, 100, leaf=64, iters=20)
    cluster = shuffle[perm] // 64
    for leaf in range(4):
        assert len(set(cluster[leaf * 64 : (leaf + 1) * 64].tolist())) == 1


def test_halves_are_cut_at_powers_of_two():
    assert [_left_size(n) for n in (2, 3, 4, 5, 8, 9, 117_147)] == [1, 2, 2, 4, 4, 8, 65_536]


def test_the_table_has_a_row_per_record():
    rng = np.random.default_rng(2)
    docs = _random_docs(rng, 300, 30, 0.2)
    queries = _random_docs(rng, 9, 30, 0.3)
    orders = {"original": np.arange(300)}
    recs, theta = block_max.measure(docs, queries, orders, (6,), ks=(1, 10))
    blocks = block_max.measure_blocks(queries, docs, orders, (3,), theta, ks=(1, 10))
    text = block_max.table([{"collection": "c", "query_set": "q", "records": recs, "blocks": blocks}])
    assert text.count("| c | q | original | 2^6 |") == 2 and text.count("| c | q | original | 2^3 |") == 2
