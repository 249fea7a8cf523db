"""Issue 23: the 8-bit dense phase on tensor cores with both operands stored in MMA fragment order.

The fifth session's prototype (``bench/dense_mma.py``, WMMA m32n8k16 straight from the layout's row-major
dense rows) was bound by L1 feeding the fragments: each A fragment is 16 rows × 32 bytes, 8 KB apart. Here
the rows are rewritten once, outside the timing, in the order of the registers of PTX
``mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32`` (``bench/dense_frag.cu``, which spells out the
fragment layouts): per tile the dense rows are padded with zero rows to a multiple of 32 (k-steps), and for
each 16-document group and k-step one 512-byte block holds, at ``16 · lane``, exactly that lane's four A
registers, so a warp loads a fragment with one coalesced ``uint4`` load. Blocks are stored tile by tile,
then document group, then k-step: a warp walks all k-steps of its group, so its successive loads are one
contiguous run (``steps × 512`` bytes) and the next step's prefetch is the next 512 bytes. The queries' levels
are stored the same way (``B``: per k-step and block of 8 queries, 256 bytes, lane ``l``'s b0, b1 at ``8 · l``)
and staged in shared memory per (tile, group of queries): every warp of the block reads each B fragment
once per document group (32 times a tile at 4096 documents), so they are read from shared memory, not
through L1 from global memory, whose capacity is shared with the A stream.

One CUDA block per (tile, group of ``QG`` queries), a tile's groups adjacent in the grid (they read its
rows from L2 together); 8 warps take the tile's 16-document groups in turn. Same run, same layout and
queries: the old WMMA kernel and the tiled kernel with and without its dense phase (as ``dense_mma.py``).
Exactness: every sum of the first ``--check-tiles`` tiles against ``dense_mma.reference_sums`` and the
checksum over all tiles against ``dense_mma.reference_checksum``, for each ``QG``.

Usage (GPU machine; ~1-2 minutes; ~22 GB at 8.8M documents):

    python bench/dense_frag.py --out $OUT --commit SHA [--n 8841823] [--batch 256] [--qg 64 32 128] [--gm 1 2]

Writes ``<out>/<date>-<card>-dense-frag.json`` and prints a table last (the first ``--qg`` at the first ``--gm`` is
the headline: QG 64, GM 1 is the design as briefed; GM 2 has each warp multiply two 16-document groups at once,
so that each B fragment read from shared memory serves two MMAs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dense_gemm_ops as ops
from dense_mma import (
    PAD_ROWS,
    kernel,
    mma_ms,
    quantized_setup,
    query_operand,
    reference_checksum,
    reference_sums,
    run_mma,
    tiled_kernel_ms,
)
from gpu_peaks import gpu_memory
from kernels import time_events

K_STEP = 32  # rows an MMA multiplies (m16n8k32)
DOC_GROUP = 16  # documents of an A fragment
A_BYTES, B_BYTES = 512, 256  # one fragment block: 32 lanes × 16 bytes (A), 32 lanes × 8 bytes (B)
WARPS = 8


def step_start(layout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_start, step_start)``: tile ``t``'s dense rows are ``row_start[t]:row_start[t + 1]``, its
    k-steps (its rows padded with zero rows to a multiple of 32, 32 a step) ``step_start[t]:step_start[t + 1]``
    (int64 ``[n_tiles + 1]``)."""
    row_start, _ = ops.tile_dense_rows(layout)
    steps = torch.diff(row_start).add(K_STEP - 1).div(K_STEP, rounding_mode="floor")
    return row_start, torch.cat([steps.new_zeros(1), torch.cumsum(steps, 0)])


def padded_rows(row_start: torch.Tensor, steps0: torch.Tensor) -> torch.Tensor:
    """int64 ``[n_rows]``: the padded row of each dense row (tile ``t``'s ``k``-th row goes to ``32 · step_start[t]
    + k``)."""
    counts = torch.diff(row_start)
    dev = row_start.device
    tile_of = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)
    row = torch.arange(int(row_start[-1]), device=dev)
    return steps0[tile_of] * K_STEP + (row - row_start[tile_of])


