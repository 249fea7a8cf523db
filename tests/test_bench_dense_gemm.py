"""bench/dense_gemm_ops.py (issue 23): the dense phase as a GEMM per group of tiles gives, with
the sparse segments' contributions, exactly the reference scores in the engine's integers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpusparse import Index
from gpusparse.engines.tiled.fixed_point import fixed_point
from gpusparse.layout.statistics import max_scores_host
from gpusparse.layout.tiled import build_tiled
from gpusparse.quantize import quantize_collection
from gpusparse.queries import prepare_queries, query_batch

from .reference import canonical_scores, random_collection

ops = pytest.importorskip("dense_gemm_ops")  # bench/ is on pytest's pythonpath


def _sparse_part(layout, q: torch.Tensor, n_docs: int) -> list[list[int]]:
    """The sparse segments' contribution ``Σ q[t] · w`` per (query, document), as Python integers,
    read straight from the layout's segments (independent of the GEMM code)."""
    v, tile = layout.n_terms, 1 << layout.tile_bits
    seg = layout.segment_starts().tolist()
    everything = torch.arange(layout.n_sparse)
    offs = layout.offsets_at(everything).tolist()
    wts = layout.weights_at(everything).to(torch.int64).tolist()  # uint8 levels or int32 integers here
    qs = q.tolist()
    out = [[0] * n_docs for _ in qs]
    for t in range(layout.n_tiles):
        for term in range(v):
            lo, hi = seg[t * v + term], seg[t * v + term + 1]
            for p in range(lo, hi):
                doc = t * tile + offs[p]
                for b, row in enumerate(qs):
                    out[b][doc] += row[term] * wts[p]
    return out


def _dense_part(layout, q: torch.Tensor, kind: str, group: int, limit: int, doc_ints) -> tuple[list, list]:
    """The GEMMs' contribution over every group of ``group`` tiles, Python integers, and the plans."""
    row_start, row_term = ops.tile_dense_rows(layout)
    tile = 1 << layout.tile_bits
    out = [[0] * layout.n_docs for _ in range(q.shape[0])]
    plans = []
    for t0, t1 in ops.groups(layout.n_tiles, group):
        g = ops.group_operand(layout.dense, row_start, row_term, t0, t1, pad=8)
        plan, partials = ops.exact_dense_gemm(ops.group_queries(q, g), doc_ints(g.rows), kind, limit)
        plans.append(plan)
        x = ops.combine_exact(plan, partials)
        for b in range(q.shape[0]):
            for c in range(min(len(x[b]), layout.n_docs - t0 * tile)):
                out[b][t0 * tile + c] += x[b][c]
    return out, plans


def _quantized_case(seed: int):
    rng = np.random.default_rng(seed)
    docs = random_collection(rng, 150, 40, 14, quantized=True, empty_fraction=0.05)
    queries = random_collection(rng, 5, 40, 12, quantized=True)
    index = Index.build(docs, quantize=8)
    docs_q, _ = quantize_collection(docs, 8, index.quantization.step)
    queries_q = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
    return index, docs_q, queries_q


@pytest.mark.parametrize("kind", ["fp16", "int8"])
@pytest.mark.parametrize(("seed", "tile_bits", "group", "limit"), [(0, 4, 1, ops.FP32_EXACT), (1, 5, 2, ops.FP32_EXACT),
                                                                   (2, 4, 3, 1 << 9)])  # fmt: skip
def test_eight_bit_gemm_plus_sparse_is_the_reference_in_levels(kind, seed, tile_bits, group, limit):
    index, docs_q, queries_q = _quantized_case(seed)
    layout = build_tiled(index, tile_bits, dense_min=0.2, list_positions=False)
    assert layout.n_dense > 0 and layout.dense.dtype == torch.uint8
    batch = query_batch(queries_q, index.device)
    levels, q_step = ops.query_levels(batch.padded_weights)
    q = ops.query_matrix(batch.padded_terms, levels, layout.n_terms)
    dense, plans = _dense_part(layout, q, kind, group, limit, lambda rows: rows.to(torch.int64))
    sparse = _sparse_part(layout, q, index.n_docs)
    got = np.array(dense, dtype=np.float64) + np.array(sparse, dtype=np.float64)  # < 2**53: exact
    # the reference's float64 scores are level sums times both steps (powers of two): exact
    want = canonical_scores(docs_q, queries_q) / (index.quantization.step * q_step.numpy()[:, None])
    np.testing.assert_array_equal(want, np.round(want))
    np.testing.assert_array_equal(got, want)
    assert (got > 0).any() and any(x > 0 for row in dense for x in row)  # both parts carry weight
    if kind == "fp16" and limit == ops.FP32_EXACT:
        assert all(p.gemms == 1 for p in plans)  # 8-bit × 8-bit: one GEMM while Σ ≤ 2**24
    if kind == "fp16" and limit < ops.FP32_EXACT:
        assert any(p.gemms > 1 for p in plans)  # the bound forced a limb split
    if kind == "int8":
        assert all((p.n_q, p.n_d) == (2, 1) for p in plans)  # 7-bit halves of the query levels


