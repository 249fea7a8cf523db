"""Issue 18 at scale: the streamed generator, the tiled layout built chunk by chunk, the
layout-only index and its search, and the chunk-by-chunk exact reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gpusparse.config import override_config
from gpusparse.engines.chunk_reference import chunk_reference_search
from gpusparse.engines.tiled import engine as tiled_engine
from gpusparse.engines.tiled.layout_fallback import layout_reference_search
from gpusparse.layout.chunked import ChunkStatistics, append_piece, build_tiled_chunks, chunk_lists, piece_sizes
from gpusparse.layout.layout_only import LayoutOnly, engine_layout
from gpusparse.layout.tiled import build_tiled
from gpusparse.quantize import Quantization, power_of_two_step, quantize_csr
from gpusparse.queries import query_batch
from gpusparse.search import search
from gpusparse.synthetic import SyntheticSpec
from gpusparse.synthetic_stream import SyntheticStream

from .conftest import require_cuda_kernels
from .reference import canonical_scores, random_collection, reference_topk

CPU = torch.device("cpu")


def _csr(collection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(collection.indptr.astype(np.int64)), torch.from_numpy(collection.indices.astype(np.int32)),
            torch.from_numpy(collection.values.astype(np.float32)))  # fmt: skip


def _cut(csr, sizes):
    """The CSR's rows in consecutive chunks of ``sizes`` rows, each numbered from 0."""
    indptr, terms, weights = csr
    out, a = [], 0
    for n in sizes:
        lo, hi = int(indptr[a]), int(indptr[a + n])
        out.append((indptr[a : a + n + 1] - lo, terms[lo:hi], weights[lo:hi]))
        a += n
    return out


def _random_sizes(rng, n_docs, tile_bits):
    """Chunk sizes: random multiples of the tile, the last one whatever is left."""
    tile, sizes, left = 1 << tile_bits, [], n_docs
    while left > 0:
        n = min(left, tile * int(rng.integers(1, 4)))
        sizes.append(n)
        left -= n
    return sizes


def test_stream_chunks_are_canonical_and_drawn_again_identically():
    spec = SyntheticSpec().with_vocabulary(3000)
    stream = SyntheticStream(1000, spec=spec, seed=7, chunk_docs=384, rows_per_step=100)
    assert stream.n_chunks == 3 and stream.bounds(2) == (768, 1000)
    chunks = list(stream)
    assert [c[0].numel() - 1 for c in chunks] == [384, 384, 232]
    for indptr, terms, weights in chunks:
        assert indptr.dtype == torch.int64 and terms.dtype == torch.int32 and weights.dtype == torch.float32
        lengths = torch.diff(indptr)
        assert int(lengths.min()) >= 1 and int(lengths.max()) <= spec.doc_nnz_max
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        key = rows * spec.n_terms + terms.to(torch.int64)
        assert bool((torch.diff(key) > 0).all())  # ascending, distinct terms in every row
        assert float(weights.min()) > 0 and float(weights.max()) <= spec.weight_max
    again = SyntheticStream(1000, spec=spec, seed=7, chunk_docs=384, rows_per_step=100)
    for i in (2, 0):  # any chunk, in any order, the same tensors
        assert all(torch.equal(x, y) for x, y in zip(again.chunk(i), chunks[i], strict=True))
    assert not torch.equal(chunks[0][1][:50], chunks[1][1][:50])  # chunks draw different documents
    other = SyntheticStream(1000, spec=spec, seed=8, chunk_docs=384, rows_per_step=100)
    assert not torch.equal(other.chunk(0)[1][:50], chunks[0][1][:50])
    q = stream.queries(20)
    assert all(torch.equal(x, y) for x, y in zip(q, again.queries(20), strict=True))
    assert q[0].numel() == 21 and int(torch.diff(q[0]).max()) <= spec.query_nnz_max
    with pytest.raises(IndexError):
        stream.chunk(3)


