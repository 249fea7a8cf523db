"""Issue 23: the tiled layout in a document order of its own (gpusparse.layout.order).

Grouping documents by cluster changes which tiles hold them, never a result: the search in
any order must return the reference's scores and ids, ties broken by document number."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import Index, SparseCollection
from gpusparse.config import override_config
from gpusparse.engines.reference import reference_search
from gpusparse.engines.tiled.engine import layout_for_search, tiled_search
from gpusparse.engines.tiled.layout_fallback import layout_reference_search
from gpusparse.engines.tiled.ranking import tiled_exact_scores
from gpusparse.exact import exact_scores
from gpusparse.layout import order as order_mod
from gpusparse.layout.forward import forward_index
from gpusparse.layout.order import _tile_order, cluster_order, order_clusters, permute_csr
from gpusparse.layout.resident import tiled_resident
from gpusparse.layout.statistics import max_scores_host
from gpusparse.layout.tiled import build_tiled
from gpusparse.queries import prepare_queries, query_batch

from .conftest import require_cuda_kernels
from .reference import dense_scores, random_collection, reference_topk


def topical_collection(
    rng, n: int, topics: int, terms_per_topic: int, *, duplicates: int = 0, nnz: tuple[int, int] = (3, 12)
) -> tuple:
    """Documents drawing ``nnz`` terms from one of ``topics`` disjoint term ranges, in random
    order; ``duplicates`` documents are copies of others (equal scores for every query).
    Returns ``(collection, topic of each document)``."""
    topic = rng.integers(0, topics, n)
    rows, cols, vals = [], [], []
    for i in range(n):
        m = int(rng.integers(*nnz))
        terms = topic[i] * terms_per_topic + rng.choice(terms_per_topic, m, replace=False)
        rows += [i] * m
        cols += terms.tolist()
        vals += rng.uniform(0.05, 3.0, m).tolist()
    mat = sp.csr_matrix((np.asarray(vals, np.float32), (rows, cols)), shape=(n, topics * terms_per_topic))
    if duplicates:
        src = rng.integers(0, n, duplicates)
        dst = rng.choice(n, duplicates, replace=False)
        mat = sp.lil_matrix(mat)
        for s, d in zip(src, dst, strict=True):
            mat[d] = mat[s]
            topic[d] = topic[s]
        mat = sp.csr_matrix(mat)
    return SparseCollection.from_scipy(mat), topic


def _csr(docs: SparseCollection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = docs.to_scipy()
    m.sort_indices()
    return (
        torch.from_numpy(m.indptr.astype(np.int64)),
        torch.from_numpy(m.indices.astype(np.int32)),
        torch.from_numpy(m.data.astype(np.float32)),
    )


def test_cluster_order_groups_topics_and_samples_them_first(rng):
    # topics far apart (a document holds over half its topic's terms): k-means separates them
    docs, topic = topical_collection(rng, 4096, 4, 16, nnz=(9, 14))
    bits = 6  # tiles of 64: 64 tiles, the first 16 a sample
    perm = cluster_order(_csr(docs), docs.to_scipy().shape[1], clusters=4, rounds=3, seed=int(rng.integers(1 << 30)),
                         tile_bits=bits)  # fmt: skip
    assert sorted(perm.tolist()) == list(range(4096))  # a permutation
    tiles = topic[perm.numpy()].reshape(-1, 64)
    sample = min(order_mod.SAMPLE_TILES, 64 // 4)
    for t in tiles[:sample]:  # an even sample: every topic in every sample tile
        assert set(t.tolist()) == {0, 1, 2, 3}
    # the rest: tiles of one topic each but where a topic's documents end, interleaved
    rest = tiles[sample:]
    pure = np.array([len(set(t.tolist())) == 1 for t in rest])
    assert pure.mean() > 0.9
    firsts = rest[:, 0]
    assert len(set(firsts[:4].tolist())) >= 3  # consecutive tiles come from different topics


def test_tile_order_puts_a_sample_first_then_spreads_each_cluster():
    labels = torch.tensor([0] * 16 + [1] * 8 + [2] * 8 + [2] * 3)  # sorted by cluster, 35 documents
    perm = torch.arange(35) * 10
    old = order_mod.SAMPLE_TILES
    try:
        order_mod.SAMPLE_TILES = 2
        out = _tile_order(perm, labels, 2).tolist()
    finally:
        order_mod.SAMPLE_TILES = old
    # 8 full tiles of 4: 2 sample tiles take every 35/8-th document of the order, alternately
    assert out[:8] == [0, 80, 170, 260, 40, 130, 210, 300]
    # the other 27: tiles (by first document's cluster) c0 ×3, c1 ×2, c2 ×1 and a partial one,
    # sorted by (rank + 0.5) / tiles of the cluster: c0 1/6, c1 1/4, c0 1/2, c2 1/2, c1 3/4, c0 5/6
    assert out[8:] == [10, 20, 30, 50, 160, 180, 190, 200, 60, 70, 90, 100, 270, 280, 290, 310,
                       220, 230, 240, 250, 110, 120, 140, 150, 320, 330, 340]  # fmt: skip


def test_every_first_wave_is_sample_tiles():
    """The order's sample tiles cover the engine's largest first wave (a wave partly of one
    cluster's tiles set too low a threshold, and the next wave overflowed, measured)."""
    from gpusparse.engines.tiled.waves import wave_plan

    firsts = [wave_plan(100_000, b, 1000, sm)[0][1] for b in range(1, 2049) for sm in (1, 16, 132, 264)]
    assert max(firsts) <= order_mod.SAMPLE_TILES


def test_permute_csr_moves_whole_rows(rng):
    docs = random_collection(rng, 50, 30, 6, empty_fraction=0.1)
    csr = _csr(docs)
    perm = torch.from_numpy(rng.permutation(50))
    ptr, terms, weights = permute_csr(csr, perm)
    for i, d in enumerate(perm.tolist()):
        a, b = int(csr[0][d]), int(csr[0][d + 1])
        assert torch.equal(terms[ptr[i] : ptr[i + 1]], csr[1][a:b])
        assert torch.equal(weights[ptr[i] : ptr[i + 1]], csr[2][a:b])


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "uint8"])
@pytest.mark.parametrize(("tile_bits", "dense_min"), [(2, None), (4, 0.2), (6, 0.05)])
def test_layout_in_an_order_is_the_layout_of_the_reordered_collection(rng, tile_bits, dense_min, quantized):
    docs = random_collection(rng, 300, 40, 9, empty_fraction=0.1, quantized=quantized)
    index = Index.build(docs, quantize=8 if quantized else None)
    perm = torch.from_numpy(rng.permutation(300))
    tl = build_tiled(index, tile_bits, dense_min=dense_min, chunk=37, order=perm)  # several slabs
    doc_of, pos_of = tl.doc_of.to(torch.int64), tl.pos_of.to(torch.int64)
    assert torch.equal(doc_of[pos_of], torch.arange(300)) and tl.list_pos is None
    # the tiles hold the documents the order put there, ascending inside each tile
    tile = 1 << tile_bits
    for t in range(0, 300, tile):
        assert doc_of[t : t + tile].tolist() == sorted(perm[t : t + tile].tolist())
    # the same arrays as the layout of the collection in that order
    mat = docs.to_scipy()[doc_of.numpy()]
    reordered = Index.build(SparseCollection.from_scipy(sp.csr_matrix(mat)), quantize=8 if quantized else None)
    want = build_tiled(reordered, tile_bits, dense_min=dense_min, list_positions=False)
    for x, y in zip(tl.arrays()[:7], want.arrays()[:7], strict=True):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="permutation"):
        build_tiled(index, tile_bits, order=torch.zeros(300, dtype=torch.int64))


