"""5-byte sparse postings (gpusparse.layout.packing): exact round trips, the fallback to 6
bytes, and every reader of the packed layout against the unpacked one and the reference."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import Index, SparseCollection
from gpusparse.engines.tiled.emulation import torch_tiled_candidates
from gpusparse.engines.tiled.engine import tiled_search
from gpusparse.engines.tiled.fixed_point import fixed_point, kernel_scale
from gpusparse.engines.tiled.ranking import tiled_exact_scores
from gpusparse.exact import exact_scores
from gpusparse.layout import packing
from gpusparse.layout.resident import tiled_resident
from gpusparse.layout.tiled import build_tiled
from gpusparse.queries import query_batch

from .conftest import require_cuda_kernels
from .reference import dense_scores, random_collection, reference_topk


def _weights(rng, n: int, lo: int, hi: int) -> torch.Tensor:
    """float32 weights with exponent fields in [lo, hi], both ends and extreme mantissas included."""
    e = rng.integers(lo, hi + 1, n)
    e[:4] = [lo, hi, lo, hi]
    m = rng.integers(0, 1 << 23, n)
    m[:4] = [0, (1 << 23) - 1, (1 << 23) - 1, 0]
    return torch.from_numpy(((e << 23) | m).astype(np.int32)).view(torch.float32)


@pytest.mark.parametrize("tile_bits", [1, 5, 9, 12, 13, 14, 16])
def test_round_trip_is_exact_at_the_exponent_edges(rng, tile_bits):
    span = 1 << packing.exp_bits(tile_bits)
    lo = 100 if span < 64 else 1
    w = _weights(rng, 5000, lo, min(254, lo + span - 1))
    assert packing.exponent_base(*map(int, packing.exponent_range(w)), tile_bits) == lo
    off = torch.from_numpy(rng.integers(0, 1 << tile_bits, w.numel()))
    off[:2] = torch.tensor([0, (1 << tile_bits) - 1])
    word, low = packing.pack(off, w, lo, tile_bits)
    assert word.dtype == torch.int32 and low.dtype == torch.uint8
    assert torch.equal(packing.unpack_offsets(word, tile_bits), off)
    back = packing.unpack_weights(word, low, lo, tile_bits)
    assert torch.equal(back.view(torch.int32), w.view(torch.int32))  # the same bits
    # the words order the postings by offset: what rescoring's binary search relies on
    u = word.to(torch.int64) & 0xFFFFFFFF
    probe = int(rng.integers(0, 1 << tile_bits))
    assert torch.equal(u < (probe << packing.word_shift(tile_bits)), off < probe)
    # with fixed-point products the kernel's bias gives w · 2**b exactly
    b = 156 - int(packing.exponent_range(w)[1])  # the largest weight times 2**b just below 2**30
    if lo + b >= 1:  # the builder packs only then
        field = ((u & ((1 << packing.word_shift(tile_bits)) - 1)) << 8) | low.to(torch.int64)
        scaled = (field + packing.kernel_bias(lo, b)).to(torch.int32).view(torch.float32)
        assert torch.equal(scaled.to(torch.float64), w.to(torch.float64) * 2.0**b)


def test_which_weights_are_packed():
    assert packing.exponent_base(113, 128, 13) == 113  # 16 exponents: the calibrated generator's clamp
    assert packing.exponent_base(112, 128, 13) is None  # 17
    assert packing.exponent_base(108, 128, 12) == 108  # splade-tiny's 21: tiles of 4,096
    assert packing.exponent_base(0, 120, 9) is None  # a denormal or zero weight
    assert packing.exponent_base(-1, 120, 9) is None  # a negative weight (sign bit)
    assert packing.exponent_base(120, 255, 9) is None  # infinity or NaN
    assert packing.exponent_base(120, 125, 16) is None and packing.exponent_base(120, 121, 16) == 120
    assert packing.exponent_base(5, 1, 13) == 127  # no weights
    assert packing.exponent_base(113, 128, 13, weight_bits=28) == 113
    assert packing.exponent_base(113, 128, 13, weight_bits=127) is None  # w · 2**b would overflow
    assert packing.exponent_base(113, 128, 13, weight_bits=-113) is None  # ... or become denormal
    with pytest.raises(ValueError, match="normal range"):
        packing.kernel_bias(113, -113)
    w = torch.tensor([0.5, -1.0, 2.0])
    assert int(packing.exponent_range(w)[0]) < 0
    assert int(packing.exponent_range(torch.tensor([0.0, 1.0]))[0]) == 0


def _collection(rng, n_docs: int, n_terms: int, lo: int, hi: int) -> SparseCollection:
    """Random documents whose weights have exponent fields spanning exactly [lo, hi]; terms in
    2% to 30% of the documents."""
    present = rng.random((n_docs, n_terms)) < rng.uniform(0.02, 0.3, n_terms)
    mat = sp.csr_matrix(present, dtype=np.float32)
    mat.data = _weights(rng, mat.nnz, lo, hi).numpy()
    return SparseCollection.from_scipy(mat)


@pytest.mark.parametrize(("tile_bits", "hi", "packed"), [(13, 128, True), (13, 129, False), (12, 129, True)])
@pytest.mark.parametrize("fixed", [False, True], ids=["float", "fixed"])
def test_layouts_pack_where_the_weights_allow_and_search_exactly(rng, tile_bits, hi, packed, fixed):
    """16 exponents pack at 8,192-document tiles, 17 fall back to 6 bytes there and pack at
    4,096: either way the search (rescoring from the layout) returns the reference's results."""
    docs = _collection(rng, 600, 70, 113, hi)
    queries = random_collection(rng, 9, 70, 12, empty_fraction=0.1)
    index = Index.build(docs)
    dense_min = 100 / (1 << tile_bits)  # segments of 100 postings or more
    layout = build_tiled(index, tile_bits, dense_min=dense_min, fixed=fixed, list_positions=False)
    assert layout.packed == packed and layout.n_dense > 0 and layout.n_sparse > 0
    assert layout.offs.dtype == (torch.int32 if packed else torch.int16)
    assert layout.wts.dtype == (torch.uint8 if packed else torch.float32)
    per_posting = (layout.offs.element_size() + layout.wts.element_size()) * layout.n_sparse
    assert per_posting == (5 if packed else 6) * layout.n_sparse
    plain = build_tiled(index, tile_bits, dense_min=dense_min, fixed=fixed, list_positions=False, pack=False)
    assert not plain.packed
    everything = torch.arange(layout.n_sparse)
    assert torch.equal(layout.offsets_at(everything), plain.offsets_at(everything))
    assert torch.equal(layout.weights_at(everything), plain.wts)
    view = tiled_resident(index, "cpu")
    batch = query_batch(queries, view.device)
    scores = dense_scores(docs, queries)
    for k in (1, 10, 600):
        s, i = tiled_search(view, batch, k, tile_bits=tile_bits, dense_min=dense_min, acc="u32", fixed=fixed,
                            emulated=True).resolved()  # fmt: skip
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.numpy(), ref_i)
        np.testing.assert_array_equal(s.numpy(), ref_s)
    (built,) = view.derived.layouts.values()
    assert built.packed == packed


