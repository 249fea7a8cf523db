"""Issue 18: the tiled engine on one resident layout — rescoring from the tiles, the
host-backed view, residency settings and Index.memory()."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpusparse import Index
from gpusparse.config import override_config
from gpusparse.engines.tiled.engine import tiled_search
from gpusparse.engines.tiled.ranking import tiled_exact_scores
from gpusparse.exact import exact_scores
from gpusparse.layout.resident import TiledResident, tiled_resident
from gpusparse.layout.tiled import build_tiled
from gpusparse.queries import query_batch

from .reference import dense_scores, random_collection, reference_topk


def cuda_kernel_available() -> bool:
    from gpusparse.kernels import cupy_launch

    return torch.cuda.is_available() and cupy_launch.available()


def _pairs(rng, docs_n, queries_n, m):
    rows = torch.from_numpy(rng.integers(0, queries_n, m))
    docs = torch.from_numpy(rng.integers(0, docs_n, m))
    return rows, docs


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "uint8"])
@pytest.mark.parametrize("fixed", [False, True], ids=["float", "fixed"])
@pytest.mark.parametrize(("tile_bits", "dense_min"), [(1, None), (3, 0.3), (9, 0.02), (16, None)])
def test_tiled_exact_scores_match_the_canonical_ones(tile_bits, dense_min, fixed, quantized):
    rng = np.random.default_rng(tile_bits * 7 + fixed + 2 * quantized)
    docs = random_collection(rng, 400, 90, 30, quantized=quantized, empty_fraction=0.05)
    # queries longer than a warp (40-70 terms) and a few short ones
    queries = random_collection(rng, 9, 90, 60, quantized=quantized)
    index = Index.build(docs, quantize=8 if quantized else None)
    layout = build_tiled(index, tile_bits, dense_min=dense_min, fixed=fixed, list_positions=False, chunk=333)
    if dense_min is not None:
        assert layout.n_dense > 0
    assert layout.list_pos is None
    batch = query_batch(queries if not quantized else _quantized(queries, index), index.device)
    rows, cand = _pairs(rng, 400, len(queries), 1500)
    got = tiled_exact_scores(layout, batch, rows, cand, max_cells=1 << 10)  # several pieces
    want = exact_scores(index, batch, rows, cand)
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.numpy().view(np.int32))
    # and against float64 from the dense matrices (the documents' own weights)
    if not quantized:
        ref = dense_scores(docs, queries).astype(np.float32)[rows.numpy(), cand.numpy()]
        np.testing.assert_array_equal(got.numpy(), ref)


def _quantized(queries, index):
    from gpusparse.layout.statistics import max_scores_host
    from gpusparse.queries import prepare_queries

    return prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))


def test_a_fixed_point_layout_stores_the_float32_weights():
    """Fixed point is the kernel's arithmetic, not the storage: the layout keeps the weights."""
    rng = np.random.default_rng(1)
    index = Index.build(random_collection(rng, 100, 20, 5))
    a, b = build_tiled(index, 4, dense_min=0.2, fixed=True), build_tiled(index, 4, dense_min=0.2)
    assert a.weight_bits is not None and b.weight_bits is None
    for name in ("seg", "offs", "wts", "dense_id", "dense", "tile_start", "dense_start"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.packed and a.exp_base == b.exp_base and a.nbytes == b.nbytes
    assert a.weights_at(torch.arange(a.n_sparse)).dtype == a.dense.dtype == torch.float32


def test_a_stored_fixed_layout_holds_the_kernels_integers_and_refuses_rescoring():
    """Beside the lists the layout may store round(w · 2**b) itself (what the kernel would
    convert to); nothing then rescores from it."""
    rng = np.random.default_rng(4)
    index = Index.build(random_collection(rng, 200, 20, 6))
    a = build_tiled(index, 4, dense_min=0.2, fixed=True, stored_fixed=True)
    b = build_tiled(index, 4, dense_min=0.2, fixed=True)
    assert a.wts.dtype == a.dense.dtype == torch.int32 and a.weight_bits == b.weight_bits and a.n_dense > 0
    for x, y in ((a.wts, b.weights_at(torch.arange(b.n_sparse))), (a.dense, b.dense)):
        assert torch.equal(x.to(torch.int64), torch.round(y.to(torch.float64) * 2.0**b.weight_bits).to(torch.int64))
    batch = query_batch(random_collection(rng, 2, 20, 4), index.device)
    with pytest.raises(ValueError, match="fixed-point integers"):
        tiled_exact_scores(a, batch, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def test_layout_built_from_host_slabs_is_the_same():
    rng = np.random.default_rng(2)
    index = Index.build(random_collection(rng, 500, 60, 12, empty_fraction=0.1))
    a = build_tiled(index, 5, dense_min=0.1, fixed=True, chunk=1 << 23)
    b = build_tiled(index, 5, dense_min=0.1, fixed=True, chunk=61)
    assert a.n_dense > 0
    for name in ("seg", "offs", "wts", "dense_id", "dense", "tile_start", "dense_start", "list_pos"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.nbytes == b.nbytes > build_tiled(index, 5, dense_min=0.1, fixed=True, list_positions=False).nbytes


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "uint8"])
@pytest.mark.parametrize(("tile_bits", "dense_min", "acc", "fixed"),
                         [(3, 0.2, "u32", True), (6, None, "carry", False), (5, 0.05, "u32", False)])  # fmt: skip
def test_search_of_a_tiled_resident_view_is_exact(tile_bits, dense_min, acc, fixed, quantized, device):
    """The view's lists stay on the host; the search (emulated on a CPU, the CUDA kernels on
    a GPU) rescores from the layout and returns the reference's results."""
    rng = np.random.default_rng(tile_bits + 10 * quantized)
    docs = random_collection(rng, 800, 100, 14, quantized=quantized, empty_fraction=0.05)
    queries = random_collection(rng, 13, 100, 40, quantized=quantized, empty_fraction=0.1)
    index = Index.build(docs)
    view = tiled_resident(index, device)
    assert isinstance(view, TiledResident) and not view.lists_resident and view.doc_ids.device.type == "cpu"
    assert tiled_resident(index, device) is view
    batch = query_batch(queries, view.device)
    scores = dense_scores(docs, queries)
    emulated = device == "cpu" or not cuda_kernel_available()
    for k in (1, 10, 1000):
        s, i = tiled_search(view, batch, k, tile_bits=tile_bits, dense_min=dense_min, acc=acc, fixed=fixed,
                            emulated=emulated).resolved()  # fmt: skip
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
        np.testing.assert_array_equal(s.cpu().numpy(), ref_s)
    for layout in view.derived.layouts.values():
        assert layout.forward is None and layout.list_pos is None
        assert layout.seg.device.type == torch.device(device).type


def test_out_of_range_rows_of_a_view_are_searched_on_the_host():
    """A document weight dwarfing the rest leaves small scores below one fixed-point unit:
    those rows go to the reference search, which reads the view's host lists."""
    rng = np.random.default_rng(5)
    docs = random_collection(rng, 300, 40, 8)
    docs.values[0] = 2.0**40
    queries = random_collection(rng, 6, 40, 6)
    index = Index.build(docs)
    view = tiled_resident(index, "cpu")
    batch = query_batch(queries, view.device)
    scores = dense_scores(docs, queries)
    for k in (1, 10, 300):
        s, i = tiled_search(view, batch, k, tile_bits=5, acc="u32", emulated=True).resolved()
        ref_s, ref_i = reference_topk(scores, k)
        np.testing.assert_array_equal(i.numpy(), ref_i)
        np.testing.assert_array_equal(s.numpy(), ref_s)


def test_resident_setting_is_checked():
    with pytest.raises(ValueError, match="resident"), override_config(resident="forward"):
        pass


def test_memory_reports_components_by_device():
    rng = np.random.default_rng(3)
    docs = random_collection(rng, 400, 50, 10)
    index = Index.build(docs)
    report = index.memory(batch_size=4, k=10)
    assert [c["name"] for c in report["components"]] == ["padded lists"]
    assert report["by_device"] == {"cpu": index.stats().bytes} and report["peak"] == {}
    view = tiled_resident(index, "cpu")
    tiled_search(
        view, query_batch(random_collection(rng, 3, 50, 5), torch.device("cpu")), 10, tile_bits=4, emulated=True
    )
    report = index.memory(batch_size=4, k=10)
    names = [c["name"] for c in report["components"]]
    (layout,) = view.derived.layouts.values()
    assert [c["bytes"] for c in report["components"] if c["name"].startswith("tiled layout")] == [layout.nbytes]
    assert not any("exact weights" in n for n in names) and layout.list_pos is None
    assert report["by_device"]["cpu"] == sum(c["bytes"] for c in report["components"])
    assert report["search_bytes"] > 0
    # the temporaries follow the tiles the layout was built with (16 documents here)
    import gpusparse.index as index_module

    seen = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(index_module, "search_bytes", lambda n_tiles, *a, **kw: seen.append(n_tiles) or 1)
        index.memory(batch_size=4, k=10)
    assert seen == [-(-index.n_docs // 16)]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_kernel_available(), reason="needs a GPU and CuPy")
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "uint8"])
def test_index_search_on_a_gpu_keeps_only_the_layout_there(quantized):
    rng = np.random.default_rng(7)
    docs = random_collection(rng, 3000, 200, 20, quantized=quantized)
    queries = random_collection(rng, 40, 200, 30, quantized=quantized)
    cpu = Index.build(docs)
    with override_config(resident="lists"):
        before = Index.build(docs, device="cuda").search(queries, k=100)
    gpu = Index.build(docs, device="cuda")
    with override_config(resident="tiled"):
        res = gpu.search(queries, k=100)  # the lists go to the host
        assert gpu.device.type == "cpu" and gpu.search_device.type == "cuda"
        assert torch.equal(res.ids, before.ids) and torch.equal(res.scores, before.scores)
        again = gpu.search(queries, k=100)  # default device: the GPU again, same view
        assert torch.equal(again.ids, res.ids)
    ref = cpu.search(queries, k=100, kernel="reference")
    assert torch.equal(res.ids, ref.ids) and torch.equal(res.scores, ref.scores)
    report = gpu.memory(batch_size=40, k=100)
    on_gpu = {c["name"] for c in report["components"] if c["device"].startswith("cuda")}
    assert on_gpu and all(n.startswith("tiled") for n in on_gpu)
    # another engine still works: a full copy of the lists on the GPU
    sc = gpu.search(queries, k=100, kernel="reference")
    assert torch.equal(sc.ids, ref.ids)
