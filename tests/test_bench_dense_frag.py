"""bench/dense_frag.py (issue 23: the dense rows in MMA fragment order): its operands emulated on the CPU
lane by lane through PTX's fragment layouts of ``mma.m16n8k32`` (.u8) against ``dense_mma``'s float64
references; its kernel against them on a GPU (skipped without CUDA and CuPy)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from .conftest import bench_script, require_cuda_kernels
from .test_bench_dense_mma import _setup

# PTX ISA, "Matrix Fragments for mma.m16n8k32", .u8 (written from the ISA's formulas, not from the bench):
# element e of a lane's fragment (four 8-bit elements a 32-bit register, element e in register e // 4, byte
# e % 4 from the low end).
LANE = np.arange(32)[:, None]
GID, TIG = LANE >> 2, LANE % 4
E16, E8, E4 = np.arange(16)[None, :], np.arange(8)[None, :], np.arange(4)[None, :]
A_ROW = np.where((E16 < 4) | ((E16 >= 8) & (E16 < 12)), GID, GID + 8)  # [32, 16] document of a_e
A_COL = TIG * 4 + (E16 & 3) + np.where(E16 >= 8, 16, 0)  # [32, 16] row (k) of a_e
B_ROW = TIG * 4 + (E8 & 3) + np.where(E8 >= 4, 16, 0)  # [32, 8] row (k) of b_e
B_COL = np.broadcast_to(GID, (32, 8))  # query of b_e
C_ROW = np.where(E4 < 2, GID, GID + 8)  # [32, 4] document of c_e
C_COL = TIG * 2 + (E4 & 1)  # query of c_e


def _elements(frag: torch.Tensor, regs: int) -> np.ndarray:
    """``[n, 32, 4 · regs]`` int64: each lane's elements, from its registers as the kernel's vector load
    fills them (lane ``l``'s ``regs`` little-endian 32-bit words at ``4 · regs · l``)."""
    words = np.ascontiguousarray(frag.cpu().numpy()).view("<u4").reshape(-1, 32, regs).astype(np.int64)
    return ((words[..., None] >> (8 * np.arange(4))) & 0xFF).reshape(-1, 32, 4 * regs)


def _a_matrices(a: torch.Tensor) -> np.ndarray:
    """``[blocks, 16, 32]``: each block's A (documents × rows) through PTX's A layout."""
    el = _elements(a, 4)
    out = np.full((el.shape[0], 16, 32), -1, dtype=np.int64)
    out[:, A_ROW, A_COL] = el
    assert (out >= 0).all(), "the A layout covers the 16 × 32 matrix"
    return out


def _b_matrices(b: torch.Tensor, n_blocks: int) -> np.ndarray:
    """``[steps, n_blocks, 32, 8]``: each k-step's B (rows × queries) per block of 8 queries."""
    el = _elements(b.reshape(-1, 256), 2)
    out = np.full((el.shape[0], 32, 8), -1, dtype=np.int64)
    out[:, B_ROW, B_COL] = el
    assert (out >= 0).all(), "the B layout covers the 32 × 8 matrix"
    return out.reshape(b.shape[0], n_blocks, 32, 8)


def _padded_tile_rows(a_mats: np.ndarray, steps0: torch.Tensor, tile: int, t: int) -> np.ndarray:
    """``[steps · 32, tile]``: tile ``t``'s padded dense rows put back together from its A blocks
    (block of group ``g``, step ``s`` at ``steps0[t] · G + g · steps + s``)."""
    g_n = tile // 16
    s0, n = int(steps0[t]), int(steps0[t + 1] - steps0[t])
    blocks = a_mats[s0 * g_n : (s0 + n) * g_n].reshape(g_n, n, 16, 32)  # [group, step, doc, k]
    return blocks.transpose(1, 3, 0, 2).reshape(n * 32, tile)


def _emulate(a: torch.Tensor, steps0: torch.Tensor, b: torch.Tensor, n_blocks: int, tile: int) -> np.ndarray:
    """``[n_tiles, n_blocks · 8, tile]`` int64: what ``dense_frag.cu`` stores in ``out``. Per (tile, document
    group, block of 8 queries): the 16 × 8 products of the k-steps accumulated, read out as each lane's c_e
    through PTX's C layout, and scattered as the kernel's stores do (doc ``16 g + gid (+ 8)``, query
    ``8 nb + 2 tig (+ 1)``)."""
    a_mats, b_mats = _a_matrices(a), _b_matrices(b, n_blocks)
    n_tiles, g_n = steps0.numel() - 1, tile // 16
    out = np.zeros((n_tiles, n_blocks * 8, tile), dtype=np.int64)
    for t in range(n_tiles):
        s0, n = int(steps0[t]), int(steps0[t + 1] - steps0[t])
        am = a_mats[s0 * g_n : (s0 + n) * g_n].reshape(g_n, n, 16, 32)
        d = np.einsum("gsmk,snkq->gnmq", am, b_mats[s0 : s0 + n])  # [group, nb, 16, 8]
        c = d[:, :, C_ROW, C_COL]  # [group, nb, lane, e]: the accumulator registers
        g_idx = np.arange(g_n)[:, None, None, None]
        nb_idx = np.arange(n_blocks)[None, :, None, None]
        doc = g_idx * 16 + GID[None, None] + np.where(E4 >= 2, 8, 0)[None, None]
        query = nb_idx * 8 + TIG[None, None] * 2 + (E4 & 1)[None, None]
        out[t, np.broadcast_to(query, c.shape), np.broadcast_to(doc, c.shape)] = c
    return out


def _fixture(rng, qg: int = 64, device: str = "cpu", n_queries: int = 37) -> SimpleNamespace:
    """The bench module, a small random 8-bit layout and queries, ``dense_mma``'s query operand (``qa``,
    ``n_ref`` blocks of 8 queries) and both fragment operands at ``qg``."""
    bench = bench_script("dense_frag")
    _, queries, layout, batch = _setup(rng, device, n_queries)
    assert layout.quantized and layout.n_dense > 0
    qa, _, n_ref = bench.query_operand(layout, batch, len(queries))
    a, steps0, tile_block = bench.fragment_dense(layout)
    b, n_blocks = bench.fragment_queries(layout, batch, len(queries), qg)
    return SimpleNamespace(
        bench=bench, n_queries=len(queries), layout=layout, batch=batch, qa=qa, n_ref=n_ref, a=a, steps0=steps0,
        tile_block=tile_block, b=b, n_blocks=n_blocks, tile=1 << layout.tile_bits,
    )  # fmt: skip


def _want(f: SimpleNamespace) -> np.ndarray:
    """``[n_tiles, n_blocks · 8, tile]``: ``dense_mma.reference_sums`` of every tile."""
    tiles = range(f.layout.n_tiles)
    return np.stack([f.bench.expected_sums(f.layout, f.qa, f.n_ref, t, f.n_blocks * 8).cpu().numpy() for t in tiles])


def test_operands_hold_the_rows_and_levels_in_fragment_order(rng):
    f = _fixture(rng)
    ops, layout, steps0, n_blocks = f.bench.ops, f.layout, f.steps0, f.n_blocks
    row_start, row_term = ops.tile_dense_rows(layout)
    levels, _ = ops.query_levels(f.batch.padded_weights)
    want_q = ops.query_matrix(f.batch.padded_terms, levels, layout.n_terms).numpy()
    steps = torch.diff(steps0)
    assert torch.equal(steps, (torch.diff(row_start) + 31) // 32) and int(steps.max()) > 1
    assert torch.equal(f.tile_block, steps0 * (f.tile // 16)) and f.a.shape == (int(f.tile_block[-1]), 512)
    assert n_blocks * 8 == 64 and f.b.shape == (int(steps0[-1]), n_blocks * 256)
    a_mats, b_mats = _a_matrices(f.a), _b_matrices(f.b, n_blocks)
    for t in range(layout.n_tiles):
        lo, hi = int(row_start[t]), int(row_start[t + 1])
        rows = _padded_tile_rows(a_mats, steps0, f.tile, t)
        assert np.array_equal(rows[: hi - lo], layout.dense[lo:hi].numpy()), t
        assert not rows[hi - lo :].any(), "padding rows are 0"
        s0, n = int(steps0[t]), int(steps[t])
        q = b_mats[s0 : s0 + n].transpose(0, 2, 1, 3).reshape(n * 32, n_blocks * 8)  # [padded row, query]
        assert np.array_equal(q[: hi - lo, : f.n_queries], want_q[:, row_term[lo:hi].numpy()].T), t
        assert not q[hi - lo :].any() and not q[:, f.n_queries :].any(), "padding rows and queries are 0"


@pytest.mark.parametrize("qg", [64, 32, 128])
def test_emulated_kernel_equals_the_reference(rng, qg):
    f = _fixture(rng, qg)
    assert f.n_blocks * 8 == -(-f.n_queries // qg) * qg
    got = _emulate(f.a, f.steps0, f.b, f.n_blocks, f.tile)
    want = _want(f)
    for t in range(f.layout.n_tiles):
        assert np.array_equal(got[t], want[t]), t
    assert not got[:, f.n_queries :].any(), "padded queries sum to 0"
    total = f.bench.reference_checksum(f.layout, f.qa, f.n_ref)
    assert int(got.sum()) == total and total > 0


def test_a_wrong_fragment_mapping_is_caught(rng):
    """The emulation can fail: the A registers of a lane transposed (a1 <-> a2: the document half and the
    row half swapped) or their bytes reversed, or B's two registers swapped, no longer equal the reference."""
    f = _fixture(rng)
    want = _want(f)
    assert np.array_equal(_emulate(f.a, f.steps0, f.b, f.n_blocks, f.tile), want)
    regs = f.a.view(-1, 32, 4, 4)
    transposed = regs[:, :, [0, 2, 1, 3]].reshape(f.a.shape)
    reversed_bytes = regs.flip(3).reshape(f.a.shape)
    b_swapped = f.b.view(-1, 32, 2, 4).flip(2).reshape(f.b.shape)
    assert not np.array_equal(_emulate(transposed, f.steps0, f.b, f.n_blocks, f.tile), want)
    assert not np.array_equal(_emulate(reversed_bytes, f.steps0, f.b, f.n_blocks, f.tile), want)
    assert not np.array_equal(_emulate(f.a, f.steps0, b_swapped, f.n_blocks, f.tile), want)


def test_bad_query_group_is_refused(rng):
    bench = bench_script("dense_frag")
    _, queries, layout, batch = _setup(rng, "cpu", 5)
    with pytest.raises(ValueError, match="multiple of 8"):
        bench.fragment_queries(layout, batch, len(queries), 12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("qg", "pf", "gm"), [(64, 2, 1), (32, 1, 1), (128, 3, 1), (64, 2, 2), (32, 3, 4)])
def test_kernel_sums_equal_the_reference_on_gpu(rng, qg, pf, gm):
    require_cuda_kernels()
    f = _fixture(rng, qg, "cuda", n_queries=70)  # several groups of queries, padded
    fn = f.bench.frag_kernel(torch.cuda.current_device(), qg, pf, gm)
    checksum = torch.zeros(1, dtype=torch.int64, device="cuda")
    out = torch.full((f.layout.n_tiles, f.n_blocks * 8, f.tile), -7, dtype=torch.int32, device="cuda")
    f.bench.run_frag(fn, f.a, f.steps0, f.b, f.n_blocks, qg, f.tile, checksum, out, f.layout.n_tiles)
    torch.cuda.synchronize()
    got = out.cpu().numpy().astype(np.int64)
    want = _want(f)
    for t in range(f.layout.n_tiles):
        assert np.array_equal(got[t], want[t]), t
    assert int(checksum.item()) == f.bench.reference_checksum(f.layout, f.qa, f.n_ref)
    # the CPU emulation of the same operands agrees with the device
    assert np.array_equal(_emulate(f.a.cpu(), f.steps0.cpu(), f.b.cpu(), f.n_blocks, f.tile), got)