def test_rescoring_from_a_packed_layout_is_canonical(rng):
    docs = random_collection(rng, 500, 80, 25, empty_fraction=0.05)
    queries = random_collection(rng, 7, 80, 50)
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    rows = torch.from_numpy(rng.integers(0, 7, 2000))
    cand = torch.from_numpy(rng.integers(0, 500, 2000))
    want = exact_scores(index, batch, rows, cand)
    for tile_bits in (4, 7, 13):
        layout = build_tiled(index, tile_bits, dense_min=0.2, list_positions=False)
        assert layout.packed
        got = tiled_exact_scores(layout, batch, rows, cand, max_cells=1 << 11)
        np.testing.assert_array_equal(got.numpy().view(np.int32), want.numpy().view(np.int32))


def _all_candidates(launch, layout, batch, fp, acc: str):
    """Every (document, fixed-point sum) of every query, from one launch over all tiles without
    the blocks' own selection (theta stays 0: every matching document is emitted), sorted per row."""
    b, dev = batch.padded_terms.shape[0], layout.seg.device
    cap = layout.n_docs
    theta = torch.zeros(b, dtype=torch.int64, device=dev)
    count = torch.zeros(b, dtype=torch.int32, device=dev)
    cand_doc = torch.full((b, cap), -1, dtype=torch.int32, device=dev)  # poisoned: every slot is written or -1
    cand_val = torch.full((b, cap), -7, dtype=torch.int64, device=dev)
    launch(layout, batch.padded_terms.to(torch.int32).contiguous(), batch.padded_weights.contiguous(),
           kernel_scale(layout, fp), fp.delta, k=1, tiles=(0, layout.n_tiles), select=False,
           acc=acc, int_weights=False, q_shift=fp.shift, theta=theta, cand_count=count, cand_doc=cand_doc,
           cand_val=cand_val)  # fmt: skip
    out = []
    for r in range(b):
        n = int(count[r])
        assert n <= cap
        d, v = cand_doc[r, :n].cpu(), cand_val[r, :n].cpu()
        order = torch.argsort(d)
        out.append((d[order], v[order]))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile_bits", [5, 12, 13])