@pytest.mark.parametrize("weights", ["float32", "levels", "index8"])
@pytest.mark.parametrize(("acc", "fixed"), [("u32", True), ("u32", False), ("carry", False)])
def test_search_in_cluster_order_is_exact_with_ties_across_tiles(rng, acc, fixed, weights):
    """Copies of documents score alike: wherever the order puts them, ties break by document.
    ``index8``: an index of 8-bit levels with prepared queries (integer products, margin 0),
    against the float64 reference engine on the same index."""
    docs, _ = topical_collection(rng, 1500, 5, 30, duplicates=300)
    queries, _ = topical_collection(rng, 12, 5, 30)
    if weights == "levels":
        docs = SparseCollection.from_scipy(_levels(docs.to_scipy()))
        queries = SparseCollection.from_scipy(_levels(queries.to_scipy()))
    index = Index.build(docs, quantize=8 if weights == "index8" else None)
    if weights == "index8":
        queries = _prepared(queries, index)
    batch = query_batch(queries, index.device)
    scores = dense_scores(docs, queries)
    with override_config(doc_order="cluster", order_clusters=5):
        tl = layout_for_search(index, 5, 0.1, acc, fixed)
        assert tl.doc_of is not None and not torch.equal(tl.doc_of, torch.arange(1500, dtype=torch.int32))
        for k in (1, 7, 10, 100, 1500):
            s, i = tiled_search(index, batch, k, tile_bits=5, dense_min=0.1, acc=acc, fixed=fixed).resolved()
            if weights == "index8":
                ref_s, ref_i = (
                    x.numpy() for x in reference_search(index, batch, k, doc_chunk=512, max_postings=1 << 16)
                )
            else:
                ref_s, ref_i = reference_topk(scores, k)
            np.testing.assert_array_equal(i.numpy(), ref_i)
            np.testing.assert_array_equal(s.numpy(), ref_s)