@pytest.mark.parametrize("kind", ["fp16", "int8"])
@pytest.mark.parametrize("seed", [3, 4])
def test_fixed_point_gemm_plus_sparse_is_the_exact_integer_sum(kind, seed):
    rng = np.random.default_rng(seed)
    docs = random_collection(rng, 130, 30, 10, empty_fraction=0.05)
    queries = random_collection(rng, 4, 30, 9)
    index = Index.build(docs)
    layout = build_tiled(index, 4, dense_min=0.2, fixed=True, stored_fixed=True, list_positions=False)
    assert layout.n_dense > 0 and layout.dense.dtype == torch.int32
    b = layout.weight_bits
    batch = query_batch(queries, index.device)
    fp = fixed_point(index, batch, "u32", b)
    qi = ops.fixed_query_ints(batch.padded_weights, fp.mult)
    q = ops.query_matrix(batch.padded_terms, qi, layout.n_terms)
    dense, plans = _dense_part(layout, q, kind, 2, ops.FP32_EXACT, lambda rows: ops.fixed_doc_ints(rows, b))
    sparse = _sparse_part(layout, q, index.n_docs)
    # the reference in integers, from the collection itself: Σ_t q[t] · round(w_d[t] · 2**b)
    d = docs.to_scipy().tocsr()
    d.sum_duplicates()
    qs = q.tolist()
    for r in range(len(queries)):
        for doc in range(index.n_docs):
            lo, hi = d.indptr[doc], d.indptr[doc + 1]
            pairs = zip(d.indices[lo:hi], d.data[lo:hi], strict=True)
            want = sum(qs[r][t] * int(np.round(np.float64(w) * 2.0**b)) for t, w in pairs)
            assert dense[r][doc] + sparse[r][doc] == want, (r, doc)
    assert any(p.gemms > 1 for p in plans)  # 30-bit integers take several limbs
    # and the exact sum, in the kernel's units, is within half the margin of the float64 reference
    ref = canonical_scores(docs, queries) * fp.scale.numpy()[:, None]
    shift = fp.shift.to(torch.int64).tolist()
    units = np.array([[(dense[r][c] + sparse[r][c]) >> shift[r] for c in range(index.n_docs)] for r in range(len(qs))])
    assert np.all(np.abs(units - ref) <= fp.delta.numpy()[:, None] / 2)


@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_combine_shift_is_the_floor_of_the_exact_sum(kind):
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 1 << 31, (3, 24), generator=gen, dtype=torch.int64)
    d = torch.randint(0, 1 << 30, (24, 16), generator=gen, dtype=torch.int64)
    d[3] = 0  # an all-zero row (a padded or sparse term)
    plan, partials = ops.exact_dense_gemm(q, d, kind)
    exact = ops.combine_exact(plan, partials)
    cols = list(zip(*d.tolist(), strict=True))
    assert exact == [[sum(a * b for a, b in zip(row, col, strict=True)) for col in cols] for row in q.tolist()]
    shift = torch.tensor([0, 33, 61])
    got = ops.combine_shift(plan, partials, shift)
    for r, s in enumerate(shift.tolist()):
        want = [x >> s for x in exact[r]]
        if max(want) < 1 << 63:
            assert got[r].tolist() == want
    with pytest.raises(ValueError):
        ops.combine_int64(plan, partials)  # X reaches ~2**66


def test_tile_dense_rows_name_each_rows_tile_and_term():
    index, _, _ = _quantized_case(7)
    layout = build_tiled(index, 4, dense_min=0.2, list_positions=False)
    row_start, row_term = ops.tile_dense_rows(layout)
    did = layout.dense_id.view(layout.n_tiles, layout.n_terms)
    for t in range(layout.n_tiles):
        rows = range(int(row_start[t]), int(row_start[t + 1]))
        assert [int(row_start[t]) + int(did[t, int(row_term[r])]) for r in rows] == list(rows)
    assert int(row_start[-1]) == layout.n_dense


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_the_device_gemms_are_exact(kind):
    """fp16 with float32 output (``out_dtype``) and ``torch._int_mm`` on the GPU, against the CPU's integers."""
    gen = torch.Generator().manual_seed(6)
    for q_bits, d_bits in ((8, 8), (31, 30)):
        q = torch.randint(0, 1 << q_bits, (256, 112), generator=gen, dtype=torch.int64)
        d = torch.randint(0, 1 << d_bits, (112, 4096), generator=gen, dtype=torch.int64)
        plan, cpu = ops.exact_dense_gemm(q, d, kind)
        plan_gpu, gpu = ops.exact_dense_gemm(q.cuda(), d.cuda(), kind)
        assert plan_gpu == plan
        for row_c, row_g in zip(cpu, gpu, strict=True):
            for a, b in zip(row_c, row_g, strict=True):
                assert torch.equal(a, b.cpu())
    assert torch.backends.cuda.matmul.allow_tf32 is False  # the TF32 path gives the process-wide switch back


def test_the_tf32_fallback_restores_the_process_wide_switch(monkeypatch):
    """The GEMM's TF32 path (a torch without mm's out_dtype) turns TF32 on for its own products only:
    left on, it changed every later float32 matmul of the process (an encoder test failed after it)."""
    if not torch.cuda.is_available():
        pytest.skip("the TF32 path runs on a GPU")
    monkeypatch.setitem(ops.FP16_PATH, "path", "tf32")
    q = torch.randint(0, 1 << 8, (16, 32), dtype=torch.int64)
    d = torch.randint(0, 1 << 8, (32, 64), dtype=torch.int64)
    _, cpu = ops.exact_dense_gemm(q, d, "fp16")
    _, gpu = ops.exact_dense_gemm(q.cuda(), d.cuda(), "fp16")
    assert all(torch.equal(a, b.cpu()) for rc, rg in zip(cpu, gpu, strict=True) for a, b in zip(rc, rg, strict=True))
    assert torch.backends.cuda.matmul.allow_tf32 is False
