"""The tiled engine's CUDA kernel: on-chip accumulation per (document tile, query), compiled at run time.

Documents are cut into tiles of ``2**TILE_BITS``; the postings of each (tile, term) pair are
stored together as offsets inside the tile and weights (:mod:`gpusparse.layout.tiled`; float32
ones packed in 5 bytes where they allow it, :mod:`gpusparse.layout.packing`). One thread
block handles one (query, tile): it accumulates the query's scores for the whole tile in
shared memory, so no ``[B, N]`` buffer exists and the only device-memory traffic is reading
postings (blocks of the same tile run together and share them through L2) and writing a few
candidates.

Scores are accumulated in fixed point (ACC_MODES: 32-bit sums, or 64 bits as two 32-bit
halves): every product ``w_q · w_d`` is scaled by the query's power-of-two ``scale`` and
rounded to an integer (or, with fixed-point weights, computed in integers), so the sum is
exact integer arithmetic, independent of the order of the atomics, within a bounded number
of units of the true sum. After accumulating, the block finds by a two-pass
radix histogram a value ``tau`` that at least ``k`` of its documents reach, raises the
query's running threshold ``theta`` to it (a lower bound of the k-th best score of the
whole collection), and emits every document within the error margin ``delta`` of
``max(tau, theta)`` as a candidate. Triton cannot express shared-memory atomics, hence CUDA
(``cuda/tile_candidates.cu``, compiled through CuPy's NVRTC by :mod:`.cupy_launch`, whose
``available`` says whether it can run here). In large 8-bit batches the launches without
selection read each block's term metadata from records written by a second kernel of the same
source (``tile_meta``, :func:`meta_scratch`). The compaction of a wave's candidates is
:mod:`.compact`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..layout.packing import kernel_bias
from ..layout.tiled import OCT
from .cupy_launch import available, check_tensors, device_index, launch, load_kernel, pointer, variant_of

if TYPE_CHECKING:
    from ..layout.tiled import TiledIndex

__all__ = [
    "ACC_MODES",
    "ACC_TOP",
    "SOURCE",
    "available",
    "block_shared_bytes",
    "launch_shape",
    "meta_bytes",
    "meta_scratch",
    "shared_bytes",
    "tiled_candidates",
    "write_records",
]

SOURCE = "tile_candidates.cu"  # in kernels/cuda/
UNROLL = 4  # sparse postings per thread and step (the default of tiled_candidates' unroll)
LARGE_BATCH = 128  # launches of this many queries or more on 8-bit levels: launch_shape's fifth block
SHORT_WIDTH = 128  # ... of queries of at most this many terms: a sixth (the build's MAXT is 128)
_SM_SHARED = 228 << 10  # shared memory of an SM (H100, H200) for its resident blocks
# Accumulator modes (see the CUDA source) and the largest fixed-point value each holds: a query's
# scale keeps its score bound at or below ``top`` (rounding adds at most n/2 units).
ACC_MODES = {"carry": 0, "u32": 1}
ACC_TOP = {"carry": 2.0**61, "u32": 2.0**31}
# float32 weights; uint8 levels of a quantized index; int32 fixed-point integers.
_WEIGHT_TYPES = {torch.float32: "float", torch.uint8: "unsigned char", torch.int32: "unsigned int"}
# The records of META launches (see the CUDA source) take 8 bytes a query term (padded width + 1)
# a (query, tile) block; a launch whose records would pass this many bytes is cut into launches of
# as many tiles as fit.
META_MAX_BYTES = 256 << 20
META_TILES = 4  # tiles a warp of tile_meta takes at most (see meta_tiles)
META_MIN_BATCH = LARGE_BATCH  # the META build is a six-block one (launch_shape): batches of LARGE_BATCH or more


def launch_shape(
    tile_bits: int,
    acc: str = "u32",
    *,
    batch: int | None = None,
    levels: bool = False,
    width: int | None = None,
    threads: int | None = None,
    min_blocks: int | None = None,
) -> tuple[int, int]:
    """``(threads, min_blocks)`` for tiles of ``2**tile_bits`` documents and a launch of ``batch``
    queries of ``width`` terms (padded) on a layout of 8-bit ``levels`` or not; ``threads`` and
    ``min_blocks`` (threads per block, resident blocks per SM the registers must allow), where
    given, replace the choice below (profiling sweeps them).

    Measured at 8.8M x 256 on an H200 (bench/results/2026-11-26-H200-profile-tiled-8.8M-v12-shape.json):
    at 8K documents a tile, 256 threads (32 documents each in the dense phase) with room in
    the registers for 4 blocks per SM beat 512 threads with 3 (search 14.5 against 15.4 ms
    at k = 1000), and 2 blocks were slowest. Larger tiles keep 32 documents a thread (at
    most 1,024 threads); the blocks per SM are what shared memory and the SM's 2,048
    threads allow. At batch 1 (one block a tile) the default is within 3 % of the best build
    measured (kernel alone, in CUDA graphs: bench/results/2026-11-27-H200-launch-shape-graphs.json).
    On 8-bit levels, batches of :data:`LARGE_BATCH` queries or more take a fifth block where
    shared memory has room for it (registers for 5 blocks: a few spilled values): the search's
    kernel at 8.8M x 256 was 9 % faster; at batches of 1 and 32 (all tiles in one launch) 7-17 %
    slower, and on float32 fixed point 8-12 % slower (bench/results/2026-11-27-H200-anatomy-b256-*blocks-cf9dc72.json,
    -launch-shape-blocks-1c08add.json). With the 8-bit dense phase two rows at a time (fewer
    registers), such a launch of queries of at most :data:`SHORT_WIDTH` terms takes a sixth
    block (a build whose static shared memory holds 128 terms' metadata at once, not 256):
    the search's kernel at 8.8M x 256 was 2-4 % faster than the five-block build, and the old
    dense loop with six blocks 31 % slower (it spills;
    bench/results/2026-11-27-H100-anatomy-b256-q8-six-blocks-8c3192c.json, -pairs-variants.json).
    """
    tile = 1 << tile_bits
    threads = threads or min(tile, max(256, tile >> 5), 1024)
    large = levels and batch is not None and batch >= LARGE_BATCH
    short = width is not None and width <= SHORT_WIDTH
    most = (6 if large and short else 5 if large else 4) if threads <= 256 else 3
    blocks = min_blocks or max(1, min(most, 2048 // threads))
    while blocks > 1 and blocks * block_shared_bytes(tile_bits, acc, blocks) > _SM_SHARED:
        blocks -= 1
    return threads, min_blocks or blocks


def octs_readable(x: torch.Tensor) -> bool:
    """Whether the kernel may read ``x`` (a layout's sparse offsets or weights) in aligned groups
    of :data:`~gpusparse.layout.tiled.OCT` elements (its OCTS build): the data aligned to such a
    group, and the storage readable up to the end of the group holding the last element
    (:func:`~gpusparse.layout.tiled.sparse_array` allocates them so)."""
    size = x.element_size()
    if x.data_ptr() % (OCT * size):
        return False
    storage = x.untyped_storage()
    return x.data_ptr() + -(-x.numel() // OCT) * OCT * size <= storage.data_ptr() + storage.nbytes()


def layout_octs(layout: TiledIndex) -> bool:
    """Whether the kernel may read the layout's sparse offsets and weights eight at a time (the
    OCTS build): :func:`octs_readable` of both."""
    return octs_readable(layout.offs) and octs_readable(layout.wts)


def block_shared_bytes(tile_bits: int, acc: str, min_blocks: int) -> int:
    """Shared memory one block holds on an SM, a bound: the tile's accumulators, the build's
    static arrays (at most 28 bytes a query term of its MAXT, which is 128 for builds of six
    blocks or more, else 256, plus ~1.1 KB; ptxas: 7,264 and 4,208 bytes for the 8-bit builds)
    and the 1 KB the device reserves for each block."""
    maxt = 128 if min_blocks >= 6 else 256
    return shared_bytes(tile_bits, acc) + 28 * maxt + 1152 + 1024


def shared_bytes(tile_bits: int, acc: str) -> int:
    """Dynamic shared memory of one block: the tile's accumulators."""
    return (4 if acc == "u32" else 8) << tile_bits


def compile_options(
    tile_bits: int,
    threads: int,
    unroll: int,
    min_blocks: int,
    acc: str,
    weight_type: str,
    int_weights: bool,
    fixed: bool = False,
    defines: Sequence[str] = (),
    packed: bool = False,
    select: bool = True,
    dense_lists: bool = False,
    octs: bool = False,
    meta: bool = False,
) -> tuple[str, ...]:
    """The NVRTC options of one build of the kernel (``defines``: extra ``-D`` names, profiling only)."""
    return (
        "--std=c++17",
        f"-DTILE_BITS={tile_bits}",
        f"-DTHREADS={threads}",
        f"-DUNROLL={unroll}",
        f"-DMIN_BLOCKS={min_blocks}",
        f"-DACC_MODE={ACC_MODES[acc]}",
        f"-DWT={weight_type.replace(' ', '_')}",
        f"-DINT_W={int(int_weights and not fixed)}",
        f"-DFIXED_W={int(fixed)}",
        f"-DFIXED_STORED={int(fixed and weight_type == 'unsigned int')}",
        f"-DPACKED={int(packed)}",
        f"-DSELECT={int(select)}",
        f"-DDENSE_LISTS={int(dense_lists)}",
        f"-DOCTS={int(octs)}",
        f"-DMETA={int(meta)}",
        *(f"-D{d}" for d in defines),
    )


@functools.cache
def _kernel(build: tuple, device: int, variant: tuple[str, tuple[str, ...]], name: str = "tiled_candidates"):
    # -> cupy.RawKernel. One look-up per launch instead of building the options and the compile
    # cache's key (the launch is on the host's critical path, several times a search); ``variant``
    # (what variant_of says here) is part of the key so that a benchmark's variant builds its own.
    options = compile_options(*build)
    shared = shared_bytes(build[0], build[4]) if name == "tiled_candidates" else 0
    return load_kernel(SOURCE, name, options=options, device=device, max_dynamic_shared=shared)


def _meta_build(
    layout: TiledIndex,
    width: int,
    *,
    acc: str,
    int_weights: bool,
    dense_lists: bool,
    threads: int,
    min_blocks: int,
    octs: bool,
) -> bool:
    """Whether a launch without selection takes the META build: the kernel's PAIRS and OCTS
    conditions (``octs``: :func:`layout_octs`), in the six-block build (measured there), whose
    MAXT (128) bounds the width."""
    pairs = acc == "u32" and int_weights and layout.weight_bits is None and not dense_lists
    pairs = pairs and layout.dense.dtype == torch.uint8 and (1 << layout.tile_bits) // threads >= 8
    return pairs and octs and min_blocks >= 6 and width <= SHORT_WIDTH


def meta_tiles(tiles: int) -> int:
    """The consecutive tiles each warp of ``tile_meta`` takes in a launch over ``tiles`` tiles (one
    warp a query and group of tiles): one per 32 tiles of the launch, from 1 to :data:`META_TILES`.

    A warp loads its query's terms once and keeps the next tile's loads in flight while it writes a
    record; a small launch needs more warps to fill the GPU. At 8.8M x 256 on an H200 (2 tiles a
    warp in the 64-tile launch and 4 in the 506-tile ones, against 8 in all): ``tile_meta`` 0.171
    against 0.174 ms of the search's graph at top-10, 0.174 against 0.183 at top-1000; the graph
    3.136 against 3.143 and 3.418 against 3.427 ms (bench/results/2026-11-27-H200-meta-tiles-566a0f6.json)."""
    return max(1, min(META_TILES, tiles // 32))


def meta_bytes(b: int, width: int, tiles: int) -> int:
    """Bytes of the records' buffer (:func:`meta_scratch`) for launches of ``tiles`` tiles of ``b``
    queries padded to ``width`` terms where they take the META build: at most
    :data:`META_MAX_BYTES`; 0 for batches of fewer than :data:`META_MIN_BATCH` queries."""
    per_tile = b * (width + 1) * 8
    if b < META_MIN_BATCH or tiles == 0 or width == 0 or per_tile > META_MAX_BYTES:
        return 0
    return min(tiles, META_MAX_BYTES // per_tile) * per_tile


def meta_scratch(
    layout: TiledIndex, q_terms: torch.Tensor, tiles: int, *, acc: str, int_weights: bool, dense_lists: bool = False
) -> torch.Tensor | None:
    """The records' buffer for launches of ``tiles`` tiles without selection over this batch
    (``q_terms`` ``[B, T]``), bounded by :data:`META_MAX_BYTES` (longer launches are cut); ``None``
    where such launches do not take the META build."""
    b, t = q_terms.shape
    threads, min_blocks = launch_shape(layout.tile_bits, acc, batch=b, levels=layout.quantized, width=t)
    nbytes = meta_bytes(b, t, tiles)
    octs = layout_octs(layout)
    if not nbytes or not _meta_build(
        layout, t, acc=acc, int_weights=int_weights, dense_lists=dense_lists, threads=threads, min_blocks=min_blocks,
        octs=octs,
    ):  # fmt: skip
        return None
    return torch.empty(nbytes // 4, dtype=torch.int32, device=q_terms.device)


def tiled_candidates(
    layout: TiledIndex,
    q_terms: torch.Tensor,
    q_weights: torch.Tensor,
    q_scale: torch.Tensor,
    q_delta: torch.Tensor,
    *,
    k: int,
    tiles: tuple[int, int] | None = None,
    select: bool = True,
    acc: str = "carry",
    int_weights: bool = False,
    q_shift: torch.Tensor | None = None,
    theta: torch.Tensor,
    cand_count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
    threads: int | None = None,
    unroll: int = UNROLL,
    min_blocks: int | None = None,
    defines: Sequence[str] = (),
    lists: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    meta: torch.Tensor | None = None,
) -> None:
    """Launch ``cuda/tile_candidates.cu``'s kernel over ``layout`` on the current PyTorch stream
    (see the module docstring).

    The layout's arrays (:class:`~gpusparse.layout.tiled.TiledIndex`: float32, uint8 or int32
    weights, packed or not) and these must be contiguous on one CUDA device: ``q_terms`` int32
    and ``q_weights`` float32 ``[B, T]``, ``q_scale`` float64 and ``q_delta`` int64 ``[B]``,
    ``theta`` int64 ``[B]`` (zeros, updated), ``cand_count`` int32 ``[B]`` (zeros, updated),
    ``cand_doc`` int32 and ``cand_val`` int64 ``[B, cap]`` (written). ``tiles = (first, count)``
    restricts the launch to a range of tiles (default: all). ``select=False`` skips each
    block's own k-th selection and relies on ``theta`` alone (for waves after the first); it is
    a build of its own, without the selection's code, whose blocks read ``theta`` once, at
    their start (no block of such a launch raises it).
    ``acc`` is the accumulator mode (:data:`ACC_MODES`); the caller's scales must keep every
    sum within its :data:`ACC_TOP`. ``int_weights`` (with "u32" only): every
    ``q_weights · q_scale`` is an integer (checked by the caller), so the kernel multiplies
    integers. The layout's ``weight_bits`` (float32 weights, "u32" only): fixed-point products
    (FIXED_W): each float32 weight is read as ``round(w · 2**weight_bits)`` (int32 weights:
    stored so), each query weight rounded to ``round(q_weights · q_scale)`` and each product
    shifted right by the query's ``q_shift`` (int32 ``[B]``).

    ``lists``: the index's ``(doc_ids, scores, offsets, lengths)`` (int32, float32, int64, int32,
    on the device) for a fixed-point layout with :attr:`~gpusparse.layout.tiled.TiledIndex.list_pos`:
    the dense terms' postings are then read from their lists instead of the dense rows (the same
    sums; fewer bytes where a row serves few queries, as at batch 1).

    ``meta``: a buffer from :func:`meta_scratch`, for a launch without selection: each block then
    reads its terms' metadata from a record that the ``tile_meta`` kernel writes just before (the
    META build; the same sums), the tiles taken as many at a time as the buffer holds. Ignored
    where that build does not apply.

    Build knobs, for profiling: ``threads`` and ``min_blocks`` (default: :func:`launch_shape`'s
    choice), ``unroll`` (sparse postings per thread and step), ``defines`` (extra ``-D`` names:
    ``PROFILE_SKIP_DENSE`` and ``PROFILE_SKIP_SPARSE`` time one phase without the other; their
    results are wrong). Each combination is compiled once per device.
    """
    b, t = q_terms.shape
    cap = cand_doc.shape[1]
    n_docs, n_terms, tile_bits, weight_bits = layout.n_docs, layout.n_terms, layout.tile_bits, layout.weight_bits
    n_tiles = layout.n_tiles
    dense, wdtype = layout.dense, layout.dense.dtype
    packed = layout.packed
    expected = {
        "seg": (layout.seg, torch.int32),
        "tile_start": (layout.tile_start, torch.int64),
        "offs": (layout.offs, torch.int32 if packed else torch.int16),
        "wts": (layout.wts, torch.uint8 if packed else wdtype),
        "dense_id": (layout.dense_id, torch.int16),
        "dense_start": (layout.dense_start, torch.int32),
        "dense": (dense, wdtype if wdtype in _WEIGHT_TYPES else torch.float32),
        "q_terms": (q_terms, torch.int32),
        "q_weights": (q_weights, torch.float32),
        "q_scale": (q_scale, torch.float64),
        "q_delta": (q_delta, torch.int64),
        "theta": (theta, torch.int64),
        "cand_count": (cand_count, torch.int32),
        "cand_doc": (cand_doc, torch.int32),
        "cand_val": (cand_val, torch.int64),
    }
    dev = layout.seg.device
    if acc not in ACC_MODES:
        raise ValueError(f"acc must be one of {sorted(ACC_MODES)}")
    if int_weights and acc != "u32":
        raise ValueError('int_weights needs acc="u32"')
    fixed = weight_bits is not None
    if fixed and (acc != "u32" or q_shift is None or wdtype == torch.uint8):
        raise ValueError('fixed-point products need float32 or int32 weights, acc="u32" and q_shift')
    if wdtype == torch.int32 and not fixed:
        raise ValueError("int32 weights are fixed-point integers: give their weight_bits")
    if packed and wdtype != torch.float32:
        raise ValueError("packed postings hold float32 weights")
    expected["q_shift"] = (cand_count if q_shift is None else q_shift, torch.int32)  # None: any int32, not read
    if layout.doc_of is not None:
        expected["doc_of"] = (layout.doc_of, torch.int32)
    if lists is not None:
        if not fixed or layout.list_pos is None or wdtype == torch.uint8:
            raise ValueError("dense terms from the lists need a fixed-point layout with list positions")
        for name, x, dtype in zip(("doc_ids", "scores", "offsets", "lengths"), lists,
                                  (torch.int32, torch.float32, torch.int64, torch.int32), strict=True):  # fmt: skip
            expected[name] = (x, dtype)
        expected["list_pos"] = (layout.list_pos, torch.int32)
    check_tensors(expected, dev)
    q_shift = expected["q_shift"][0]
    if layout.seg.numel() != n_tiles * (n_terms + 1) or layout.dense_id.numel() != n_tiles * n_terms:
        raise ValueError("seg and dense_id do not match n_docs, n_terms and tile_bits")
    if layout.tile_start.numel() != n_tiles + 1 or layout.dense_start.numel() != n_tiles + 1:
        raise ValueError("tile_start and dense_start need one entry per tile, plus one")
    first, count = (0, n_tiles) if tiles is None else tiles
    if not (first >= 0 and count >= 0 and first + count <= n_tiles):
        raise ValueError(f"tile range {tiles} outside 0..{n_tiles}")
    if count > 65535:
        raise ValueError(f"{count} tiles exceed the grid's y limit; use larger tiles or waves")
    if b == 0 or count == 0 or t == 0:
        return
    bias = kernel_bias(layout.exp_base, weight_bits) if packed else 0  # type: ignore[arg-type]
    threads, min_blocks = launch_shape(
        tile_bits, acc, batch=b, levels=wdtype == torch.uint8, width=t, threads=threads, min_blocks=min_blocks
    )
    shared = shared_bytes(tile_bits, acc)
    octs = layout_octs(layout)
    use_meta = meta is not None and not select and _meta_build(
        layout, t, acc=acc, int_weights=int_weights, dense_lists=lists is not None, threads=threads,
        min_blocks=min_blocks, octs=octs,
    )  # fmt: skip
    if use_meta:
        check_tensors({"meta": (meta, torch.int32)}, dev)
        if meta.numel() < 2 * b * (t + 1):
            raise ValueError(f"meta holds {meta.numel()} int32, fewer than one tile's records ({2 * b * (t + 1)})")
    build = (tile_bits, threads, unroll, min_blocks, acc, _WEIGHT_TYPES[wdtype], int_weights, fixed, tuple(defines),
             packed, bool(select), lists is not None, octs, use_meta)  # fmt: skip
    kernel = _kernel(build, device_index(dev), variant_of(SOURCE))
    if dense.numel() == 0:  # CuPy wants real memory behind every pointer
        dense = torch.zeros((1, 1 << tile_bits), dtype=wdtype, device=dev)
    arrays = (layout.seg, layout.tile_start, layout.offs, layout.wts, layout.dense_id, layout.dense_start, dense)
    args = [pointer(x) for x in (*arrays, q_terms, q_weights, q_scale, q_delta, q_shift)]
    args += [np.float32(2.0 ** (weight_bits or 0)), np.uint32(bias)]
    ints = [np.int32(t), np.int32(n_terms), np.int32(n_docs), np.int32(k), np.int32(first), np.int32(select)]
    outs = [pointer(x) for x in (theta, cand_count, cand_doc, cand_val)]
    null = np.uint64(0)
    from_lists = [pointer(x) for x in (*lists, layout.list_pos)] if lists is not None else [null] * 5
    doc_of = pointer(layout.doc_of) if layout.doc_of is not None else null
    if not use_meta:
        tail = (np.int32(cap), *from_lists, np.int32(n_tiles), doc_of, null)
        launch(kernel, (b, count), (threads,), (*args, *ints, *outs, *tail), device=dev, shared_mem=shared)
        return
    # META: records for as many tiles as the buffer holds, then those tiles' blocks
    most = meta.numel() // (2 * b * (t + 1))
    per = -(-count // -(-count // most))  # slices of equal size, as few as the buffer allows
    tail = (np.int32(cap), *from_lists, np.int32(n_tiles), doc_of, pointer(meta))
    for f in range(first, first + count, per):
        n = min(per, first + count - f)
        write_records(layout, q_terms, q_weights, q_scale, meta, build, f, n)
        ints[4] = np.int32(f)
        launch(kernel, (b, n), (threads,), (*args, *ints, *outs, *tail), device=dev, shared_mem=shared)


def write_records(
    layout: TiledIndex, q_terms: torch.Tensor, q_weights: torch.Tensor, q_scale: torch.Tensor, meta: torch.Tensor,
    build: tuple, first: int, n: int,
) -> None:  # fmt: skip
    """Launch the ``tile_meta`` kernel of the META ``build`` (a :func:`tiled_candidates` build key)
    on the current stream: the records of tiles ``[first, first + n)`` for the batch ``q_terms``
    ``[B, T]`` into ``meta`` (``B · (T + 1)`` entries of 8 bytes a tile; the layout of each is in
    ``cuda/tile_candidates.cu``)."""
    b, t = q_terms.shape
    dev = layout.seg.device
    meta_kernel = _kernel(build, device_index(dev), variant_of(SOURCE), "tile_meta")
    group = meta_tiles(n)
    grid = ((b + 3) // 4, -(-n // group))
    args = (pointer(layout.seg), pointer(layout.tile_start), pointer(layout.dense_id), pointer(q_terms),
            pointer(q_weights), pointer(q_scale), np.int32(t), np.int32(layout.n_terms), np.int32(b), np.int32(first),
            np.int32(n), np.int32(group), pointer(meta))  # fmt: skip
    launch(meta_kernel, grid, (128,), args, device=dev)