def _levels(m: sp.csr_matrix) -> sp.csr_matrix:
    m = m.copy()
    m.data = np.ceil(m.data * 8) / 8  # exact levels of 1/8
    return m


def _prepared(queries: SparseCollection, index: Index) -> SparseCollection:
    """8-bit query levels, as Index.search prepares them for an index of levels."""
    return prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))


def test_rescoring_and_the_layout_fallback_find_documents_by_position(rng):
    docs = random_collection(rng, 400, 60, 20, empty_fraction=0.05)
    queries = random_collection(rng, 9, 60, 25)
    index = Index.build(docs)
    perm = cluster_order(forward_index(index), 60, clusters=3, tile_bits=4)
    tl = build_tiled(index, 4, dense_min=0.2, order=perm, chunk=101)
    batch = query_batch(queries, index.device)
    rows, cand = torch.from_numpy(rng.integers(0, 9, 2000)), torch.from_numpy(rng.integers(0, 400, 2000))
    got = tiled_exact_scores(tl, batch, rows, cand, max_cells=1 << 9)
    np.testing.assert_array_equal(
        got.numpy().view(np.int32), exact_scores(index, batch, rows, cand).numpy().view(np.int32)
    )
    s, i = layout_reference_search(tl, batch, 50, max_postings=300)
    ref_s, ref_i = reference_topk(dense_scores(docs, queries), 50)
    np.testing.assert_array_equal(i.numpy(), ref_i)
    np.testing.assert_array_equal(s.numpy(), ref_s)


def test_auto_orders_large_layouts_that_keep_the_forward_copy():
    assert order_clusters("auto", 16, 64 << 13, 13, forward=True) == 16
    assert order_clusters("auto", 16, (64 << 13) - 1, 13, forward=True) == 0  # fewer tiles
    assert order_clusters("auto", 16, 64 << 13, 13, forward=False) == 0  # would need a copy
    assert order_clusters("cluster", 16, 10, 13, forward=False) == 16
    assert order_clusters("none", 16, 64 << 13, 13, forward=True) == 0
    with pytest.raises(ValueError, match="doc_order"), override_config(doc_order="random"):
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "uint8"])
def test_cuda_search_in_cluster_order_is_exact(rng, quantized):
    """Batches that replay a graph (1, 3), that run the device path (40) and the general path,
    in cluster order, against the reference; the kernel writes documents, not positions."""
    require_cuda_kernels()
    docs, _ = topical_collection(rng, 6000, 6, 60, duplicates=800)
    queries, _ = topical_collection(rng, 40, 6, 60)
    index = Index.build(docs, device="cuda", quantize=8 if quantized else None)
    if quantized:
        queries = _prepared(queries, index)
    with override_config(doc_order="cluster", order_clusters=6):
        tl = layout_for_search(index, 7, 0.1)
        assert tl.doc_of is not None and tl.forward is not None and tl.list_pos is None
        for rows in (slice(0, 1), slice(0, 3), slice(0, 40)):
            sub = SparseCollection.from_scipy(queries.to_scipy()[rows])
            batch = query_batch(sub, index.device)
            for k in (1, 10, 1000):
                want_s, want_i = reference_search(index, batch, k, doc_chunk=1 << 12, max_postings=1 << 20)
                for general in (False, True):
                    s, i = tiled_search(index, batch, k, tile_bits=7, dense_min=0.1, general=general).resolved()
                    assert torch.equal(i, want_i) and torch.equal(s, want_s), (rows, k, general)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rescoring_from_a_layout_in_an_order_of_its_own(rng):
    """A view whose lists stay on the host rescoring from a layout in cluster order (the
    candidate keys' kernel maps each document to its position)."""
    require_cuda_kernels()
    docs = random_collection(rng, 3000, 200, 25, empty_fraction=0.02)
    queries = random_collection(rng, 30, 200, 30)
    index = Index.build(docs)
    view = tiled_resident(index, "cuda")
    perm = cluster_order(forward_index(index), 200, clusters=4, tile_bits=6)
    layout = build_tiled(view, 6, dense_min=0.1, list_positions=False, order=perm.cuda())
    view.derived.layouts[(6, 0.1, False)] = layout  # the layout the search below asks for
    batch = query_batch(queries, view.device)
    scores = dense_scores(docs, queries)
    for k in (1, 10, 1000):
        s, i = tiled_search(view, batch, k, tile_bits=6, dense_min=0.1, acc="carry", fixed=False).resolved()
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s)
