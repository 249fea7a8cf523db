"""Issue 23: the 8-bit dense phase on tensor cores with the sums kept on chip (a measurement).

The third session's prototype (``bench/dense_gemm.py``) ran the dense rows as unfused GEMMs and
lost to the tiled kernel's own dense phase: its output, a ``[B, N]`` matrix, went to memory. This
one measures the fused form's cost: one CUDA block per (tile, group of 64 queries) multiplies the
tile's dense rows (uint8 levels, the engine's 8-bit layout as it is) by the group's 8-bit query
levels for those rows on tensor cores (WMMA m32n8k16, u8 × u8 → s32: exact), 32 documents a warp
at a time, and keeps the sums in registers; only a checksum leaves (``bench/dense_mma.cu``). That is
the work a fused kernel's dense phase would do before adding its sparse postings and selecting.

Same run, same layout and queries: the tiled kernel at batch 256 over all tiles (one launch, top-10),
and the same kernel built without its dense phase (``PROFILE_SKIP_DENSE``, results wrong: timing
only); their difference is today's dense phase. Exactness: every sum of the first ``--check-tiles``
tiles against a float64 product of the same operands, and the checksum over all tiles against the
exact total ``Σ_rows (Σ_q level) · (Σ_docs level)``.

Usage (GPU machine; ~1-2 minutes; ~20 GB at 8.8M documents):

    python bench/dense_mma.py --out $OUT --commit SHA [--n 8841823] [--batch 256]

Writes ``<out>/<date>-<card>-dense-mma.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dense_gemm_ops as ops
from gpu_peaks import gpu_memory
from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.engines.tiled.engine import layout_for_search
from gpusparse.engines.tiled.fixed_point import fixed_point, integer_weights
from gpusparse.layout.statistics import max_scores_host
from gpusparse.queries import prepare_queries, query_batch
from gpusparse.synthetic import generate
from kernels import time_events
from launch_shape import candidates

QUERIES_PER_BLOCK = 64  # the kernel's QB * 8
PAD_ROWS = 16  # zero rows after the last dense row: a tile's last k-step may read past its rows


def query_operand(layout, batch, n_queries: int) -> tuple[torch.Tensor, int, int]:
    """``(qa, rmax, n_blocks)``: ``qa [n_tiles, rmax, n_blocks · 32]`` uint8, the 8-bit level of query
    ``q`` for the term of each tile's ``k``-th dense row at ``qa[t, k, (q // 8) · 32 + q % 8]`` (0 where
    the query lacks the term, in the padding rows and for padded queries); ``rmax`` the largest number
    of a tile's dense rows, rounded up to 16; ``n_blocks`` the queries (padded to a multiple of 64) / 8."""
    row_start, row_term = ops.tile_dense_rows(layout)
    levels, _ = ops.query_levels(batch.padded_weights)
    qmat = ops.query_matrix(batch.padded_terms, levels, layout.n_terms)  # [B, V + 1] int64
    n_tiles = layout.n_tiles
    counts = torch.diff(row_start)
    rmax = max(16, -(-int(counts.max()) // 16) * 16) if counts.numel() else 16
    bq = -(-max(n_queries, 1) // QUERIES_PER_BLOCK) * QUERIES_PER_BLOCK
    n_blocks = bq // 8
    dev = row_start.device
    qa = torch.zeros((n_tiles, rmax, n_blocks, 32), dtype=torch.uint8, device=dev)
    n_rows = row_term.numel()
    if n_rows:
        tile_of = torch.repeat_interleave(torch.arange(n_tiles, device=dev), counts)
        k_of = torch.arange(n_rows, device=dev) - row_start[tile_of]
        vals = torch.zeros((n_rows, bq), dtype=torch.uint8, device=dev)
        vals[:, : qmat.shape[0]] = qmat[:, row_term].T.to(torch.uint8)  # levels < 256
        qa[tile_of, k_of, :, :8] = vals.view(n_rows, n_blocks, 8)
    return qa.view(n_tiles, rmax, n_blocks * 32), rmax, n_blocks


def reference_sums(layout, qa: torch.Tensor, n_blocks: int, tile: int) -> torch.Tensor:
    """int64 ``[n_blocks · 8, TILE]``: every (query, document) sum of tile ``tile``'s dense rows, in float64
    (exact: below 2**53)."""
    row_start, _ = ops.tile_dense_rows(layout)
    lo, hi = int(row_start[tile]), int(row_start[tile + 1])
    q = qa[tile, : hi - lo].view(hi - lo, n_blocks, 32)[:, :, :8].reshape(hi - lo, n_blocks * 8)
    d = layout.dense[lo:hi]
    return (q.to(torch.float64).T @ d.to(torch.float64)).to(torch.int64)


def reference_checksum(layout, qa: torch.Tensor, n_blocks: int) -> int:
    """The sum of every (query, document) dense sum over all tiles: ``Σ_rows (Σ_q level) · (Σ_docs level)``."""
    row_start, _ = ops.tile_dense_rows(layout)
    counts = torch.diff(row_start)
    n_rows = int(row_start[-1])
    if n_rows == 0:
        return 0
    tile_of = torch.repeat_interleave(torch.arange(layout.n_tiles, device=counts.device), counts)
    k_of = torch.arange(n_rows, device=counts.device) - row_start[tile_of]
    q = qa.view(layout.n_tiles, qa.shape[1], n_blocks, 32)[tile_of, k_of, :, :8].to(torch.int64).sum((1, 2))
    d = layout.dense.to(torch.int64).sum(1)
    return int((q * d).sum())


def kernel(device_index: int, rmax: int = 128):  # -> cupy.RawKernel
    """``dense_mma.cu`` compiled for the device (NVRTC needs the toolkit's headers for ``mma.h``)."""
    import os

    import cupy as cp

    code = (Path(__file__).resolve().parent / "dense_mma.cu").read_text()
    options = ["--std=c++17", f"-DKMAX={max(1, rmax // 16)}"]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "mma.h").exists():
            options.append(f"-I{Path(root) / 'include'}")
            break
    with cp.cuda.Device(device_index):
        return cp.RawModule(code=code, options=tuple(options)).get_function("dense_mma")


def run_mma(fn, dense_pad, row_start, qa, n_blocks, rmax, tile, checksum, out=None, out_tiles=0) -> None:
    import cupy as cp

    from gpusparse.kernels.cupy_launch import cupy_stream, pointer

    n_tiles = row_start.numel() - 1
    args = (pointer(dense_pad), pointer(row_start), pointer(qa), np.int32(n_blocks), np.int32(rmax),
            np.int32(tile), pointer(checksum), pointer(out) if out is not None else np.uint64(0),
            np.int32(out_tiles))  # fmt: skip
    shared = rmax * (QUERIES_PER_BLOCK // 8 * 32 + 32)  # the group's query levels: rmax rows of SQ bytes
    with cp.cuda.Device(dense_pad.device.index), cupy_stream(dense_pad.device):
        fn((n_tiles, n_blocks // 8), (256,), args, shared_mem=shared)


def mma_ms(fn, dense_pad, row_start, qa, n_blocks, rmax, tile, checksum, reps: int) -> float:
    """Median ms of the WMMA kernel over the whole layout (checksum only), CUDA events."""

    def once() -> None:
        checksum.zero_()
        run_mma(fn, dense_pad, row_start, qa, n_blocks, rmax, tile, checksum)

    return statistics.median(time_events(once, reps=reps, warmup=2))


def quantized_setup(n: int, n_queries: int, name: str):
    """``(index, queries, batch, layout)``: ``n`` calibrated synthetic documents in an 8-bit index on the
    GPU, ``n_queries`` prepared queries, their batch on the device and the index's 8-bit tiled layout."""
    vocab = Vocabulary.bert()
    (di, dt_, dw), (qi, qt, qw) = generate(n, n_queries, seed=0, device="cuda")
    index = Index.from_csr(di, dt_, dw, vocab, device="cuda", quantize=8)
    del di, dt_, dw
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    queries = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
    layout = layout_for_search(index)
    if not layout.quantized:
        raise SystemExit(f"{name}: the 8-bit layout is expected")
    return index, queries, query_batch(queries, index.device), layout


def tiled_kernel_ms(index, layout, batch, reps: int) -> tuple[float, float]:
    """The engine's kernel at top-10, one launch over all tiles with each block's own selection
    (bench/launch_shape.py), then built without its dense phase (``PROFILE_SKIP_DENSE``, results wrong):
    median ms of each; their difference is the dense phase."""
    fp = fixed_point(index, batch, "u32", layout.weight_bits)
    int_w = integer_weights(layout, batch, fp, "u32")
    full, _ = candidates(layout, batch, fp, int_w, 10)
    full_ms = statistics.median(time_events(full, reps=reps, warmup=2))
    skip, _ = candidates(layout, batch, fp, int_w, 10, defines=("PROFILE_SKIP_DENSE",))
    return full_ms, statistics.median(time_events(skip, reps=reps, warmup=2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8_841_823)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--check-tiles", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    index, queries, batch, layout = quantized_setup(args.n, args.batch, "dense_mma")
    tile = 1 << layout.tile_bits
    row_start, _ = ops.tile_dense_rows(layout)
    row_start = row_start.contiguous()
    qa, rmax, n_blocks = query_operand(layout, batch, len(queries))
    dense_pad = torch.cat([layout.dense, torch.zeros((PAD_ROWS, tile), dtype=torch.uint8, device="cuda")])
    fn = kernel(index.device.index or 0, rmax)
    checksum = torch.zeros(1, dtype=torch.int64, device="cuda")
    # exactness: the first tiles whole, every tile through the checksum
    out = torch.full((args.check_tiles, n_blocks * 8, tile), -7, dtype=torch.int32, device="cuda")
    run_mma(fn, dense_pad, row_start, qa, n_blocks, rmax, tile, checksum, out, args.check_tiles)
    torch.cuda.synchronize()
    sums_exact = all(
        torch.equal(out[t].to(torch.int64), reference_sums(layout, qa, n_blocks, t))
        for t in range(min(args.check_tiles, layout.n_tiles))
    )
    checksum_exact = int(checksum.item()) % (1 << 64) == reference_checksum(layout, qa, n_blocks) % (1 << 64)
    del out

    wmma_ms = mma_ms(fn, dense_pad, row_start, qa, n_blocks, rmax, tile, checksum, args.reps)
    full_ms, skip_ms = tiled_kernel_ms(index, layout, batch, args.reps)
    counts = torch.diff(row_start)
    rows = {"dense_rows": int(row_start[-1]), "rows_per_tile_mean": float(counts.float().mean()), "rmax": rmax,
            "dense_bytes": layout.dense.numel(), "qa_bytes": qa.numel()}  # fmt: skip
    macs = int(counts.add(15).div(16, rounding_mode="floor").mul(16).sum()) * tile * n_blocks * 8
    res = {
        "card": torch.cuda.get_device_name(0), "commit": args.commit, "date": dt.datetime.now(dt.UTC).isoformat(),
        "command": " ".join(sys.argv), "n_docs": args.n, "batch": args.batch, "tile_bits": layout.tile_bits,
        **rows, "mma_macs": macs, "exact_sums_checked_tiles": sums_exact, "exact_checksum_all_tiles": checksum_exact,
        "mma_dense_ms": wmma_ms, "tiled_kernel_ms": full_ms, "tiled_kernel_without_dense_ms": skip_ms,
        "tiled_dense_phase_ms": full_ms - skip_ms, "gpu_memory": gpu_memory(),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{dt.date.today().isoformat()}-{res['card'].split()[-1]}-dense-mma.json"
    (args.out / name).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "gpu_memory"}))
    print(f"{'what':40} {'ms':>8}")
    print(f"{'tensor-core dense part (all tiles, B)':40} {wmma_ms:8.3f}   exact: {sums_exact and checksum_exact}")
    print(f"{'tiled kernel, top-10, one launch':40} {full_ms:8.3f}")
    print(f"{'tiled kernel without its dense phase':40} {skip_ms:8.3f}")
    print(f"{'  so its dense phase':40} {full_ms - skip_ms:8.3f}")


if __name__ == "__main__":
    main()