@pytest.mark.parametrize("weights", ["float32", "fixed", "uint8", "unpacked"])
@pytest.mark.parametrize(("tile_bits", "dense_min"), [(3, 0.3), (5, 0.12), (6, None), (4, 0.01)])
def test_build_from_chunks_equals_build_tiled(rng, weights, tile_bits, dense_min):
    """Piece by piece equals one shot, field by field; random sizes, a partial last tile."""
    n_docs = int(rng.integers(1, 12)) * (1 << tile_bits) + int(rng.integers(1, 1 << tile_bits))
    docs = random_collection(rng, n_docs, 60, 10, empty_fraction=0.05, quantized=weights == "uint8")
    csr = _csr(docs)
    quant = Quantization(8, power_of_two_step(3.0, 8)) if weights == "uint8" else None
    whole = csr if quant is None else quantize_csr(*csr, quant.bits, quant.step)[0]
    one_shot = build_tiled(chunk_lists(whole, 60, quant, CPU), tile_bits, dense_min=dense_min,
                           fixed=weights == "fixed", list_positions=False, chunk=53,
                           pack=weights != "unpacked")  # fmt: skip
    assert one_shot.packed == (weights in ("float32", "fixed"))
    sizes = _random_sizes(rng, n_docs, tile_bits)
    calls = []
    layout, stats = build_tiled_chunks(
        lambda: iter(_cut(csr, sizes)), n_docs, 60, tile_bits=tile_bits, dense_min=dense_min, quantization=quant,
        fixed=weights == "fixed", pack=weights != "unpacked", device=CPU, progress=lambda *a: calls.append(a),
    )  # fmt: skip
    for f in dataclasses.fields(one_shot):
        a, b = getattr(one_shot, f.name), getattr(layout, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name
    assert layout.dense.dtype == (torch.uint8 if quant else torch.float32)
    assert [c[0] for c in calls] == ["count"] * len(sizes) + ["build"] * len(sizes) and calls[-1][2] == n_docs
    lengths = torch.bincount(whole[1].to(torch.int64), minlength=60)
    assert torch.equal(stats.lengths, lengths) and stats.n_docs == n_docs
    assert stats.n_empty_docs == int((torch.diff(whole[0]) == 0).sum())
    maxima = torch.zeros(60).scatter_reduce_(0, whole[1].to(torch.int64), whole[2], reduce="amax")
    assert torch.equal(stats.max_scores, maxima) and stats.min_weight == float(whole[2].min())
    assert piece_sizes(whole, 60, tile_bits, dense_min) == (layout.offs.numel(), layout.n_dense)


def test_chunks_are_checked():
    rng = np.random.default_rng(0)
    csr = _csr(random_collection(rng, 100, 30, 5))
    build = build_tiled_chunks
    with pytest.raises(ValueError, match="inside a tile"):
        build(lambda: iter(_cut(csr, [10, 90])), 100, 30, tile_bits=3, dense_min=None, device=CPU)
    with pytest.raises(ValueError, match="hold 100 documents, not 120"):
        build(lambda: iter(_cut(csr, [64, 36])), 120, 30, tile_bits=3, dense_min=None, device=CPU)
    first = [True]

    def changing():  # the second pass sees other documents
        sizes = [64, 36] if first[0] else [64, 30]
        first[0] = False
        return iter(_cut(csr, sizes))

    with pytest.raises(ValueError, match="hold 94 documents"):
        build(changing, 100, 30, tile_bits=3, dense_min=None, device=CPU)


@pytest.mark.parametrize("packed", [False, True])
def test_append_piece_shifts_positions_and_rows(packed):
    rng = np.random.default_rng(1)
    csr = _csr(random_collection(rng, 40, 12, 6))
    piece = build_tiled(chunk_lists(csr, 12, None, CPU), 3, dense_min=0.3, list_positions=False, pack=False)
    assert piece.n_dense > 0
    from gpusparse.layout.chunked import empty_tiled
    from gpusparse.layout.packing import exponent_base, exponent_range

    exp_base = exponent_base(*(int(e) for e in exponent_range(csr[2])), 3) if packed else None
    assert (exp_base is not None) == packed
    n_sparse, n_dense = piece.n_sparse, piece.n_dense
    layout = empty_tiled(80, 12, 3, 7 + n_sparse, 2 + n_dense, torch.float32, CPU, exp_base=exp_base)
    at = append_piece(layout, piece, 5, (7, 2))
    assert at == (7 + n_sparse, 2 + n_dense)
    v = 12
    assert torch.equal(layout.seg[5 * (v + 1) : 10 * (v + 1)], piece.seg)
    assert torch.equal(layout.tile_start[6:11], piece.tile_start[1:] + 7)
    assert torch.equal(layout.dense_start[6:11], piece.dense_start[1:] + 2)
    keys = torch.arange(5 * v)
    assert torch.equal(layout.segments(keys + 5 * v)[0], piece.segments(keys)[0] + 7)
    rows, prow = layout.dense_rows(keys + 5 * v), piece.dense_rows(keys)
    assert torch.equal(rows[prow >= 0], prow[prow >= 0] + 2) and bool((rows[prow < 0] == -1).all())
    pos = torch.arange(n_sparse)
    assert torch.equal(layout.offsets_at(pos + 7), piece.offsets_at(pos))
    assert torch.equal(layout.weights_at(pos + 7), piece.weights_at(pos))  # packed: the same float32 bits
    assert torch.equal(layout.dense[2:], piece.dense)
    assert bool((layout.dense_id[: 5 * v] == -1).all()) and bool((layout.dense_id[10 * v :] == -1).all())
    with pytest.raises(ValueError, match="runs past"):
        append_piece(layout, piece, 6, (0, 0))
    with pytest.raises(ValueError, match="no room"):
        append_piece(layout, piece, 0, (8, 2))


def _quantization(docs) -> Quantization:
    """The step of a quantized build of ``docs`` (random_collection's levels stay exact)."""
    return Quantization(8, power_of_two_step(float(docs.values.max()), 8))


def _layout_only(docs, *, quantized, tile_bits, dense_min, fixed, chunk_tiles=2):
    csr = _csr(docs)
    n = len(docs)
    tile = 1 << tile_bits
    sizes = [min(chunk_tiles * tile, n - a) for a in range(0, n, chunk_tiles * tile)]
    quant = _quantization(docs) if quantized else None
    layout, stats = build_tiled_chunks(lambda: iter(_cut(csr, sizes)), n, len(docs.vocab), tile_bits=tile_bits,
                                       dense_min=dense_min, quantization=quant, fixed=fixed, device=CPU)  # fmt: skip
    return LayoutOnly(layout, stats, dense_min=dense_min, vocab=docs.vocab, quantization=quant)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "uint8"])
