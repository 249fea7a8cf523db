"""The tiled engine: layout, fixed-point margins, and exactness of its search."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpusparse import Index, SparseCollection
from gpusparse.search import query_batch
from gpusparse.tiled import build_tiled, fixed_point, tiled_search

from .reference import dense_scores, random_collection, reference_topk

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def cuda_kernel_available() -> bool:
    from gpusparse.kernels import tiled

    return tiled.available()


@pytest.mark.parametrize("tile_bits", [1, 3, 6, 14])
def test_layout(tile_bits):
    rng = np.random.default_rng()
    docs = random_collection(rng, 300, 40, 8, empty_fraction=0.1)
    index = Index.build(docs)
    tl = build_tiled(index, tile_bits, chunk=97)  # small chunks: several build steps
    dense = docs.to_scipy().toarray()
    tile = 1 << tile_bits
    seg = tl.seg.numpy()
    assert seg[0] == 0 and seg[-1] == tl.offs.numel() == int(index.lengths.sum())
    assert (np.diff(seg) >= 0).all()
    offs = tl.offs.numpy().astype(np.int64) & 0xFFFF
    for t in range(tl.n_tiles):
        for term in range(tl.n_terms):
            a, b = seg[t * tl.n_terms + term], seg[t * tl.n_terms + term + 1]
            d = t * tile + offs[a:b]
            expected = np.nonzero(dense[t * tile : (t + 1) * tile, term])[0] + t * tile
            np.testing.assert_array_equal(d, expected)
            np.testing.assert_array_equal(tl.wts.numpy()[a:b], dense[d, term])


def test_fixed_point_margin_bounds_the_error():
    """|F − scale·S| ≤ delta/2 for the rounded integer sums F of every document."""
    rng = np.random.default_rng()
    docs = random_collection(rng, 400, 50, 12)
    queries = random_collection(rng, 6, 50, 9)
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    fp = fixed_point(index, batch)
    exact = dense_scores(docs, queries)
    dense_d = docs.to_scipy().toarray().astype(np.float64)
    dense_q = queries.to_scipy().toarray().astype(np.float64)
    for q in range(len(queries)):
        scale = float(fp.scale[q])
        prods = np.round(dense_q[q][None, :] * scale * dense_d)  # what the kernel adds
        f = prods.sum(1)
        assert (np.abs(f - exact[q] * scale) <= float(fp.delta[q]) / 2).all()
        assert f.max() < 2.0**62


@pytest.mark.parametrize("emulated", [True, False], ids=["pytorch", "cuda"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantized", [True, False], ids=["ties", "continuous"])
@pytest.mark.parametrize("tile_bits", [2, 5, 9, 14])
def test_tiled_search_is_exact(tile_bits, quantized, device, emulated):
    if not emulated and (device != "cuda" or not cuda_kernel_available()):
        pytest.skip("the CUDA kernel needs a GPU and CuPy")
    rng = np.random.default_rng()
    docs = random_collection(rng, 900, 120, 14, quantized=quantized, empty_fraction=0.05)
    queries = random_collection(rng, 11, 120, 9, quantized=quantized, empty_fraction=0.1)
    index = Index.build(docs, device=device)
    batch = query_batch(queries, index.device)
    scores = dense_scores(docs, queries)
    for k in (1, 3, 10, 100, 900, 1000):
        s, i = tiled_search(index, batch, k, tile_bits=tile_bits, emulated=emulated)
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s)


def test_tiled_kernel_name_in_search():
    docs = SparseCollection.from_dicts([{"capital": 1.0}, {"capital": 1.0, "paris": 1e-9}, {"paris": 2.0}])
    res = Index.build(docs).search([{"capital": 1.0, "paris": 1.0}], k=3, kernel="tiled")
    assert res.ids.tolist() == [[2, 0, 1]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_at_scale_and_with_candidate_overflow(monkeypatch):
    if not cuda_kernel_available():
        pytest.skip("needs CuPy")
    import gpusparse.tiled as tiled_mod

    rng = np.random.default_rng()
    docs = random_collection(rng, 60_000, 3000, 40)
    queries = random_collection(rng, 48, 3000, 20, empty_fraction=0.05)
    index = Index.build(docs, device="cuda")
    ref = index.search(queries, 1000, kernel="reference")
    for tile_bits in (12, 13, 14):
        batch = query_batch(queries, index.device)
        s, i = tiled_search(index, batch, 1000, tile_bits=tile_bits)
        assert torch.equal(i.cpu(), ref.ids) and torch.equal(s.cpu(), ref.scores)
    monkeypatch.setattr(tiled_mod, "initial_capacity", lambda k: 8)  # forces the rerun path
    s, i = tiled_search(index, query_batch(queries, index.device), 1000)
    assert torch.equal(i.cpu(), ref.ids) and torch.equal(s.cpu(), ref.scores)