def fragment_dense(layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, step_start, tile_block_start)``: ``a`` uint8 ``[blocks, 512]``, the 8-bit dense rows in A-fragment
    order; tile ``t``'s blocks are ``tile_block_start[t]:tile_block_start[t + 1]`` (``= step_start · TILE / 16``),
    the block of its 16-document group ``g`` and k-step ``s`` at ``tile_block_start[t] + g · steps[t] + s``.
    Byte ``16 · lane + 4 · r + i`` of a block is element ``i`` of lane ``lane``'s register ``a_r``: document
    ``16 g + lane // 4 + 8 · (r & 1)``, row ``32 s + 4 · (lane % 4) + 16 · (r >> 1) + i`` of the tile."""
    tile = 1 << layout.tile_bits
    n_groups = tile // DOC_GROUP
    row_start, steps0 = step_start(layout)
    n_steps = int(steps0[-1])
    dev = layout.dense.device
    dst = padded_rows(row_start, steps0)
    p = torch.zeros((n_steps * K_STEP, tile), dtype=torch.uint8, device=dev)
    p.index_copy_(0, dst, layout.dense[: dst.numel()])
    # p[step, k = (hi 2, tig 4, i 4), group, m = (lo 2, gid 8)] -> [step, group, gid, tig, hi, lo, i]
    y = p.view(n_steps, 2, 4, 4, n_groups, 2, 8).permute(0, 4, 6, 2, 1, 5, 3).reshape(n_steps * n_groups, A_BYTES)
    del p
    # blocks in (tile, group, step) order: block b of tile t, group g, step s reads y[(steps0[t] + s) · G + g]
    steps = torch.diff(steps0)
    tile_block = steps0 * n_groups
    n_blocks = n_steps * n_groups
    b = torch.arange(n_blocks, device=dev)
    t_of = torch.repeat_interleave(torch.arange(steps.numel(), device=dev), steps * n_groups)
    local = b - tile_block[t_of]
    n_t = steps[t_of]
    src_block = (steps0[t_of] + local % n_t) * n_groups + local // n_t
    return y[src_block].contiguous(), steps0, tile_block