@pytest.mark.parametrize("config", [{}, {"fixed_point": False}, {"accumulator": "carry"}, {"dense_min": 0.05}])
def test_layout_only_index_searches_exactly(rng, quantized, config):
    """:func:`gpusparse.search.search` with the tiled engine on an index that is its layout and
    statistics alone: the reference's results, including the rows the engine cannot certify
    (k past the matching documents), which go to the layout's own exact search."""
    docs = random_collection(rng, 700, 80, 12, quantized=quantized, empty_fraction=0.05)
    queries = random_collection(rng, 11, 80, 30, quantized=quantized, empty_fraction=0.1)
    with override_config(**config):
        tile_bits, dense_min, fixed = engine_layout(len(docs), quantized)
        tile_bits = 6  # several tiles at this size (the key keeps the default's dense share)
        index = _layout_only(docs, quantized=quantized, tile_bits=tile_bits, dense_min=dense_min, fixed=fixed)
        assert not index.lists_resident and index.doc_ids.numel() == 0
        scores = canonical_scores(docs, queries)
        for k in (1, 10, 700):
            res = _search(index, queries, k, tile_bits)
            ref_s, ref_i = reference_topk(scores, k)
            np.testing.assert_array_equal(res[1].numpy(), ref_i)
            np.testing.assert_array_equal(res[0].numpy(), ref_s)


def _search(index, queries, k, tile_bits):
    batch = query_batch(queries, index.device)
    if index.quantization is not None:  # random_collection's quantized weights are exact levels
        from gpusparse.quantize import quantize_queries

        batch = query_batch(quantize_queries(queries, 8), index.device)
    return tiled_engine.tiled_search(index, batch, k, tile_bits=tile_bits).resolved()


def test_layout_only_through_the_public_search_and_its_fallback(monkeypatch):
    """``search(kernel="tiled")`` takes a layout-only index; rows past the matching documents
    are searched on the layout (counted), and a layout the index was not built with is refused."""
    rng = np.random.default_rng(3)
    docs = random_collection(rng, 500, 50, 6)
    queries = random_collection(rng, 9, 50, 5)
    common = np.bincount(queries.indices).argmax()  # in several queries
    docs.values[np.nonzero(docs.indices == common)[0][0]] = 2.0**60  # other sums fall below one 61-bit unit
    calls = []
    real = tiled_engine.layout_reference_search
    monkeypatch.setattr(tiled_engine, "layout_reference_search", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with override_config(accumulator="carry"):
        tile_bits, dense_min, fixed = engine_layout(len(docs), False)
        index = _layout_only(docs, quantized=False, tile_bits=tile_bits, dense_min=dense_min, fixed=fixed)
        for k in (5, 400):
            res = search(index, queries, k, kernel="tiled")
            ref_s, ref_i = reference_topk(canonical_scores(docs, queries), k)
            np.testing.assert_array_equal(res.ids.numpy(), ref_i)
            np.testing.assert_array_equal(res.scores.numpy(), ref_s)
    assert calls  # rows the engine could not certify: searched on the layout
    assert index.stats().n_postings == docs.indices.size and index.stats().n_padded == 0
    with pytest.raises(ValueError, match="holds only the tiled layout"):  # u32 fixed point: another layout
        search(index, queries, 10, kernel="tiled")


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "uint8"])
def test_layout_reference_search_is_exact(rng, quantized):
    docs = random_collection(rng, 300, 40, 9, quantized=quantized, empty_fraction=0.1)
    queries = random_collection(rng, 7, 40, 12, quantized=quantized, empty_fraction=0.1)
    index = _layout_only(docs, quantized=quantized, tile_bits=5, dense_min=0.1, fixed=False)
    assert index.layout.n_dense > 0
    for k in (1, 30, 400):
        s, i = layout_reference_search(index.layout, query_batch(queries, CPU), k, max_postings=17, tiles_per_step=3)
        ref_s, ref_i = reference_topk(canonical_scores(docs, queries), k)
        np.testing.assert_array_equal(i.numpy(), ref_i)
        np.testing.assert_array_equal(s.numpy(), ref_s)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "uint8"])