@pytest.mark.parametrize("fixed", [False, True], ids=["float", "fixed"])
def test_cuda_kernels_read_the_packed_layout_exactly(rng, tile_bits, fixed):
    """The candidate kernel's sums over the packed layout equal its sums over the unpacked one
    and (fixed point) the PyTorch contract's, document by document (float products: within
    the row's margin, as the contract allows); canonical rescoring from the packed
    layout (``canonical_tiled``) gives the reference's bits."""
    from gpusparse.kernels import rescore
    from gpusparse.kernels.tile_candidates import tiled_candidates

    require_cuda_kernels()
    docs = _collection(rng, 3000, 300, 113, 128)  # 16 exponents: packed at every tile size here
    queries = random_collection(rng, 12, 300, 40, empty_fraction=0.1)
    index = Index.build(docs, device="cuda")
    batch = query_batch(queries, index.device)
    acc = "u32"
    layouts = [build_tiled(index, tile_bits, dense_min=0.1, fixed=fixed, pack=p) for p in (True, False)]
    assert layouts[0].packed and not layouts[1].packed and layouts[0].n_dense > 0
    fp = fixed_point(index, batch, acc, layouts[0].weight_bits)
    packed = _all_candidates(tiled_candidates, layouts[0], batch, fp, acc)
    plain = _all_candidates(tiled_candidates, layouts[1], batch, fp, acc)
    emulated = _all_candidates(torch_tiled_candidates, layouts[0], batch, fp, acc)
    for r, ((d0, v0), (d1, v1), (d2, v2)) in enumerate(zip(packed, plain, emulated, strict=True)):
        assert torch.equal(d0, d1) and torch.equal(v0, v1), r
        assert torch.equal(d0, d2), r
        if fixed:  # integer products: the same integers
            assert torch.equal(v0, v2), r
        else:  # float products rounded one by one, in another order: within the row's margin
            assert v0.numel() == 0 or int((v0 - v2).abs().max()) <= int(fp.delta[r]), r
    # rescoring from the packed layout: every pair, with values that leave every score uncertain
    cand = torch.from_numpy(rng.integers(-1, 3000, (12, 400))).cuda()
    vals = torch.ones((12, 400), dtype=torch.int64, device="cuda")
    wide = fixed_point(index, batch, acc)
    keys, by_lane = (
        rescore.candidate_keys_cuda(None, None, None, None, batch.padded_terms.contiguous(),
                                    batch.padded_weights.contiguous(), cand.to(torch.int32), vals,
                                    wide.delta + (1 << 40), wide.scale, tiled=layouts[0], lanes=lanes)
        for lanes in (False, True)
    )  # fmt: skip
    assert torch.equal(keys, by_lane)  # a warp a slot, or a lane a slot (all rescored by the warp together)
    scores = torch.where(keys != 0, (keys >> 31).to(torch.int32), 0).view(torch.float32)
    rows = torch.arange(12, device="cuda")[:, None].expand_as(cand)
    present = cand >= 0
    want = exact_scores(index, batch, rows[present], cand[present])
    assert torch.equal(scores[present].view(torch.int32), want.view(torch.int32))
    assert bool((keys[~present] == 0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("tile_bits", "list_positions"), [(5, True), (13, False), (14, False)])
def test_a_layout_built_on_the_gpu_equals_the_cpu_build(rng, tile_bits, list_positions):
    """Every array of the layout, packed (5, 13) or not (14: 9 exponents, 8 allowed), built on the
    GPU from device or host slabs, equals the CPU build."""
    docs = _collection(rng, 20000, 200, 120, 128)
    index = Index.build(docs)
    want = build_tiled(index, tile_bits, dense_min=0.1, fixed=True, list_positions=list_positions, chunk=4097)
    assert want.packed == (tile_bits <= 13)
    on_gpu = Index.build(docs, device="cuda")
    for source, device in ((on_gpu, None), (index, "cuda")):  # device slabs, then host slabs copied over
        got = build_tiled(source, tile_bits, dense_min=0.1, fixed=True, list_positions=list_positions, chunk=4097,
                          device=device)  # fmt: skip
        assert got.exp_base == want.exp_base and got.weight_bits == want.weight_bits
        for x, y in zip(got.arrays(), want.arrays(), strict=True):
            assert x.is_cuda and torch.equal(x.cpu(), y)
