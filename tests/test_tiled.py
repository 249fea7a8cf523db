"""The tiled engine: layout, fixed-point margins, and exactness of its search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import Index, SparseCollection
from gpusparse.config import override_config
from gpusparse.engines.tiled import device as device_mod
from gpusparse.engines.tiled import waves
from gpusparse.engines.tiled.engine import layout_for_search, tiled_search
from gpusparse.engines.tiled.fixed_point import choose_acc, fixed_point
from gpusparse.engines.tiled.ranking import rank_candidates
from gpusparse.kernels.tile_candidates import ACC_TOP
from gpusparse.layout.tiled import build_tiled, tiled_layout
from gpusparse.queries import query_batch

from .conftest import require_cuda_kernels
from .reference import dense_scores, random_collection, reference_topk

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dense_min", [None, 0.3, 0.01])
@pytest.mark.parametrize("tile_bits", [1, 3, 6, 14])
def test_layout(rng, tile_bits, dense_min):
    docs = random_collection(rng, 300, 40, 8, empty_fraction=0.1)
    index = Index.build(docs)
    tl = build_tiled(index, tile_bits, dense_min=dense_min, chunk=97)  # small chunks: several build steps
    dense = docs.to_scipy().toarray()
    tile = 1 << tile_bits
    seg = tl.segment_starts().numpy()
    dense_id = tl.dense_rows(torch.arange(tl.n_tiles * tl.n_terms)).numpy()
    rows = tl.dense
    n_dense_postings = int((rows != 0).sum())
    assert seg[0] == 0 and seg[-1] == tl.offs.numel() == int(index.lengths.sum()) - n_dense_postings
    assert (np.diff(seg) >= 0).all()
    assert tl.packed == (tile_bits <= 13)  # weights in (0.01, 6]: 10 exponents
    if dense_min is None:
        assert (dense_id == -1).all() and tl.n_dense == 0
    everything = torch.arange(tl.n_sparse)
    offs = tl.offsets_at(everything).numpy()
    weights = tl.weights_at(everything).numpy()
    list_pos = tl.list_pos.numpy()
    for t in range(tl.n_tiles):
        for term in range(tl.n_terms):
            a, b = seg[t * tl.n_terms + term], seg[t * tl.n_terms + term + 1]
            expected = np.nonzero(dense[t * tile : (t + 1) * tile, term])[0] + t * tile
            assert list_pos[t * tl.n_terms + term] == np.count_nonzero(dense[: t * tile, term])
            did = dense_id[t * tl.n_terms + term]
            if did >= 0:
                assert a == b and expected.size >= max(1, int(dense_min * tile))
                row = rows[did].numpy()
                np.testing.assert_array_equal(np.nonzero(row)[0] + t * tile, expected)
                np.testing.assert_array_equal(row[expected - t * tile], dense[expected, term])
                continue
            assert dense_min is None or expected.size < max(1, int(dense_min * tile))
            d = t * tile + offs[a:b]
            np.testing.assert_array_equal(d, expected)
            np.testing.assert_array_equal(weights[a:b], dense[d, term])
    # without list positions the shares' ranks are carried from slab to slab: the same layout
    other = build_tiled(index, tile_bits, dense_min=dense_min, chunk=13, list_positions=False)
    for x, y in zip(tl.arrays()[:7], other.arrays(), strict=False):
        assert torch.equal(x, y)


@pytest.mark.parametrize("weights", ["unit", "tiny", "huge"])
@pytest.mark.parametrize("acc", ["carry", "u32", "u32-fixed"])
def test_fixed_point_margin_bounds_the_error(rng, acc, weights):
    """|F − scale·S| ≤ delta/2 for the integer sums F of every document, within the accumulator.

    F as the kernel forms it: each product rounded to the unit, or with fixed-point weights
    ``(round(w_q · mult) · round(w_d · 2**b)) >> shift`` (written here independently).
    """
    docs = random_collection(rng, 400, 50, 12)
    queries = random_collection(rng, 6, 50, 9)
    factor = {"unit": 1.0, "tiny": 2.0**-20 * 1.3, "huge": 2.0**20 * 1.7}[weights]
    docs.values *= np.float32(factor)
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    fixed = acc == "u32-fixed"
    bits = 30 - int(np.frexp(float(docs.values.max()))[1]) if fixed else None
    fp = fixed_point(index, batch, "u32" if fixed else acc, bits)
    exact = dense_scores(docs, queries)
    dense_d = docs.to_scipy().toarray().astype(np.float64)
    dense_q = queries.to_scipy().toarray().astype(np.float64)
    for q in range(len(queries)):
        scale = float(fp.scale[q])
        if fixed:
            qi = np.rint(dense_q[q] * float(fp.mult[q])).astype(np.int64)
            di = np.rint(dense_d * 2.0**bits).astype(np.int64)
            assert qi.max() < 2**31 and di.max() < 2**30
            f = ((qi[None, :] * di) >> int(fp.shift[q])).sum(1).astype(np.float64)
        else:
            f = np.round(dense_q[q][None, :] * scale * dense_d).sum(1)  # what the kernel adds
        assert (np.abs(f - exact[q] * scale) <= float(fp.delta[q]) / 2).all()
        assert f.max() < 2 * ACC_TOP["u32" if fixed else acc]


@pytest.mark.parametrize("emulated", [True, False], ids=["pytorch", "cuda"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantized", [True, False], ids=["ties", "continuous"])
@pytest.mark.parametrize(
    ("tile_bits", "dense_min", "acc", "fixed"),
    [
        (2, None, "u32", False),
        (5, 0.05, "u32", True),
        (9, 0.02, "carry", False),
        (13, 0.01, "u32", False),
        (14, None, "u32", True),
        (6, 0.1, "carry", False),
        (7, 0.02, "u32", True),
    ],
)
def test_tiled_search_is_exact(rng, tile_bits, dense_min, acc, fixed, quantized, device, emulated):
    if not emulated:
        if device != "cuda":
            pytest.skip("the CUDA kernel runs on a GPU (the CPU runs the emulation)")
        require_cuda_kernels()
    docs = random_collection(rng, 900, 120, 14, quantized=quantized, empty_fraction=0.05)
    queries = random_collection(rng, 11, 120, 9, quantized=quantized, empty_fraction=0.1)
    index = Index.build(docs, device=device)
    batch = query_batch(queries, index.device)
    scores = dense_scores(docs, queries)
    for k in (1, 3, 10, 100, 900, 1000):
        s, i = tiled_search(
            index, batch, k, tile_bits=tile_bits, dense_min=dense_min, acc=acc, fixed=fixed, emulated=emulated
        ).resolved()
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s)


def test_fixed_point_weights_fall_back_outside_their_range(rng):
    """One document weight dwarfing the others leaves ordinary weights few fixed-point bits
    (a huge margin): the search falls back to float64 products and stays exact."""
    docs = random_collection(rng, 300, 40, 8)
    queries = random_collection(rng, 5, 40, 6)
    docs.values[0] = 2.0**40
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    tl = build_tiled(index, 5, fixed=True)
    with pytest.raises(ValueError, match="fixed-point range"):
        fixed_point(index, batch, "u32", tl.weight_bits)
    scores = dense_scores(docs, queries)
    for k in (1, 10, 300):
        s, i = tiled_search(index, batch, k, tile_bits=5, acc="u32", fixed=True, emulated=True).resolved()
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.numpy(), ref_i)
        np.testing.assert_array_equal(s.numpy(), ref_s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("acc", "fixed", "spread"), [("u32", False, 1e-7), ("u32", True, 1e-7), ("carry", False, 1e-30)]
)
def test_scores_below_one_fixed_point_unit_are_not_lost(rng, acc, fixed, spread, device):
    """Weights spanning more than the accumulator's range: a document matching only through
    tiny weights sums to 0 units, yet is a result when fewer than k documents score more."""
    if device == "cuda":
        require_cuda_kernels()
    docs = random_collection(rng, 600, 60, 6)
    queries = random_collection(rng, 9, 60, 5)
    tiny = rng.random(docs.nnz) < 0.5
    docs.values[tiny] *= np.float32(spread)  # products down to spread², far below 2**-31 of the bound
    queries.values[: queries.nnz // 2] *= np.float32(spread)
    index = Index.build(docs, device=device)
    batch = query_batch(queries, index.device)
    scores = dense_scores(docs, queries)
    for k in (5, 100, 600, 700):
        s, i = tiled_search(index, batch, k, tile_bits=6, acc=acc, fixed=fixed, emulated=device == "cpu").resolved()
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s)


def test_wave_plan_covers_every_tile_once_in_growing_waves():
    """The first wave fills the GPU about twice; later waves grow 16-fold, 8-fold for large k
    (a better threshold sooner: fewer candidates from the big wave); small batches with few
    candidates run in one wave."""
    assert waves.wave_plan(1080, 256, 1000, 132) == [(0, 4), (4, 32), (36, 256), (292, 788)]
    assert waves.wave_plan(1080, 256, 10, 132) == [(0, 4), (4, 64), (68, 1012)]
    assert waves.wave_plan(1080, 1, 10, 132) == [(0, 1080)]
    for n_tiles in (1, 5, 33, 1080, 70_000):
        for b in (1, 9, 32, 256, 4096):
            for k in (1, 10, 255, 256, 1000):
                plan = waves.wave_plan(n_tiles, b, k, 132)
                sizes = [n for _, n in plan]
                assert [f for f, _ in plan] == [0, *np.cumsum(sizes)[:-1].tolist()]
                assert sum(sizes) == n_tiles and min(sizes) > 0
                grow = waves.WAVE_GROWTH_LARGE_K if k >= waves.LARGE_K else waves.WAVE_GROWTH
                assert all(later <= max(grow * n, -(-4 * 132 // b)) for n, later in itertools.pairwise(sizes))


def test_accumulator_choice():
    assert choose_acc(None) == "u32" and choose_acc("carry") == "carry"
    with pytest.raises(ValueError, match="acc must be one of"):
        choose_acc("fast")


def test_emulation_refuses_an_overflowing_accumulator():
    """A scale too large for the mode is caught, not wrapped silently (the CUDA kernel would wrap)."""
    docs = SparseCollection.from_dicts([{"capital": 3.0, "paris": 2.0}, {"paris": 1.0}])
    queries = SparseCollection.from_dicts([{"capital": 2.0, "paris": 2.0}])
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    fp = fixed_point(index, batch, "carry")  # a 2**61 scale handed to a 32-bit accumulator
    tl = build_tiled(index, 4)
    with pytest.raises(OverflowError, match="u32"):
        from gpusparse.engines.tiled.emulation import torch_tiled_candidates
        from gpusparse.engines.tiled.waves import candidates

        candidates(tl, batch, fp, 1, launch=torch_tiled_candidates, n_sm=1, acc="u32")


def test_tiled_kernel_name_in_search():
    docs = SparseCollection.from_dicts([{"capital": 1.0}, {"capital": 1.0, "paris": 1e-9}, {"paris": 2.0}])
    res = Index.build(docs).search([{"capital": 1.0, "paris": 1.0}], k=3, kernel="tiled")
    assert res.ids.tolist() == [[2, 0, 1]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_at_scale_and_with_candidate_overflow(rng, monkeypatch):
    require_cuda_kernels()
    docs = random_collection(rng, 60_000, 3000, 40)
    queries = random_collection(rng, 48, 3000, 20, empty_fraction=0.05)
    index = Index.build(docs, device="cuda")
    ref = index.search(queries, 1000, kernel="reference")
    for tile_bits, dense_min in ((12, None), (13, 0.25), (13, 0.02), (14, 0.1)):
        for acc, fixed in (("carry", False), ("u32", False), ("u32", True)):
            batch = query_batch(queries, index.device)
            s, i = tiled_search(
                index, batch, 1000, tile_bits=tile_bits, dense_min=dense_min, acc=acc, fixed=fixed
            ).resolved()
            same = torch.equal(i.cpu(), ref.ids) and torch.equal(s.cpu(), ref.scores)
            assert same, (tile_bits, dense_min, acc, fixed)
    monkeypatch.setattr(waves, "initial_capacity", lambda k, first_wave: 8)  # forces the rerun path
    s, i = tiled_search(index, query_batch(queries, index.device), 1000).resolved()
    assert torch.equal(i.cpu(), ref.ids) and torch.equal(s.cpu(), ref.scores)
    # the same rows flagged in pipelined batches, searched again after each batch's one sync
    for batch_size in (16, None):
        res = index.search(queries, 1000, batch_size=batch_size)
        assert torch.equal(res.ids, ref.ids) and torch.equal(res.scores, ref.scores), batch_size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_query_batches_are_exact(rng):
    """Batches of one query (one block a tile, through the search's CUDA graph) against the
    reference: every accumulator mode, fixed point and 8-bit levels (queries prepared, as
    Index.search prepares them), odd and even dense rows a block, and a query of more than one
    chunk of terms (the kernel's MAXT = 256)."""
    require_cuda_kernels()
    from gpusparse.layout.statistics import max_scores_host
    from gpusparse.queries import prepare_queries

    docs = random_collection(rng, 30_000, 1500, 50, skew=0.5)
    queries = SparseCollection.from_scipy(
        sp.vstack([random_collection(rng, 5, 1500, 12).to_scipy(), random_collection(rng, 1, 1500, 300).to_scipy()])
    )
    for quantize in (None, 8):
        index = Index.build(docs, device="cuda", quantize=quantize)
        ready = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
        ref = index.search(queries, 100, kernel="reference")
        for tile_bits, dense_min in ((13, None), (13, 0.02), (14, 0.1)):
            for acc, fixed in (("carry", False), ("u32", False), ("u32", True)):
                for r in range(len(queries)):
                    one = query_batch(ready[r : r + 1], index.device)
                    s, i = tiled_search(
                        index, one, 100, tile_bits=tile_bits, dense_min=dense_min, acc=acc, fixed=fixed
                    ).resolved()  # fmt: skip
                    same = torch.equal(i.cpu()[0], ref.ids[r]) and torch.equal(s.cpu()[0], ref.scores[r])
                    assert same, (quantize, tile_bits, dense_min, acc, fixed, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_large_batches_run_the_five_and_six_block_builds_exactly(rng, monkeypatch):
    """A batch of LARGE_BATCH queries or more on 8-bit levels runs the build with registers for
    six blocks an SM (queries of at most SHORT_WIDTH terms) or five (a longer query in the
    batch): exact against the reference, as are the float32 layouts' (fixed point, float64
    products) at that batch; then a candidate capacity that overflows."""
    require_cuda_kernels()
    from gpusparse.kernels import tile_candidates

    builds = []
    real = tile_candidates._kernel
    monkeypatch.setattr(tile_candidates, "_kernel", lambda build, *a: builds.append(build) or real(build, *a))
    docs = random_collection(rng, 40_000, 800, 30)
    short = random_collection(rng, tile_candidates.LARGE_BATCH + 9, 800, 12, empty_fraction=0.05)
    long_q = random_collection(rng, 1, 800, 3 * tile_candidates.SHORT_WIDTH)
    assert int(np.diff(long_q.indptr).max()) > tile_candidates.SHORT_WIDTH
    mixed = SparseCollection.from_scipy(sp.vstack([short.to_scipy(), long_q.to_scipy()]))
    for queries in (short, mixed):
        for quantize in (None, 8):
            index = Index.build(docs, device="cuda", quantize=quantize)
            for k in (10, 300):
                ref = index.search(queries, k, kernel="reference")
                for fixed in (True, False):
                    with override_config(fixed_point=fixed):
                        res = index.search(queries, k, kernel="tiled", batch_size=len(queries))
                    same = torch.equal(res.ids, ref.ids) and torch.equal(res.scores, ref.scores)
                    assert same, (len(queries), quantize, k, fixed)
    for blocks in (5, 6):
        assert any(b[0] == 13 and b[3] == blocks and b[5] == "unsigned char" for b in builds), f"{blocks} blocks ran"
    assert not any(b[3] >= 5 and b[5] != "unsigned char" for b in builds)
    monkeypatch.setattr(waves, "initial_capacity", lambda k, first_wave: 8)  # the rerun path, same build
    index = Index.build(docs, device="cuda")
    ref = index.search(short, 50, kernel="reference")
    res = index.search(short, 50, kernel="tiled", batch_size=len(short))
    assert torch.equal(res.ids, ref.ids) and torch.equal(res.scores, ref.scores)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_with_long_queries_and_long_segments(rng):
    """Queries of more than one chunk of terms (the kernel's MAXT = 256), and blocks of up to
    ~10**5 sparse postings (the chunk map's coarser pieces), against the reference."""
    require_cuda_kernels()
    docs = random_collection(rng, 40_000, 2000, 60, skew=0.5)
    long_q = random_collection(rng, 6, 2000, 420, skew=0.3)
    short_q = random_collection(rng, 6, 2000, 3, empty_fraction=0.3)
    queries = SparseCollection.from_scipy(sp.vstack([long_q.to_scipy(), short_q.to_scipy()]))
    assert int(np.diff(queries.indptr).max()) > 256
    index = Index.build(docs, device="cuda")
    for k in (10, 1000):
        ref = index.search(queries, k, kernel="reference")
        for tile_bits, dense_min in ((13, None), (13, 0.02), (12, 0.2)):
            for acc, fixed in (("carry", False), ("u32", False), ("u32", True)):
                s, i = tiled_search(
                    index, query_batch(queries, index.device), k, tile_bits=tile_bits, dense_min=dense_min,
                    acc=acc, fixed=fixed,
                ).resolved()  # fmt: skip
                same = torch.equal(i.cpu(), ref.ids) and torch.equal(s.cpu(), ref.scores)
                assert same, (k, tile_bits, dense_min, acc, fixed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("octs", [True, False])
def test_cuda_sparse_postings_by_octs_or_one_at_a_time_are_exact(rng, monkeypatch, octs):
    """The sparse loop reads aligned groups of eight postings (the kernel's OCTS) where the
    layout's arrays allow it, a group's postings of a neighbouring segment masked out at each
    end of a segment, and one posting at a time otherwise (``octs_readable`` false). Both are
    exact against the float64 reference: 8-bit levels (integer and float64 products), float32
    fixed point (packed postings) and float64 products in 64-bit sums; segments of one to
    hundreds of postings; tiles whose first posting lies at each of the eight places of its
    group; tiles of 64 documents (blocks of fewer than 32 threads)."""
    require_cuda_kernels()
    from gpusparse.kernels import tile_candidates as tc
    from gpusparse.quantize import quantize_collection, quantize_queries

    if not octs:
        monkeypatch.setattr(tc, "octs_readable", lambda x: False)
    built, real = [], tc._kernel

    def spy(build, device, variant, name="tiled_candidates"):
        if name == "tiled_candidates":
            built.append(build[12])  # the build's OCTS
        return real(build, device, variant, name)

    monkeypatch.setattr(tc, "_kernel", spy)
    raw = random_collection(rng, 30_000, 400, 30, skew=0.7)
    queries = random_collection(rng, 24, 400, 12)
    packed = False
    for quantize in (None, 8):
        docs = quantize_collection(raw, 8)[0] if quantize else raw
        index = Index.build(docs, device="cuda", quantize=quantize)
        sets = [(queries, "u32", True), (queries, "carry", False)]
        if quantize:  # prepared queries: integer products; raw ones: float64 products
            sets = [(quantize_queries(queries, 8), "u32", False), (queries, "u32", False)]
        for q, acc, fixed in sets:
            scores, batch = dense_scores(docs, q), query_batch(q, index.device)
            for tile_bits, dense_min in ((13, 0.05), (6, 0.3)):
                layout = layout_for_search(index, tile_bits, dense_min, acc, fixed)
                packed |= layout.packed
                if tile_bits == 6:
                    assert set((layout.tile_start[:-1] % 8).tolist()) == set(range(8))
                for k in (10, 700):
                    s, i = tiled_search(index, batch, k, tile_bits=tile_bits, dense_min=dense_min, acc=acc,
                                        fixed=fixed).resolved()  # fmt: skip
                    ref_s, ref_i = reference_topk(scores, k)
                    what = str((quantize, acc, fixed, tile_bits, k))
                    np.testing.assert_array_equal(i.cpu().numpy(), ref_i, err_msg=what)
                    np.testing.assert_array_equal(s.cpu().numpy(), ref_s, err_msg=what)
    assert packed and set(built) == {octs}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dense_rows_of_levels_two_at_a_time(rng):
    """The 8-bit layout's dense phase takes two rows at a time (the kernel's PAIRS: 16-bit
    weights times levels by __dp2a) where every dense weight of the block is at most 16 bits
    after its common power of two, and the registers' loop otherwise: integer query weights
    that are small (pairs), odd above 2**16 (registers), a block of more than 128 dense rows
    (pairs' table full: registers), more terms than MAXT (registers); odd and even dense rows
    a block, tiles of 16 and 32 documents a thread, a partial last tile. Exact against the
    float64 reference every time."""
    require_cuda_kernels()
    from gpusparse.engines.tiled.fixed_point import integer_weights
    from gpusparse.quantize import quantize_collection

    docs, _ = quantize_collection(random_collection(rng, 20_000, 300, 40), 8)  # what the index holds
    index = Index.build(docs, device="cuda", quantize=8)

    def rows(n: int, n_terms: int, high: int, first: int = 0) -> sp.csr_matrix:
        m = sp.lil_matrix((n, 300), dtype=np.float32)
        for r in range(n):
            m[r, rng.choice(np.arange(1, 300), size=n_terms, replace=False)] = rng.integers(1, high, size=n_terms)
            if first:
                m[r, 0] = first
        return m.tocsr()

    small = sp.vstack([rows(4, 7, 256), rows(4, 6, 256)])  # levels: the pairs
    wide = rows(4, 7, 1 << 20, first=65537)  # term 0 odd and above 16 bits: the registers
    many = rows(2, 250, 200)  # > 128 dense rows in a tile at the threshold below
    over = rows(1, 290, 200)  # more terms than MAXT = 256
    # T, a batch's padded width, above MAXT sends all its blocks to the registers: a batch of its own
    queries = SparseCollection.from_scipy(sp.vstack([small, wide, many]).tocsr())
    alone = SparseCollection.from_scipy(over)
    scores = dense_scores(docs, queries)
    batch = query_batch(queries, index.device)
    assert batch.padded_terms.shape[1] <= 256
    for tile_bits, dense_min in ((13, 0.001), (13, 0.05), (12, 0.02), (14, 0.001)):
        layout = layout_for_search(index, tile_bits, dense_min, "u32", False)
        assert layout.quantized
        ids = layout.dense_id.view(layout.n_tiles, -1).cpu().numpy() >= 0
        terms = [queries.to_scipy()[r].indices for r in range(len(queries))]
        nd = np.array([[int(ids[t][q].sum()) for t in range(layout.n_tiles)] for q in terms])
        assert (nd[:8] % 2 == 1).any() and (nd[:8] % 2 == 0).any() and (nd[:8] > 0).any()
        if dense_min == 0.001:
            assert (nd[12:14] > 128).any()  # the pairs' table holds 64 pairs
        for k in (10, 500):
            fp = fixed_point(index, batch, "u32")
            assert integer_weights(layout, batch, fp, "u32")  # the kernel's integer products
            s, i = tiled_search(index, batch, k, tile_bits=tile_bits, dense_min=dense_min, acc="u32").resolved()
            ref_s, ref_i = reference_topk(scores, k)
            np.testing.assert_array_equal(i.cpu().numpy(), ref_i, err_msg=str((tile_bits, dense_min, k)))
            np.testing.assert_array_equal(s.cpu().numpy(), ref_s, err_msg=str((tile_bits, dense_min, k)))
            s, i = tiled_search(index, query_batch(alone, index.device), k, tile_bits=tile_bits, dense_min=dense_min,
                                acc="u32").resolved()  # fmt: skip
            ref_s, ref_i = reference_topk(dense_scores(docs, alone), k)
            np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
            np.testing.assert_array_equal(s.cpu().numpy(), ref_s)
        if dense_min == 0.001:  # term 0 dense in every tile: the wide rows' blocks take the registers
            assert ids[:, 0].all()
            w = (batch.host_arrays()[1][8:12] * (fp.scale.cpu().numpy()[8:12] * layout.step)[:, None]).astype(np.int64)
            for r in w:
                r = r[r > 0]
                assert (r // np.bitwise_and(r, -r).min()).max() > 0xFFFF


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_later_waves_read_their_blocks_metadata_from_records(rng, monkeypatch):
    """Batches of LARGE_BATCH queries or more on 8-bit levels: the launches after the first wave
    read each block's term metadata from records that tile_meta writes just before (META), the
    tiles taken as many at a time as the buffer holds. With the buffer poisoned, for budgets of one
    tile, three tiles and all of them (and with tile_meta's warps over 3 tiles each): exact against
    the float64 reference and bit for bit the search without records. Blocks whose dense weights
    do not pair (above 16 bits after their shift, or more than 64 pairs of rows) take the general
    path from their record's header."""
    require_cuda_kernels()
    from gpusparse.kernels import tile_candidates as tc
    from gpusparse.quantize import quantize_collection, quantize_queries

    docs, _ = quantize_collection(random_collection(rng, 40_000, 300, 40, skew=0.7), 8)
    index = Index.build(docs, device="cuda", quantize=8)
    prepared = quantize_queries(random_collection(rng, 150, 300, 20), 8).to_scipy()  # integer products
    wide = sp.lil_matrix((10, 300), dtype=np.float32)  # integer weights, term 0 odd above 16 bits
    for r in range(10):
        wide[r, rng.choice(np.arange(1, 300), size=8, replace=False)] = rng.integers(1, 1 << 20, size=8)
        wide[r, 0] = 65537
    queries = SparseCollection.from_scipy(sp.vstack([prepared, wide.tocsr()]).tocsr())
    scores, batch = dense_scores(docs, queries), query_batch(queries, index.device)
    b, t = batch.padded_terms.shape
    assert b >= tc.META_MIN_BATCH and t <= tc.SHORT_WIDTH
    names, launches, real_kernel, real_scratch, real_launch = [], [], tc._kernel, tc.meta_scratch, tc.launch
    real_tiles = tc.meta_tiles

    def spy(build, device, variant, name="tiled_candidates"):
        names.append((name, build[-1]))  # the build's META
        return real_kernel(build, device, variant, name)

    def launch(kernel, grid, block, args, **kwargs):
        launches.append(block[0] == 128)  # tile_meta's blocks (the search's have 256 threads here)
        return real_launch(kernel, grid, block, args, **kwargs)

    def poisoned(*args, **kwargs):
        buf = real_scratch(*args, **kwargs)
        if buf is not None:
            buf.fill_(0x12345678)  # a header read before its record is written would be garbage
        return buf

    monkeypatch.setattr(tc, "_kernel", spy)
    monkeypatch.setattr(tc, "meta_scratch", poisoned)
    monkeypatch.setattr(tc, "launch", launch)
    per_tile = b * (t + 1) * 8
    n_sm = torch.cuda.get_device_properties(index.device).multi_processor_count
    for tile_bits, dense_min in ((11, 0.001), (11, 0.05)):
        layout = layout_for_search(index, tile_bits, dense_min, "u32", False)
        assert layout.quantized and layout.n_tiles > 8
        if dense_min == 0.001:  # term 0 dense in every tile: the wide rows' blocks do not pair
            assert bool((layout.dense_id.view(layout.n_tiles, -1)[:, 0] >= 0).all())
        for k in (10, 300):
            ref_s, ref_i = reference_topk(scores, k)
            got = {}
            for budget in (0, per_tile, 3 * per_tile, tc.META_MAX_BYTES):
                names.clear()
                launches.clear()
                index.derived.graphs.clear()  # a captured graph would replay the budget it was captured with
                monkeypatch.setattr(tc, "META_MAX_BYTES", budget)
                s, i = tiled_search(index, batch, k, tile_bits=tile_bits, dense_min=dense_min, acc="u32").resolved()
                what = str((tile_bits, dense_min, k, budget))
                np.testing.assert_array_equal(i.cpu().numpy(), ref_i, err_msg=what)
                np.testing.assert_array_equal(s.cpu().numpy(), ref_s, err_msg=what)
                got[budget] = (s.cpu(), i.cpu())
                metas = sum(name == "tile_meta" for name, _ in names)
                main = [meta for name, meta in names if name == "tiled_candidates"]
                assert (metas > 0) == (budget > 0) == any(main), what
                if budget == per_tile:  # one tile a launch: a records launch before each of the later tiles
                    later = sum(n for first, n in waves.wave_plan(layout.n_tiles, b, k, n_sm) if first > 0)
                    assert launches.count(True) == later >= 2, what
                    assert launches.count(False) >= later + 1, what  # and the first wave's (and any redone rows')
            # each warp of tile_meta over 3 tiles, in slices of 3 and of 7 tiles (a group cut short at its end)
            monkeypatch.setattr(tc, "meta_tiles", lambda tiles: 3)
            for budget in (3 * per_tile, 7 * per_tile):
                index.derived.graphs.clear()
                monkeypatch.setattr(tc, "META_MAX_BYTES", budget)
                s, i = tiled_search(index, batch, k, tile_bits=tile_bits, dense_min=dense_min, acc="u32").resolved()
                got[("groups of 3", budget)] = (s.cpu(), i.cpu())
            monkeypatch.setattr(tc, "meta_tiles", real_tiles)
            assert all(torch.equal(v[0], got[0][0]) and torch.equal(v[1], got[0][1]) for v in got.values())


def _records_build(layout, b: int, t: int) -> tuple:
    """The build key (tile_candidates' own) of the META launches a batch of ``b`` queries of ``t``
    terms takes on this 8-bit layout (default knobs, integer weights, no selection)."""
    from gpusparse.kernels import tile_candidates as tc

    threads, min_blocks = tc.launch_shape(layout.tile_bits, "u32", batch=b, levels=True, width=t)
    octs = tc.layout_octs(layout)
    assert tc._meta_build(layout, t, acc="u32", int_weights=True, dense_lists=False, threads=threads,
                          min_blocks=min_blocks, octs=octs)  # fmt: skip
    return (layout.tile_bits, threads, tc.UNROLL, min_blocks, "u32", "unsigned char", True, False, (), layout.packed,
            False, False, octs, True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tile_meta_records_hold_each_blocks_metadata_in_8_byte_entries(rng):
    """tile_meta's records (cuda/tile_candidates.cu, META) decoded on the host equal the metadata
    computed here from the layout: the header (pairs + 1, sparse segments, the pairs' shift, the
    sparse weights' shift, the octs), each sparse segment (start, length, weight >> shift, first
    oct) in term order and each pair of dense rows with their weights. A record whose query's
    weights exceed 8 bits after their common shift, or whose dense weights do not pair, says
    "builds itself" (a header of 0); those of prepared queries (levels times a power of two) never do."""
    require_cuda_kernels()
    from gpusparse.kernels import tile_candidates as tc
    from gpusparse.quantize import quantize_collection

    docs, _ = quantize_collection(random_collection(rng, 30_000, 300, 40, skew=0.7), 8)
    index = Index.build(docs, device="cuda", quantize=8)
    layout = layout_for_search(index, 11, 0.05, "u32", False)
    b, t = 160, 48
    terms = np.full((b, t), -1, dtype=np.int32)
    weights = np.zeros((b, t), dtype=np.float32)
    for q in range(b):
        n = int(rng.integers(1, t + 1))
        power = 2.0 ** int(rng.integers(0, 6))
        terms[q, :n] = rng.choice(300, size=n, replace=False)
        weights[q, :n] = rng.integers(1, 256, size=n) * power  # levels times one power of two
        if q < 16:
            weights[q, 0] = 257 * power  # 9 bits after the shift: these rows' records build themselves
    scale = 2.0 ** rng.integers(-2, 3, size=b)
    build = _records_build(layout, b, t)
    n_tiles = layout.n_tiles
    meta = torch.full((n_tiles * b * (t + 1) * 2,), 0x5A5A5A5A, dtype=torch.int32, device="cuda")
    dev_terms = torch.from_numpy(terms).cuda()
    dev_weights = torch.from_numpy(weights / scale[:, None].astype(np.float32)).cuda()  # times scale: the levels
    tc.write_records(layout, dev_terms, dev_weights, torch.from_numpy(scale).cuda(), meta, build, 0, n_tiles)
    rec = meta.cpu().numpy().view(np.uint32).reshape(n_tiles, b, t + 1, 2)
    seg = layout.seg.view(n_tiles, -1).cpu().numpy()
    did = layout.dense_id.view(n_tiles, -1).cpu().numpy()
    phase = layout.tile_start.cpu().numpy() & 7
    wi_all = (dev_weights.cpu().numpy().astype(np.float64) * scale[:, None]).astype(np.uint32)

    def trailing(x: int) -> int:
        return (x & -x).bit_length() - 1 if x else 0

    used = 0
    for q in range(b):
        live = terms[q] >= 0
        wi = wi_all[q]
        ws = trailing(int(np.bitwise_or.reduce(wi[live])))
        w_fit = int(wi[live].max()) >> ws <= 255
        assert w_fit == (q >= 16), q
        for r in range(n_tiles):
            sparse, dense, n_octs = [], [], 0
            for j in np.nonzero(live)[0]:
                term = terms[q, j]
                start, end = int(seg[r, term]), int(seg[r, term + 1])
                if did[r, term] >= 0:
                    dense.append((int(did[r, term]), int(wi[j])))
                elif end > start:
                    a = int(phase[r]) + start
                    count = ((a + end - start - 1) >> 3) - (a >> 3) + 1
                    sparse.append((start, end - start, int(wi[j]) >> ws, n_octs))
                    n_octs += count
            n_pairs = (len(dense) + 1) // 2
            s = trailing(int(np.bitwise_or.reduce([w for _, w in dense]))) if dense else 0
            fit = w_fit and (max((w for _, w in dense), default=0) >> s) <= 0xFFFF and n_pairs <= 64
            head = rec[r, q, 0]
            assert head[1] == n_octs, (q, r)
            if not fit:
                assert head[0] == 0, (q, r)
                continue
            used += 1
            assert head[0] == (n_pairs + 1) | len(sparse) << 7 | s << 15 | ws << 20, (q, r)
            for i, (start, length, w, first) in enumerate(sparse):
                x, y = rec[r, q, 1 + i]
                assert (x, y) == ((start | length << 24) & 0xFFFFFFFF, length >> 8 | w << 6 | first << 14), (q, r, i)
            for p in range(n_pairs):
                (ra, wa), (rb, wb) = dense[2 * p], dense[2 * p + 1] if 2 * p + 1 < len(dense) else (0xFFFF, 0)
                x, y = rec[r, q, 1 + len(sparse) + p]
                assert (x, y) == (ra | rb << 16, wa >> s | (wb >> s) << 16), (q, r, p)
    assert used == (b - 16) * n_tiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_record_whose_segment_starts_past_its_field_builds_itself(rng):
    """A sparse segment's start takes 24 bits of its record entry: in a tile of more than 2**24
    sparse postings, the record of a query with a term whose segment starts past that says "builds
    itself" (a header of 0, the path the search test above runs exactly); the others are used."""
    require_cuda_kernels()
    from gpusparse.kernels import tile_candidates as tc

    n_docs, n_terms = 2048, 10_000  # one tile of 2,048 documents, ~17.4M postings
    present = rng.random((n_docs, n_terms)) < 0.85
    levels = rng.integers(1, 256, size=(n_docs, n_terms)).astype(np.float32) * present
    index = Index.build(SparseCollection.from_scipy(sp.csr_matrix(levels)), device="cuda", quantize=8)
    layout = layout_for_search(index, 11, None, "u32", False)
    assert layout.n_tiles == 1 and int(layout.tile_start[1]) > (1 << 24) + (1 << 19)
    b, t = 130, 16
    terms = np.stack([rng.choice(9000, size=t, replace=False) for _ in range(b)]).astype(np.int32)
    terms[::2, 3] = rng.integers(9800, n_terms, size=(b + 1) // 2)  # starts past 2**24 (~17.05M postings before)
    weights = rng.integers(1, 256, size=(b, t)).astype(np.float32)
    build = _records_build(layout, b, t)
    meta = torch.full((b * (t + 1) * 2,), 0x5A5A5A5A, dtype=torch.int32, device="cuda")
    tc.write_records(layout, torch.from_numpy(terms).cuda(), torch.from_numpy(weights).cuda(),
                     torch.ones(b, dtype=torch.float64, device="cuda"), meta, build, 0, 1)  # fmt: skip
    head = meta.cpu().numpy().view(np.uint32).reshape(b, t + 1, 2)[:, 0, 0]
    seg = layout.seg.cpu().numpy()
    past = (seg[terms] >= 1 << 24).any(axis=1)
    assert past[::2].all() and not past[1::2].any()
    np.testing.assert_array_equal(head == 0, past)


@pytest.mark.parametrize("quantize", [None, 8])
def test_a_dense_row_leaves_its_sparse_segment_empty(rng, quantize):
    """A (tile, term) stored as a dense row has an empty sparse segment, in every build (in
    collection order and in an order of its own, in slabs): tile_meta loads a term's dense row id
    only where its segment is empty (cuda/tile_candidates.cu)."""
    docs = random_collection(rng, 3000, 2000, 30, skew=1.0)
    index = Index.build(docs, quantize=quantize)
    perm = torch.from_numpy(rng.permutation(3000))
    for tile_bits, dense_min, order in ((8, 0.05, None), (10, 0.01, None), (8, 0.05, perm)):
        tl = build_tiled(index, tile_bits, dense_min=dense_min, chunk=997, order=order)
        seg = tl.seg.view(tl.n_tiles, tl.n_terms + 1)
        lengths = (seg[:, 1:] - seg[:, :-1]).reshape(-1)
        dense = tl.dense_id >= 0
        assert int(dense.sum()) > 10 and bool((lengths > 0).any())
        assert not bool((lengths[dense] != 0).any()), (tile_bits, dense_min, order is not None)


def test_dense_terms_come_from_the_lists_for_the_smallest_batches_of_a_float32_layout(rng):
    """dense_lists: the lists for batches of up to DENSE_LISTS_MAX_BATCH queries on a fixed-point
    float32 layout with list positions; the dense rows otherwise (larger batches, 8-bit levels,
    a layout without list positions)."""
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs)
    layout = layout_for_search(index, 13, 0.02, "u32", True)
    assert layout.n_dense > 0 and layout.list_pos is not None
    most = device_mod.DENSE_LISTS_MAX_BATCH
    assert most >= 1
    lists = device_mod.dense_lists(index, layout, most)
    assert lists is not None and lists[0] is index.doc_ids and lists[1] is index.scores
    assert device_mod.dense_lists(index, layout, most + 1) is None
    from dataclasses import replace

    assert device_mod.dense_lists(index, replace(layout, list_pos=None), 1) is None
    q8 = Index.build(docs, quantize=8)
    assert device_mod.dense_lists(q8, layout_for_search(q8, 13, 0.02, "u32", True), 1) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_small_batches_read_dense_terms_from_the_lists(rng, monkeypatch):
    """Batches of at most DENSE_LISTS_MAX_BATCH queries on a fixed-point layout read their dense
    terms' postings from the lists (the kernel's DENSE_LISTS build; raised to 8 here, so that
    blocks of several queries run it too): results against the reference, with dense rows
    present, queries longer than one chunk of terms, a last tile shorter than the others; and
    the kernel's candidates hold the same top-k either way."""
    require_cuda_kernels()
    assert device_mod.DENSE_LISTS_MAX_BATCH >= 1
    monkeypatch.setattr(device_mod, "DENSE_LISTS_MAX_BATCH", 8)
    from gpusparse.engines.tiled.fixed_point import kernel_scale
    from gpusparse.kernels import tile_candidates

    docs = random_collection(rng, 30_001, 1500, 60, skew=0.8)
    long_q = random_collection(rng, 2, 1500, 300, skew=0.3)
    short_q = random_collection(rng, 14, 1500, 25, empty_fraction=0.1)
    queries = SparseCollection.from_scipy(sp.vstack([long_q.to_scipy(), short_q.to_scipy()]))
    index = Index.build(docs, device="cuda")
    for k in (1, 10, 1000):
        for tile_bits, dense_min in ((13, 0.02), (12, 0.25)):
            layout = layout_for_search(index, tile_bits, dense_min, "u32", True)
            assert layout.n_dense > 0 and layout.weight_bits is not None
            for rows in (slice(0, 1), slice(1, 2), slice(8, 16), slice(0, 8)):
                q = queries[rows]
                ref = index.search(q, k, kernel="reference")
                batch = query_batch(q, index.device)
                assert device_mod.dense_lists(index, layout, len(q)) is not None
                s, i = tiled_search(index, batch, k, tile_bits=tile_bits, dense_min=dense_min, acc="u32",
                                    fixed=True).resolved()  # fmt: skip
                assert torch.equal(i.cpu(), ref.ids) and torch.equal(s.cpu(), ref.scores), (k, tile_bits, rows)
                fp = fixed_point(index, batch, "u32", layout.weight_bits)
                tops = []
                for lists in (None, device_mod.dense_lists(index, layout, len(q))):
                    b, cap = len(q), layout.n_tiles << tile_bits  # room for every document
                    theta = torch.zeros(b, dtype=torch.int64, device="cuda")
                    count = torch.zeros(b, dtype=torch.int32, device="cuda")
                    cdoc = torch.full((b, cap), -5, dtype=torch.int32, device="cuda")
                    cval = torch.full((b, cap), -5, dtype=torch.int64, device="cuda")
                    tile_candidates.tiled_candidates(
                        layout, batch.padded_terms.to(torch.int32).contiguous(), batch.padded_weights,
                        kernel_scale(layout, fp), fp.delta, k=k, acc="u32", q_shift=fp.shift, theta=theta,
                        cand_count=count, cand_doc=cdoc, cand_val=cval, lists=lists,
                    )  # fmt: skip
                    top = []
                    for r in range(b):
                        n = int(count[r])
                        top.append(sorted(zip((-cval[r, :n]).tolist(), cdoc[r, :n].tolist(), strict=True))[:k])
                    tops.append(top)
                assert tops[0] == tops[1], (k, tile_bits, rows)


def test_compaction_raises_theta_to_the_kth_values_leading_16_bits(rng):
    """compact_torch's theta: the k-th candidate value with the bits below the two radix bytes
    from its row's largest value's top byte cleared (a lower bound within 2**-8 of it, exact for
    values below 2**16), never lowered; every candidate at or above the k-th value stays."""
    from gpusparse.engines.tiled.fixed_point import FixedPoint
    from gpusparse.engines.tiled.waves import compact_torch, top_bit

    x = torch.tensor([0, 1, 255, 256, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1])
    assert top_bit(x).tolist() == [0, 0, 7, 8, 30, 31, 53, 62]
    b, cap, k = 64, 500, 40
    for spread in (2**8, 2**16, 2**31, 2**60):
        count = rng.integers(k, cap + 1, b)
        vals = rng.integers(1, spread, (b, cap), dtype=np.int64)
        theta = np.zeros(b, np.int64)
        theta[:8] = spread  # above every value: kept as it is
        t, c, d, v = (
            torch.from_numpy(a.copy())
            for a in (theta, count.astype(np.int32), np.arange(b * cap, dtype=np.int32).reshape(b, cap), vals)
        )
        compact_torch(
            t, c, d, v, cap, FixedPoint(torch.ones(b, dtype=torch.float64), torch.zeros(b, dtype=torch.int64)), k
        )
        for r in range(b):
            row = np.sort(vals[r, : count[r]])[::-1]
            kth, top = int(row[k - 1]), int(row[0]).bit_length() - 1
            low = max(top // 8 * 8 - 8, 0)
            assert int(t[r]) == max(int(theta[r]), kth >> low << low), (spread, r)
            assert int(t[r]) <= max(int(theta[r]), kth) and (r < 8 or kth - int(t[r]) < 1 << low)
            if r >= 8:  # theta below the k-th value: the candidates at or above it all stay
                assert int(c[r]) >= int((row >= kth).sum())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", [0, 700, 3000])
def test_cuda_compaction_equals_the_pytorch_one(rng, cache: int):
    """compact_candidates against compact_torch, with rows' values held in shared memory: none,
    a part of the longer rows (the rest read from global memory), all."""
    require_cuda_kernels()
    from gpusparse.engines.tiled.fixed_point import FixedPoint
    from gpusparse.engines.tiled.waves import compact_torch
    from gpusparse.kernels.compact import compact_candidates

    b, cap = 37, 3000
    for k in (1, 10, 1000, 2999):
        for spread in (2**8, 2**31, 2**60):  # small spreads: many ties
            count = rng.integers(0, cap + 1, b)
            count[:4] = [0, cap, k, k - 1]
            vals = rng.integers(1, spread, (b, cap), dtype=np.int64)
            docs = rng.integers(0, 10**6, (b, cap)).astype(np.int32)
            for r in range(b):  # poison past each row's count: neither version may read it
                vals[r, count[r] :] = -1
                docs[r, count[r] :] = -7
            theta = rng.integers(0, spread, b, dtype=np.int64) // rng.integers(1, 4, b)
            theta[:2] = 0
            delta = rng.integers(0, 100, b, dtype=np.int64)
            most = int(count.max())
            cpu = [torch.from_numpy(x.copy()) for x in (theta, count.astype(np.int32), docs, vals)]
            fp = FixedPoint(torch.ones(b, dtype=torch.float64), torch.from_numpy(delta))
            compact_torch(*cpu, most, fp, k)
            gpu = [torch.from_numpy(x.copy()).cuda() for x in (theta, count.astype(np.int32), docs, vals)]
            flags0 = rng.random(b) < 0.3
            flags = torch.from_numpy(flags0).cuda()
            compact_candidates(*gpu, torch.from_numpy(delta).cuda(), k, most, cache=cache, overflow=flags)
            th, cnt, d, v = (x.cpu() for x in gpu)
            assert torch.equal(th, cpu[0]) and torch.equal(cnt, cpu[1]), (k, spread)
            assert flags.cpu().numpy().tolist() == flags0.tolist(), "no count exceeds cap: flags unchanged"
            for r in range(b):
                n = int(cnt[r])
                assert torch.equal(d[r, :n], cpu[2][r, :n]) and torch.equal(v[r, :n], cpu[3][r, :n]), (k, spread, r)
    # counts past the capacity (counted, not stored): flagged, and compacted as a full row
    count = np.array([cap + 1, cap, 5 * cap, 0], dtype=np.int32)
    vals = rng.integers(1, 2**40, (4, cap), dtype=np.int64)
    docs = rng.integers(0, 10**6, (4, cap)).astype(np.int32)
    gpu = [torch.from_numpy(x.copy()).cuda() for x in (np.zeros(4, np.int64), count, docs, vals)]
    flags = torch.tensor([False, False, False, True], device="cuda")
    compact_candidates(*gpu, torch.zeros(4, dtype=torch.int64, device="cuda"), 10, cap, overflow=flags)
    assert flags.tolist() == [True, False, True, True]
    full = [torch.from_numpy(x.copy()) for x in (np.zeros(4, np.int64), np.minimum(count, cap), docs, vals)]
    compact_torch(*full, cap, FixedPoint(torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int64)), 10)
    assert torch.equal(gpu[0].cpu(), full[0]) and torch.equal(gpu[1].cpu(), full[1])


def tile_sums(layout, q_terms, q_weights, q_scale, q_shift, tl_idx: int, q: int) -> torch.Tensor:
    """Query ``q``'s fixed-point sums over tile ``tl_idx`` (int64), as the CUDA kernel adds them;
    it reads the layout's arrays as the kernel does (not through the layout's accessors)."""
    n_docs, n_terms, tile_bits, weight_bits = layout.n_docs, layout.n_terms, layout.tile_bits, layout.weight_bits
    seg, dense_id, dense = layout.seg, layout.dense_id, layout.dense
    shift = 32 - tile_bits

    def products(w: float, q: int, stored: torch.Tensor) -> torch.Tensor:
        if weight_bits is not None:  # fixed point: (round(w) · round(d · 2**b)) >> shift
            fixed = stored.to(torch.int64)
            if stored.dtype != torch.int32:
                fixed = torch.round(stored.to(torch.float64) * 2.0**weight_bits).to(torch.int64)
            return (round(w) * fixed) >> int(q_shift[q])
        return torch.round(w * stored.to(torch.float64)).to(torch.int64)

    def sparse(a: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not layout.packed:
            return layout.offs[a:e].to(torch.int64) & 0xFFFF, layout.wts[a:e]
        word = layout.offs[a:e].to(torch.int64) & 0xFFFFFFFF
        field = ((word & ((1 << shift) - 1)) << 8) | layout.wts[a:e].to(torch.int64)
        return word >> shift, (field + (layout.exp_base << 23)).to(torch.int32).view(torch.float32)

    base = tl_idx << tile_bits
    width = min(1 << tile_bits, n_docs - base)
    acc = torch.zeros(width, dtype=torch.int64)
    for j in range(q_terms.shape[1]):
        term = int(q_terms[q, j])
        if term < 0:
            break
        did = int(dense_id[tl_idx * n_terms + term])
        w = float(q_weights[q, j]) * float(q_scale[q])
        if did >= 0:
            acc += products(w, q, dense[int(layout.dense_start[tl_idx]) + did, :width])
            continue
        start = int(layout.tile_start[tl_idx])
        a = start + int(seg[tl_idx * (n_terms + 1) + term])
        e = start + int(seg[tl_idx * (n_terms + 1) + term + 1])
        offs, wts = sparse(a, e)
        acc.index_add_(0, offs, products(w, q, wts))
    return acc


def radix_tau(acc: torch.Tensor, k: int) -> int:
    """The CUDA kernel's block threshold ``tau`` for one tile's sums: two radix passes of 8 bits
    from the largest sum's top bit give a value that at least ``k`` sums reach (0 when fewer
    than ``k`` sums are positive)."""
    vals = acc[acc != 0].tolist()
    msb = max(vals).bit_length() - 1
    s0 = msb - 7 if msb >= 7 else 0
    tau, need = 0, k
    for step in (0, 1):
        shift = s0 if step == 0 else (s0 - 8 if s0 >= 8 else 0)
        bits = 8 if step == 0 else s0 - shift
        if step == 1 and bits == 0:
            break
        prefix = tau >> s0
        hist = [0] * (1 << bits)
        for v in vals:
            if step == 0 or v >> s0 == prefix:
                hist[(v >> shift) & ((1 << bits) - 1)] += 1
        cum, b = 0, (1 << bits) - 1
        while b >= 0 and cum + hist[b] < need:
            cum += hist[b]
            b -= 1
        if b < 0:
            return 0
        need -= cum
        tau = b << s0 if step == 0 else tau | (b << shift)
    return tau


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile_bits", [13, 12, 4])
def test_cuda_block_threshold_is_the_radix_rule(rng, tile_bits: int):
    """Each block's own threshold (the first wave's selection, read back as theta after a launch
    over one tile from theta = 0) equals the two-pass radix rule on the tile's sums, for k from
    1 to past the tile's matches, on fixed-point and 8-bit layouts (whose sums are exact integers
    either way). Tiles of 16 documents run blocks of fewer threads than a warp."""
    require_cuda_kernels()
    from dataclasses import fields, replace

    from gpusparse.engines.tiled.fixed_point import integer_weights, kernel_scale
    from gpusparse.kernels import tile_candidates
    from gpusparse.layout.statistics import max_scores_host
    from gpusparse.queries import prepare_queries

    for quantized in (False, True):
        docs = random_collection(rng, 3 << tile_bits, 400, 30, quantized=quantized)
        index = Index.build(docs, device="cuda", quantize=8 if quantized else None)
        queries = random_collection(rng, 6, 400, 12, quantized=quantized)
        queries = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
        layout = layout_for_search(index, tile_bits, 0.1, "u32", True)
        assert (layout.weight_bits is not None) != quantized
        arrays = {f.name: getattr(layout, f.name) for f in fields(layout)}
        cpu_layout = replace(
            layout, forward=None, **{n: x.cpu() for n, x in arrays.items() if isinstance(x, torch.Tensor)}
        )
        batch = query_batch(queries, index.device)
        fp = fixed_point(index, batch, "u32", layout.weight_bits)
        int_w = integer_weights(layout, batch, fp, "u32")
        terms32 = batch.padded_terms.to(torch.int32).contiguous()
        q_scale = kernel_scale(layout, fp)
        host = (
            terms32.cpu(),
            batch.padded_weights.cpu(),
            q_scale.cpu(),
            fp.shift.cpu() if fp.shift is not None else None,
        )
        b, cap = len(queries), 1 << tile_bits
        exercised = 0
        for tl in range(layout.n_tiles):
            sums = [tile_sums(cpu_layout, *host, tl, q) for q in range(b)]
            for k in (1, 10, 100, 5000):
                theta = torch.zeros(b, dtype=torch.int64, device="cuda")
                count = torch.zeros(b, dtype=torch.int32, device="cuda")
                cdoc = torch.empty((b, cap), dtype=torch.int32, device="cuda")
                cval = torch.empty((b, cap), dtype=torch.int64, device="cuda")
                tile_candidates.tiled_candidates(
                    layout, terms32, batch.padded_weights, q_scale, fp.delta, k=k, tiles=(tl, 1), acc="u32",
                    int_weights=int_w, q_shift=fp.shift, theta=theta, cand_count=count, cand_doc=cdoc, cand_val=cval,
                )  # fmt: skip
                want = [radix_tau(x, k) if int(x.max()) > 0 else 0 for x in sums]
                assert theta.tolist() == want, (quantized, tl, k)
                exercised += sum(1 for x in want if x)
        assert exercised, "some block found k matches"


def fake_kernel(layout, q_terms, q_weights, q_scale, q_delta, *, k, tiles, select, acc, int_weights, q_shift, theta,
                cand_count, cand_doc, cand_val):  # fmt: skip
    """The CUDA kernel's contract in PyTorch, block by block, so the host's waves run on a CPU."""
    b = q_terms.shape[0]
    cap = cand_doc.shape[1]
    tile = 1 << layout.tile_bits
    for tl_idx in range(tiles[0], tiles[0] + tiles[1]):
        base = tl_idx * tile
        for q in range(b):
            acc = tile_sums(layout, q_terms, q_weights, q_scale, q_shift, tl_idx, q)
            if int(acc.max()) == 0:
                continue
            tau = int(torch.topk(acc, k).values[-1]) if select and k <= acc.numel() else 0
            old = int(theta[q])
            theta[q] = max(old, tau)
            th = max(old, tau)
            d = int(q_delta[q]) + (th >> 22)
            thr = max(th - d, 1) if th > d else 1
            (hit,) = (acc >= thr).nonzero(as_tuple=True)
            for i in hit.tolist():
                slot = int(cand_count[q])
                cand_count[q] += 1
                if slot < cap:
                    cand_doc[q, slot] = base + i
                    cand_val[q, slot] = acc[i]


@pytest.mark.parametrize("acc", ["carry", "u32", "u32-fixed"])
@pytest.mark.parametrize("single_wave", [False, True])
@pytest.mark.parametrize("small_cap", [False, True])
@pytest.mark.parametrize("final_compaction", [True, False])
def test_waves_and_compaction_on_cpu(rng, monkeypatch, small_cap, single_wave, acc, final_compaction):
    """The GPU host path (waves, compaction, overflow rerun) with the kernel replaced by its contract."""
    if small_cap:
        monkeypatch.setattr(waves, "initial_capacity", lambda k, first_wave: 3)
    monkeypatch.setattr(waves, "SINGLE_WAVE_MAX_CANDIDATES", 1 << 30 if single_wave else 0)
    monkeypatch.setattr(waves, "FINAL_COMPACTION_MIN_BATCH", 0 if final_compaction else 1 << 30)
    docs = random_collection(rng, 700, 80, 10, quantized=True, empty_fraction=0.05)
    queries = random_collection(rng, 5, 80, 7, quantized=True, empty_fraction=0.1)
    index = Index.build(docs)
    batch = query_batch(queries, index.device)
    scores = dense_scores(docs, queries)
    fixed = acc == "u32-fixed"
    acc = "u32" if fixed else acc
    for k in (1, 7, 60, 700):
        tl = tiled_layout(index, 5, 0.1, fixed)
        fp = fixed_point(index, batch, acc, tl.weight_bits)
        docs_c, vals_c = waves.candidates(tl, batch, fp, k, launch=fake_kernel, n_sm=2, acc=acc)
        s, i = rank_candidates(index, batch, fp, docs_c, vals_c, k)
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.numpy(), ref_i)
        np.testing.assert_array_equal(s.numpy(), ref_s)
        if final_compaction:
            assert (docs_c >= 0).sum(1).max() <= max(k, 1) * 8 + 64  # compaction keeps few candidates


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rescoring_equals_the_pytorch_path(rng, monkeypatch):
    from gpusparse.exact import exact_scores
    from gpusparse.kernels import rescore

    require_cuda_kernels()
    docs = random_collection(rng, 5000, 500, 30, empty_fraction=0.02)
    queries = random_collection(rng, 40, 500, 20, empty_fraction=0.05)
    index = Index.build(docs, device="cuda")
    batch = query_batch(queries, index.device)
    rows = torch.from_numpy(rng.integers(0, 40, 20000)).cuda()
    cand = torch.from_numpy(rng.integers(0, 5000, 20000)).cuda()
    fast = exact_scores(index, batch, rows, cand)
    monkeypatch.setattr(rescore, "available", lambda: False)
    slow = exact_scores(index, batch, rows, cand)
    assert torch.equal(fast, slow)
    ref = dense_scores(docs, queries)[rows.cpu().numpy(), cand.cpu().numpy()].astype(np.float32)
    np.testing.assert_array_equal(fast.cpu().numpy(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile_bits", [None, 6, 12])
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "lists"])
def test_cuda_candidate_keys_equal_the_pytorch_path(rng, monkeypatch, tile_bits, forward):
    """The one-launch finalisation (keys; rescoring by the forward copy, or by binary
    searches narrowed to a tile's share of each list) against the PyTorch steps, on
    candidates whose fixed-point values leave some scores certain and some not; absent
    slots included."""
    from dataclasses import replace

    from gpusparse.engines.tiled.ranking import rank_candidates
    from gpusparse.kernels import rescore

    require_cuda_kernels()
    docs = random_collection(rng, 5000, 500, 30, empty_fraction=0.02)
    queries = random_collection(rng, 40, 500, 20, empty_fraction=0.05)
    index = Index.build(docs, device="cuda")
    batch = query_batch(queries, index.device)
    fp = fixed_point(index, batch, "u32")
    exact = torch.from_numpy(dense_scores(docs, queries)).cuda()
    cand = torch.from_numpy(rng.integers(-1, 5000, (40, 300))).cuda()
    true = exact.gather(1, cand.clamp_min(0)) * fp.scale[:, None]
    vals = torch.round(true + torch.from_numpy(rng.normal(0, 20, (40, 300))).cuda()).clamp_min(1).to(torch.int64)
    tl = layout_for_search(index, tile_bits, None, fixed=False) if tile_bits else None
    if tl is not None:
        assert tl.forward is not None  # built with a layout on a GPU
        tl = tl if forward else replace(tl, forward=None)
    floor = (exact.max(1).values * torch.from_numpy(rng.uniform(0, 1, 40)).cuda()).to(torch.float32)
    odd = replace(fp, scale=fp.scale * 3)  # not a power of two: the kernel divides instead of multiplying
    for k, params, cut in [(1, fp, None), (10, fp, None), (300, fp, None), (400, fp, None), (10, fp, floor),
                           (300, odd, None), (300, odd, floor)]:  # fmt: skip
        fast = rank_candidates(index, batch, params, cand, vals, k, tl, floor=cut)
        with monkeypatch.context() as m:
            m.setattr(rescore, "available", lambda: False)
            slow = rank_candidates(index, batch, params, cand, vals, k, tl, floor=cut)
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rescoring_by_the_forward_copy_equals_the_list_searches(rng, monkeypatch):
    """candidate_keys with the forward copy (query terms found in a shared-memory table, or
    by binary search when the table is off) against the binary searches in the lists and
    the canonical scores: documents longer than one pass of the kernel (128 terms) and
    queries longer than 64 terms, candidate counts below and above the width, a floor,
    absent slots; each by a warp a slot and by a lane a slot (``lanes``: here most slots are
    rescored, by the warp together)."""
    from gpusparse.exact import exact_scores
    from gpusparse.kernels import rescore
    from gpusparse.layout.forward import forward_copy

    require_cuda_kernels()
    docs = random_collection(rng, 3000, 2000, 160, empty_fraction=0.02, skew=0.3)
    queries = random_collection(rng, 24, 2000, 80, empty_fraction=0.05, skew=0.3)
    index = Index.build(docs, device="cuda")
    lengths = np.diff(docs.indptr)
    assert lengths.max() > 128 and (lengths == 0).any() and (lengths > 0).sum() > (lengths > 128).sum() > 0
    batch = query_batch(queries, index.device)
    assert batch.padded_terms.shape[1] > 64
    fp = fixed_point(index, batch, "u32")
    b, ld, width = 24, 700, 600
    exact = torch.from_numpy(dense_scores(docs, queries)).cuda()
    cand = torch.from_numpy(rng.integers(-1, 3000, (b, ld)).astype(np.int32)).cuda()
    true = exact.gather(1, cand.clamp_min(0).to(torch.int64)) * fp.scale[:, None]
    vals = torch.round(true + torch.from_numpy(rng.normal(0, 20, (b, ld))).cuda()).clamp_min(1).to(torch.int64)
    count = torch.from_numpy(rng.integers(0, ld + 100, b).astype(np.int32)).cuda()
    floor = torch.from_numpy(rng.uniform(0, 30, b).astype(np.float32)).cuda()
    args = (index.doc_ids, index.scores, index.offsets, index.lengths, batch.padded_terms, batch.padded_weights)
    for kw in ({}, {"count": count}, {"count": count, "floor": floor}):
        keys = []
        for fwd, table in ((forward_copy(index), True), (forward_copy(index), False), (None, False)):
            monkeypatch.setattr(rescore, "TABLE_MAX_TERMS", 1 << 15 if table else 0)
            for lanes in (False, True):
                poison = torch.full((b, width), -7, dtype=torch.int64, device="cuda")
                del poison  # the caching allocator hands this block to the keys: every slot must be written
                keys.append(
                    rescore.candidate_keys_cuda(
                        *args, cand, vals, fp.delta, fp.scale, width=width, forward=fwd, lanes=lanes, **kw
                    )
                )
        assert all(torch.equal(x, keys[-1]) for x in keys), kw
        # the scores in the keys are the canonical ones wherever a candidate was rescored
        live = (keys[0] != 0).nonzero(as_tuple=True)
        got = torch.div(keys[0][live], 1 << 31, rounding_mode="floor").to(torch.int32).view(torch.float32)
        want = exact_scores(index, batch, live[0], cand[live].to(torch.int64))
        assert torch.equal(got, want), kw
        n = count.clamp(0, width) if "count" in kw else torch.full((b,), width, device="cuda")
        beyond = torch.arange(width, device="cuda")[None, :] >= n[:, None]
        assert not keys[0][beyond].any(), kw  # slots past a row's count: key 0
        assert live[0].numel() > 1000, kw


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_synchronisation_free_path_flags_rows_it_cannot_finish(rng, monkeypatch):
    """Rows whose candidates outgrow the fixed final width are flagged by device_search and
    searched again the general way; the results stay exact."""
    require_cuda_kernels()
    base = random_collection(rng, 1000, 60, 12).to_scipy()
    docs = SparseCollection.from_scipy(sp.vstack([base, base, base]))  # every score three times
    queries = random_collection(rng, 24, 60, 6, empty_fraction=0.1)
    index = Index.build(docs, device="cuda")
    batch = query_batch(queries, index.device)
    scores = dense_scores(docs, queries)
    monkeypatch.setattr(device_mod, "DEVICE_WIDTH_SLACK", 0)
    for k in (1, 5, 50):
        tl = layout_for_search(index, 7)
        fp = fixed_point(index, batch, "u32", tl.weight_bits)
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        _, _, redo = device_mod.device_search(index, tl, batch, fp, k, acc="u32", int_weights=False, n_sm=n_sm)
        if k == 1:  # three tied documents at the top of every row with a match: past 2k slots
            matched = torch.from_numpy(scores.max(1) > 0).cuda()
            assert bool(matched.any()) and torch.equal(redo & matched, matched)
        s, i = tiled_search(index, batch, k, tile_bits=7).resolved()
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_small_batches_replay_a_captured_graph(rng, monkeypatch):
    """Small batches run a CUDA graph captured once per shape: each new batch's queries are
    copied in before the replay (fresh queries, same shape: still exact), and the results
    equal the steps run one by one."""
    require_cuda_kernels()
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda")
    for trial in range(4):
        queries = random_collection(rng, 3, 300, 9 + trial)
        scores = dense_scores(docs, queries)
        for k in (10, 1000):
            batch = query_batch(queries, index.device)
            s, i = tiled_search(index, batch, k, tile_bits=12).resolved()
            ref_s, ref_i = reference_topk(scores, k)
            np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
            np.testing.assert_array_equal(s.cpu().numpy(), ref_s)
            with override_config(graph_max_batch=0):
                s2, i2 = tiled_search(index, batch, k, tile_bits=12).resolved()
            assert torch.equal(s, s2) and torch.equal(i, i2)
    graphs = index.derived.graphs
    assert graphs and all(entry is not False for entry in graphs.values())  # captured, and reused:
    assert len(graphs) <= 2 * 3  # two k, query widths of at most three powers of two
