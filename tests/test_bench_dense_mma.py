"""bench/dense_mma.py (issue 23's fused tensor-core measurement): its operands and references on the
CPU; its kernel against them on a GPU (skipped without CUDA and CuPy)."""

from __future__ import annotations

import pytest
import torch

from gpusparse import Index
from gpusparse.engines.tiled.engine import layout_for_search
from gpusparse.layout.statistics import max_scores_host
from gpusparse.queries import prepare_queries, query_batch

from .conftest import bench_script, require_cuda_kernels
from .reference import random_collection


def _setup(rng, device: str, n_queries: int = 37):
    docs = random_collection(rng, 3 * 4096 + 1000, 300, 40, skew=1.2)
    index = Index.build(docs, device=device, quantize=8)
    queries = random_collection(rng, n_queries, 300, 20, empty_fraction=0.1)
    queries = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
    layout = layout_for_search(index, 12, 0.05)
    return index, queries, layout, query_batch(queries, index.device)


def test_operands_and_references_on_cpu(rng):
    bench = bench_script("dense_mma")
    ops = bench.ops
    _, queries, layout, batch = _setup(rng, "cpu")
    assert layout.quantized and layout.n_dense > 0
    qa, rmax, n_blocks = bench.query_operand(layout, batch, len(queries))
    assert n_blocks * 8 == 64 and rmax % 16 == 0 and qa.shape == (layout.n_tiles, rmax, n_blocks * 32)
    row_start, row_term = ops.tile_dense_rows(layout)
    levels, _ = ops.query_levels(batch.padded_weights)
    want_q = ops.query_matrix(batch.padded_terms, levels, layout.n_terms)
    grid = qa.view(layout.n_tiles, rmax, n_blocks, 32).to(torch.int64)
    assert int(grid[..., 8:].abs().sum()) == 0, "bytes past each block's 8 queries stay 0"
    total = 0
    for t in range(layout.n_tiles):
        lo, hi = int(row_start[t]), int(row_start[t + 1])
        got = grid[t, :, :, :8].reshape(rmax, n_blocks * 8)
        assert int(got[hi - lo :].abs().sum()) == 0, "rows past the tile's stay 0"
        assert int(got[:, len(queries) :].abs().sum()) == 0, "padded queries stay 0"
        assert torch.equal(got[: hi - lo, : len(queries)], want_q[:, row_term[lo:hi]].T)
        sums = bench.reference_sums(layout, qa, n_blocks, t)
        # the dense part of each score, term by term
        d = layout.dense[lo:hi].to(torch.int64)
        brute = torch.zeros((n_blocks * 8, d.shape[1]), dtype=torch.int64)
        for k in range(hi - lo):
            brute[: len(queries)] += want_q[:, int(row_term[lo + k])][:, None] * d[k][None, :]
        assert torch.equal(sums, brute), t
        total += int(sums.sum())
    assert total == bench.reference_checksum(layout, qa, n_blocks) and total > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_sums_equal_the_reference_on_gpu(rng):
    require_cuda_kernels()
    bench = bench_script("dense_mma")
    _, queries, layout, batch = _setup(rng, "cuda", n_queries=70)  # two groups of 64, padded
    qa, rmax, n_blocks = bench.query_operand(layout, batch, len(queries))
    tile = 1 << layout.tile_bits
    row_start = bench.ops.tile_dense_rows(layout)[0].contiguous()
    dense_pad = torch.cat([layout.dense, torch.zeros((bench.PAD_ROWS, tile), dtype=torch.uint8, device="cuda")])
    fn = bench.kernel(torch.cuda.current_device(), rmax)
    checksum = torch.zeros(1, dtype=torch.int64, device="cuda")
    out = torch.full((layout.n_tiles, n_blocks * 8, tile), -7, dtype=torch.int32, device="cuda")
    bench.run_mma(fn, dense_pad, row_start, qa, n_blocks, rmax, tile, checksum, out, layout.n_tiles)
    torch.cuda.synchronize()
    for t in range(layout.n_tiles):
        assert torch.equal(out[t].to(torch.int64), bench.reference_sums(layout, qa, n_blocks, t)), t
    assert int(checksum.item()) == bench.reference_checksum(layout, qa, n_blocks)