def fragment_queries(layout, batch, n_queries: int, qg: int) -> tuple[torch.Tensor, int]:
    """``(b, n_blocks)``: ``b`` uint8 ``[n_steps, n_blocks · 256]``, the 8-bit query levels in B-fragment order;
    ``n_blocks`` blocks of 8 queries (the queries padded with zero levels to a multiple of ``qg``). Byte
    ``256 · nb + 8 · lane + 4 · h + i`` of k-step ``s`` (a tile's ``s``-th after ``step_start[t]``) is element
    ``i`` of lane ``lane``'s register ``b_h``: query ``8 · nb + lane // 4``, padded row ``32 s + 4 · (lane % 4) +
    16 h + i`` of the tile (0 for padding rows and padded queries)."""
    if qg % 8 or qg <= 0:
        raise ValueError(f"qg must be a positive multiple of 8, not {qg}")
    row_start, row_term = ops.tile_dense_rows(layout)
    _, steps0 = step_start(layout)
    levels, _ = ops.query_levels(batch.padded_weights)
    qmat = ops.query_matrix(batch.padded_terms, levels, layout.n_terms)  # [B, V + 1] int64, column V all 0
    n_steps = int(steps0[-1])
    bq = -(-max(n_queries, 1) // qg) * qg
    dst = padded_rows(row_start, steps0)
    term = torch.full((n_steps * K_STEP,), layout.n_terms, dtype=torch.int64, device=row_start.device)
    term[dst] = row_term
    vals = torch.zeros((n_steps * K_STEP, bq), dtype=torch.uint8, device=row_start.device)
    vals[:, : qmat.shape[0]] = qmat[:, term].T.to(torch.uint8)  # levels < 256
    # vals[step, k = (h 2, tig 4, i 4), nb, gid 8] -> [step, nb, gid, tig, h, i]
    b = vals.view(n_steps, 2, 4, 4, bq // 8, 8).permute(0, 4, 5, 2, 1, 3).reshape(n_steps, bq // 8 * B_BYTES)
    return b.contiguous(), bq // 8


def expected_sums(layout, qa: torch.Tensor, n_blocks_ref: int, tile: int, n_rows: int) -> torch.Tensor:
    """``dense_mma.reference_sums`` of tile ``tile`` with ``n_rows`` query rows (its padded queries are 0:
    cut, or extended with zero rows)."""
    ref = reference_sums(layout, qa, n_blocks_ref, tile)
    out = torch.zeros((n_rows, ref.shape[1]), dtype=torch.int64, device=ref.device)
    m = min(n_rows, ref.shape[0])
    out[:m] = ref[:m]
    return out


def min_blocks(qg: int, gm: int = 1) -> int:
    """The build's ``__launch_bounds__`` blocks an SM: the most whose register cap (65536 / (256 · blocks)) holds
    the ``gm · qg / 2`` accumulators without spilling (nvcc 13, sm_90: 62, 80, 128 registers at QG 32, 64, 128
    with GM 1; 80, 123 at QG 32, 64 with GM 2)."""
    acc = qg * gm
    return 4 if acc <= 32 else 3 if acc <= 64 else 2 if acc <= 128 else 1


def frag_kernel(device_index: int, qg: int = 64, pf: int = 2, gm: int = 1):  # -> cupy.RawKernel
    """``dense_frag.cu`` compiled for the device: ``QG = qg`` queries a block, ``PF = pf`` positions of a
    warp's A stream in flight, ``GM = gm`` document groups a warp multiplies at once (inline PTX, no
    headers)."""
    import cupy as cp

    code = (Path(__file__).resolve().parent / "dense_frag.cu").read_text()
    options = ("--std=c++17", f"-DQG={qg}", f"-DPF={pf}", f"-DGM={gm}", f"-DMINB={min_blocks(qg, gm)}")
    with cp.cuda.Device(device_index):
        return cp.RawModule(code=code, options=options).get_function("dense_frag")


def run_frag(fn, a, steps0, b, n_blocks, qg, tile, checksum, out=None, out_tiles=0, max_steps=None) -> None:
    """One launch over all tiles: ``a``, ``steps0`` from :func:`fragment_dense`, ``b``, ``n_blocks`` from
    :func:`fragment_queries` (same ``qg``); ``checksum`` int64 ``[1]``; ``out`` int32 ``[out_tiles, n_blocks · 8,
    tile]`` or None; ``max_steps`` a tile's most k-steps (read from ``steps0`` if None: a device sync)."""
    import cupy as cp

    from gpusparse.kernels.cupy_launch import cupy_stream, pointer

    n_tiles = steps0.numel() - 1
    if max_steps is None:
        max_steps = int(torch.diff(steps0).max()) if n_tiles else 0
    shared = max(1, max_steps * (qg // 8) * B_BYTES)  # the group's B fragments for the tile's steps
    args = (pointer(a), pointer(steps0), pointer(b), np.int32(n_blocks), np.int32(tile), pointer(checksum),
            pointer(out) if out is not None else np.uint64(0), np.int32(out_tiles))  # fmt: skip
    with cp.cuda.Device(a.device.index), cupy_stream(a.device):
        if shared > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = shared
        fn((n_tiles * (n_blocks * 8 // qg),), (WARPS * 32,), args, shared_mem=shared)


def check_frag(layout, a, steps0, batch, n_queries, build, qa, n_blocks_ref, check_tiles) -> tuple[dict, callable]:
    """The fragment kernel built with ``build = (qg, pf, gm)``: exactness (the first ``check_tiles`` tiles whole,
    every tile through the checksum) and a timed launch."""
    tile = 1 << layout.tile_bits
    qg, pf, gm = build
    if (tile // DOC_GROUP) % gm:
        raise SystemExit(f"dense_frag: GM {gm} does not divide the tile's {tile // DOC_GROUP} document groups")
    b, n_blocks = fragment_queries(layout, batch, n_queries, qg)
    fn = frag_kernel(a.device.index or 0, qg, pf, gm)
    checksum = torch.zeros(1, dtype=torch.int64, device=a.device)
    n_check = min(check_tiles, layout.n_tiles)
    out = torch.full((n_check, n_blocks * 8, tile), -7, dtype=torch.int32, device=a.device)
    run_frag(fn, a, steps0, b, n_blocks, qg, tile, checksum, out, n_check)
    torch.cuda.synchronize()
    sums = all(
        torch.equal(out[t].to(torch.int64), expected_sums(layout, qa, n_blocks_ref, t, n_blocks * 8))
        for t in range(n_check)
    )
    total = int(checksum.item()) % (1 << 64) == reference_checksum(layout, qa, n_blocks_ref) % (1 << 64)
    del out

    max_steps = int(torch.diff(steps0).max())

    def once() -> None:
        checksum.zero_()
        run_frag(fn, a, steps0, b, n_blocks, qg, tile, checksum, max_steps=max_steps)

    macs = int(steps0[-1]) * K_STEP * tile * n_blocks * 8
    res = {"qg": qg, "pf": pf, "gm": gm, "min_blocks": min_blocks(qg, gm), "n_queries_padded": n_blocks * 8,
           "b_bytes": b.numel(), "mma_macs": macs, "mma_instructions": macs // (16 * 8 * K_STEP),
           "exact_sums_checked_tiles": sums, "exact_checksum_all_tiles": total}  # fmt: skip
    return res, once


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8_841_823)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--qg", type=int, nargs="+", default=[64, 32, 128], help="queries a CUDA block (first: headline)")
    p.add_argument("--gm", type=int, nargs="+", default=[1, 2], help="document groups a warp multiplies at once")
    p.add_argument("--pf", type=int, default=2, help="positions of a warp's A stream in flight")
    p.add_argument("--check-tiles", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    t0 = time.perf_counter()
    index, queries, batch, layout = quantized_setup(args.n, args.batch, "dense_frag")
    build_s = time.perf_counter() - t0
    tile = 1 << layout.tile_bits
    dev = index.device
    qa, rmax, n_blocks_ref = query_operand(layout, batch, len(queries))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    a, steps0, _ = fragment_dense(layout)
    torch.cuda.synchronize()
    frag_s = time.perf_counter() - t1
    # the fragment kernel at each (QG, GM) (exactness, then timing)
    frag = []
    for gm in args.gm:
        for qg in args.qg:
            build = (qg, args.pf, gm)
            res, once = check_frag(layout, a, steps0, batch, len(queries), build, qa, n_blocks_ref, args.check_tiles)
            res["frag_dense_ms"] = statistics.median(time_events(once, reps=args.reps, warmup=2))
            frag.append(res)
    # the old WMMA kernel (dense_mma.py), same layout and queries
    row_start = ops.tile_dense_rows(layout)[0].contiguous()
    dense_pad = torch.cat([layout.dense, torch.zeros((PAD_ROWS, tile), dtype=torch.uint8, device=dev)])
    fn = kernel(dev.index or 0, rmax)
    checksum = torch.zeros(1, dtype=torch.int64, device=dev)
    run_mma(fn, dense_pad, row_start, qa, n_blocks_ref, rmax, tile, checksum)
    torch.cuda.synchronize()
    mma_exact = int(checksum.item()) % (1 << 64) == reference_checksum(layout, qa, n_blocks_ref) % (1 << 64)

    wmma_ms = mma_ms(fn, dense_pad, row_start, qa, n_blocks_ref, rmax, tile, checksum, args.reps)
    # the engine's kernel, one launch over all tiles, with and without its dense phase
    full_ms, skip_ms = tiled_kernel_ms(index, layout, batch, args.reps)
    counts = torch.diff(row_start)
    steps = torch.diff(steps0)
    n_steps = int(steps0[-1])
    res = {
        "card": torch.cuda.get_device_name(0), "commit": args.commit, "date": dt.datetime.now(dt.UTC).isoformat(),
        "command": " ".join(sys.argv), "n_docs": args.n, "batch": args.batch, "tile_bits": layout.tile_bits,
        "n_tiles": layout.n_tiles, "dense_rows": int(row_start[-1]), "rows_per_tile_mean": float(counts.float().mean()),
        "k_steps": n_steps, "steps_per_tile_max": int(steps.max()), "rows_padded_to_32": n_steps * K_STEP,
        "dense_bytes": layout.dense.numel(), "frag_a_bytes": a.numel(),
        "frag_macs_per_query": n_steps * K_STEP * tile, "mma_instructions_per_8_queries": n_steps * tile // DOC_GROUP,
        "index_build_s": build_s, "fragment_build_s": frag_s, "frag": frag,
        "mma_dense_ms": wmma_ms, "mma_exact_checksum_all_tiles": mma_exact, "tiled_kernel_ms": full_ms,
        "tiled_kernel_without_dense_ms": skip_ms, "tiled_dense_phase_ms": full_ms - skip_ms, "gpu_memory": gpu_memory(),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{dt.date.today().isoformat()}-{res['card'].split()[-1]}-dense-frag.json"
    (args.out / name).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "gpu_memory"}))
    print(f"{'what':44} {'ms':>8}")
    for r in frag:
        exact = r["exact_sums_checked_tiles"] and r["exact_checksum_all_tiles"]
        what = f"fragment-order MMA dense part, QG {r['qg']} GM {r['gm']}"
        print(f"{what:44} {r['frag_dense_ms']:8.3f}   exact: {exact}")
    print(f"{'WMMA dense part (dense_mma.cu)':44} {wmma_ms:8.3f}   exact: {mma_exact}")
    print(f"{'tiled kernel, top-10, one launch':44} {full_ms:8.3f}")
    print(f"{'tiled kernel without its dense phase':44} {skip_ms:8.3f}")
    print(f"{'  so its dense phase':44} {full_ms - skip_ms:8.3f}")
    print(f"fragment operand {a.numel() / 1e9:.2f} GB vs layout.dense {layout.dense.numel() / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