def test_chunk_reference_search_is_exact(rng, quantized):
    """The reference that reads the collection chunk by chunk, against the dense one."""
    docs = random_collection(rng, 250, 40, 9, quantized=quantized, empty_fraction=0.1)
    queries = random_collection(rng, 6, 40, 12, quantized=quantized, empty_fraction=0.2)
    quant = _quantization(docs) if quantized else None
    chunks = _cut(_csr(docs), [64, 100, 1, 85])
    for k in (1, 20, 300):
        s, i = chunk_reference_search(chunks, query_batch(queries, CPU), k, 40, quantization=quant)
        ref_s, ref_i = reference_topk(canonical_scores(docs, queries), k)
        np.testing.assert_array_equal(i.numpy(), ref_i)
        np.testing.assert_array_equal(s.numpy(), ref_s)


def test_chunk_statistics_accumulate():
    stats = ChunkStatistics.empty(5, CPU)
    stats.add((torch.tensor([0, 2, 2, 3]), torch.tensor([1, 4, 1], dtype=torch.int32), torch.tensor([0.5, 2.0, 0.25])))
    assert stats.lengths.tolist() == [0, 2, 0, 0, 1] and stats.max_scores.tolist() == [0, 0.5, 0, 0, 2.0]
    assert (stats.n_docs, stats.n_empty_docs, stats.min_weight, stats.max_weight) == (3, 1, 0.25, 2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["float32", "uint8"])
def test_streamed_layout_on_the_gpu_matches_the_chunk_reference(weights):
    """The whole path on a GPU with the CUDA kernels: the calibrated stream built chunk by
    chunk, searched as a layout-only index, checked against the chunk-by-chunk reference."""
    require_cuda_kernels()
    from gpusparse.quantize import quantize_queries

    dev = torch.device("cuda")
    stream = SyntheticStream(50_000, seed=1, chunk_docs=1 << 14, device=dev)
    quant = Quantization(8, power_of_two_step(stream.spec.weight_max, 8)) if weights == "uint8" else None
    tile_bits, dense_min, fixed = engine_layout(stream.n_docs, quant is not None)
    layout, stats = build_tiled_chunks(lambda: iter(stream), stream.n_docs, stream.n_terms, tile_bits=tile_bits,
                                       dense_min=dense_min, quantization=quant, fixed=fixed, device=dev)  # fmt: skip
    index = LayoutOnly(layout, stats, dense_min=dense_min, quantization=quant)
    from gpusparse import SparseCollection, Vocabulary

    qi, qt, qw = (x.cpu().numpy() for x in stream.queries(40))
    queries = SparseCollection(qi, qt, qw, vocab=Vocabulary.integer(stream.n_terms))
    res = search(index, queries, 1000, kernel="tiled", batch_size=32)
    prepared = quantize_queries(queries, 8) if quant is not None else queries
    s, i = chunk_reference_search(iter(stream), query_batch(prepared, dev), 1000, stream.n_terms, quantization=quant)
    assert torch.equal(res.ids, i.cpu()) and torch.equal(res.scores, s.cpu())


def test_stream_keeps_the_calibrated_statistics():
    """The stream draws from generate's model: the same row lengths and weights, in law."""
    from gpusparse.synthetic import generate, synthetic_stats

    stream = SyntheticStream(1500, seed=2, chunk_docs=1024)
    chunks = list(stream)
    indptr = torch.cat([chunks[0][0]] + [c[0][1:] + sum(int(x[0][-1]) for x in chunks[:i])
                                         for i, c in enumerate(chunks) if i])  # fmt: skip
    docs = (indptr, torch.cat([c[1] for c in chunks]), torch.cat([c[2] for c in chunks]))
    ours = synthetic_stats(docs, stream.queries(16), max_queries=16)
    theirs = synthetic_stats(*generate(1500, 16, seed=2), max_queries=16)
    for key, tol in (("doc_nnz_mean", 0.03), ("doc_nnz_sd", 0.1), ("weight_median", 0.05), ("query_nnz_mean", 0.15),
                     ("nonempty_lists", 0.01), ("frac_docs_touched", 0.15)):  # fmt: skip
        assert ours[key] == pytest.approx(theirs[key], rel=tol), key
