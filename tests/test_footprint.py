"""Issue 18: the device-memory prediction (gpusparse.footprint) against the arrays actually
built, and the decisions under a limit (gpusparse.device_memory) with a fake device."""

from __future__ import annotations

import dataclasses
import gc
import warnings

import numpy as np
import pytest
import torch

from gpusparse import Index
from gpusparse.config import engine_config, override_config
from gpusparse.device_memory import (
    DeviceMemory,
    DeviceMemoryWarning,
    decide,
    is_out_of_memory,
    search_plan,
    torch_share,
)
from gpusparse.engines.tiled.engine import layout_for_search
from gpusparse.errors import DeviceMemoryError
from gpusparse.footprint import IndexShape, dense_row_bytes, forward_parts, layout_parts, list_parts, predict
from gpusparse.layout.forward import forward_copy
from gpusparse.layout.resident import TiledResident

from .reference import random_collection


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.fixture(scope="module")
def collection():
    # 9,000 documents over 20 terms: two tiles of 8,192; most terms dense in the first, none in the second
    return random_collection(np.random.default_rng(18), 9000, 20, 12)


def total(parts) -> int:
    return sum(n for _, n in parts)


@pytest.mark.parametrize(("quantize", "fixed"), [(None, True), (None, False), (8, True)], ids=["fixed", "float", "q8"])
def test_the_prediction_is_the_bytes_built(collection, quantize, fixed):
    index = Index.build(collection, quantize=quantize)
    shape = IndexShape(index)
    with override_config(fixed_point=fixed):
        config = engine_config()
        layout = layout_for_search(index)  # as a search on this device builds it (no forward copy on a CPU)
        assert layout.dense.shape[0] > 0 and layout.offs.numel() > 0  # both kinds of segment predicted
        assert total(layout_parts(shape, config, list_positions=True)) == layout.nbytes
        view = layout_for_search(TiledResident(index, torch.device("cpu")))  # resident="tiled": no list_pos
        assert total(layout_parts(shape, config, list_positions=False)) == view.nbytes
        assert view.list_pos is None and view.nbytes < layout.nbytes
        # float32 sparse postings in 5 bytes, but beside the lists fixed point stores int32 integers
        assert view.packed == (quantize is None) and layout.packed == (quantize is None and not fixed)
    assert total(list_parts(shape.n_padded, shape.n_terms)) == nbytes(index.arrays().values())
    assert total(forward_parts(shape.n_docs, shape.n_postings)) == nbytes(forward_copy(index))


def test_cluster_order_adds_its_arrays_and_its_clustering(collection):
    """In cluster order the layout has no list_pos but the order's two int32 arrays, and the
    clustering's temporaries come after the forward copy (which it reads) is resident."""
    index = Index.build(collection)
    shape = IndexShape(index)
    with override_config(doc_order="cluster", dense_min=0.05):
        config = engine_config()
        plain = predict(shape, "lists", config=dataclasses.replace(config, doc_order="none"))
        ordered = predict(shape, "lists", config=config)
        layout = layout_for_search(index, forward=False)  # a CPU: the clustering reads a temporary copy
    parts = dict(ordered.components)
    assert parts["tiled layout: document order"] == layout.doc_of.nbytes + layout.pos_of.nbytes == 8 * len(collection)
    assert "tiled layout: dense_id" in parts and "tiled layout: dense_id + list_pos" in dict(plain.components)
    assert dict(ordered.temporaries)["build: document order"] > 0 and "build: document order" not in dict(
        plain.temporaries
    )
    assert layout.list_pos is None


def test_the_prediction_follows_the_fallbacks(monkeypatch):
    """Weights whose exponents span too much for 5 bytes, and tiles with more dense
    segments than their int16 ids allow (here 3), are predicted as built."""
    import gpusparse.layout.tiled as tiled_mod

    rng = np.random.default_rng(5)
    docs = random_collection(rng, 3000, 30, 10)
    docs.values[::7] *= np.float32(2.0**-20)  # 22 exponents: more than 16
    index = Index.build(docs)
    monkeypatch.setattr(tiled_mod, "MAX_DENSE_PER_TILE", 3)
    with override_config(fixed_point=True, dense_min=0.05):
        view = layout_for_search(TiledResident(index, torch.device("cpu")))
        assert not view.packed and view.n_sparse > 0
        per_tile = (view.dense_start[1:] - view.dense_start[:-1]).tolist()
        assert max(per_tile) == 3 and int((view.dense_id >= 0).sum()) == view.n_dense  # capped
        assert total(layout_parts(IndexShape(index), engine_config(), list_positions=False)) == view.nbytes
        queries = random_collection(rng, 6, 30, 5)
        got = index.search(queries, 20, kernel="tiled")
        want = index.search(queries, 20, kernel="reference")
        np.testing.assert_array_equal(got.scores, want.scores)
        np.testing.assert_array_equal(got.ids, want.ids)


def test_index_memory_predicts_before_anything_is_built_and_agrees_after_a_search(collection):
    index = Index.build(collection)
    before = index.memory(batch_size=16, k=50)
    assert [c["name"] for c in before["components"]] == ["padded lists"]  # nothing built yet
    predicted = before["predicted"]
    assert set(predicted) == {"lists", "tiled", "scatter"}
    assert predicted["lists"]["peak"] > predicted["lists"]["resident"] > predicted["tiled"]["resident"]
    queries = random_collection(np.random.default_rng(1), 5, 20, 4)
    index.search(queries, 50, kernel="tiled")  # builds the tiled layout (on a CPU: no forward copy)
    built = {c["name"]: c["bytes"] for c in index.memory(batch_size=16, k=50)["components"]}
    layout = [n for name, n in built.items() if name.startswith("tiled layout")]
    want = sum(n for name, n in predicted["lists"]["components"].items() if name.startswith("tiled layout"))
    assert layout == [want]
    assert built["padded lists"] == predicted["lists"]["components"]["padded lists"]


def test_the_counts_of_a_device_index_agree(collection):
    index = Index.build(collection)
    whole = IndexShape(index).tile_counts(4)
    assert whole.sum() == int(index.lengths.sum())
    np.testing.assert_array_equal(IndexShape(index).tile_counts(4, chunk=1000, bounded=True), whole)


def test_dense_rows_cost_one_function():
    assert dense_row_bytes(13, np.array([1, 8000]), 4).tolist() == [4 << 13, 4 << 13]
    assert int(dense_row_bytes(3, 5, 1)) == 8


def test_the_prediction_grows_with_the_batch_and_k(collection):
    shape = IndexShape(Index.build(collection))
    small, large = predict(shape, "tiled", batch_size=8, k=10), predict(shape, "tiled", batch_size=512, k=1000)
    assert small.resident == large.resident and large.peak > small.peak
    with pytest.raises(ValueError, match="mode must be one of"):
        predict(shape, "everything")


# -- decisions under a limit, with a fake device ---------------------------------------------------


@pytest.fixture(scope="module")
def shape(collection):
    return IndexShape(Index.build(collection))


def peaks(shape, **kw):
    return {m: predict(shape, m, **kw).peak for m in ("lists", "tiled", "scatter")}


def limit_for(usable: int) -> int:
    """A limit whose PyTorch share is at least ``usable``."""
    limit = usable * 16 // 15 - 16
    while torch_share(limit) < usable:
        limit += 1
    return limit


def test_the_configured_mode_when_it_fits(shape):
    p = peaks(shape)
    d = decide(shape, limit_for(p["lists"]))
    assert d.chosen.mode == "lists" and not d.fallback and d.kernel == "tiled"


def test_tiled_then_streamed_then_scatter_as_the_limit_shrinks(shape):
    small = {"batch_size": 4, "k": 10}  # the build's temporaries outweigh the batch's
    p = peaks(shape, **small)
    assert p["lists"] > p["tiled"]
    d = decide(shape, limit_for(p["tiled"]), **small)
    assert d.chosen.mode == "tiled" and d.fallback
    msg = d.message()
    assert "the fast layout needs" in msg and "limit" in msg and "slower" in msg and "\n" not in msg
    streamed = predict(shape, "streamed", pieces=4, **small).peak  # smaller pieces: smaller build temporaries
    assert p["scatter"] < streamed < p["tiled"]
    limit = limit_for(streamed)
    assert decide(shape, limit, **small).chosen.mode == "scatter"  # without streaming
    d = decide(shape, limit, allow_streaming=True, **small)
    assert d.chosen.mode == "streamed" and 2 <= d.chosen.pieces <= 4 and d.chosen.peak <= d.usable
    assert f"in {d.chosen.pieces} pieces" in d.message()


def test_nothing_fits_is_one_line_before_allocating(shape):
    with pytest.raises(DeviceMemoryError) as err:
        decide(shape, 1 << 20, allow_streaming=True)
    text = str(err.value)
    assert "\n" not in text and "does not fit" in text and "batch size" in text and "--device-memory-limit" in text


def test_the_device_total_caps_the_limit(shape):
    p = peaks(shape)
    big = limit_for(p["lists"])
    small_device = DeviceMemory(total=limit_for(p["tiled"]), free=0)
    assert decide(shape, big).chosen.mode == "lists"
    assert decide(shape, big, memory=small_device).chosen.mode == "tiled"


def test_another_kernel_is_judged_alone(shape):
    p = peaks(shape)
    d = decide(shape, limit_for(p["scatter"]), kernel="reference")
    assert d.chosen.mode == "scatter" and d.kernel == "reference" and not d.fallback
    with pytest.raises(DeviceMemoryError):
        decide(shape, 1 << 20, kernel="reference")


def test_resident_tiled_configured_never_goes_back_to_lists(shape):
    with override_config(resident="tiled"):
        d = decide(shape, 1 << 40, wanted=engine_config().resident)
    assert d.chosen.mode == "tiled" and not d.fallback


def test_search_plan_warns_once_per_plan(collection):
    index = Index.build(collection)
    p = peaks(IndexShape(index))
    fake = DeviceMemory(total=1 << 40, free=1 << 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = search_plan(index, torch.device("cuda:0"), limit_for(p["tiled"]), memory=fake)
        again = search_plan(index, torch.device("cuda:0"), limit_for(p["tiled"]), memory=fake)
    assert first is again and first.chosen.mode == "tiled"
    assert [w.category for w in caught] == [DeviceMemoryWarning]


def test_out_of_memory_at_the_search_boundary_is_one_clear_line(collection, monkeypatch):
    import gpusparse.search as search_module

    index = Index.build(collection)
    queries = random_collection(np.random.default_rng(2), 3, 20, 4)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    # where the batches run: the first search resolves its arguments, the second takes them as kept
    monkeypatch.setattr(search_module, "search_batches", oom)
    for _ in range(2):
        with pytest.raises(DeviceMemoryError) as err:
            index.search(queries, 10, batch_size=4)
        text = str(err.value)
        assert "\n" not in text and "out of GPU memory" in text and "batches of 4" in text and "--quantize 8" in text
        assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    assert len(index.derived.searches) == 1


def test_cupy_out_of_memory_is_recognised_without_cupy():
    fake = type("OutOfMemoryError", (MemoryError,), {"__module__": "cupy.cuda.memory"})
    assert is_out_of_memory(fake()) and is_out_of_memory(torch.OutOfMemoryError("x"))
    assert not is_out_of_memory(MemoryError()) and not is_out_of_memory(ValueError())


def test_the_limit_is_checked():
    with pytest.raises(ValueError, match="device_memory_limit"), override_config(device_memory_limit=0):
        pass
    with override_config(device_memory_limit=1 << 30) as config:
        assert config.device_memory_limit == 1 << 30


# -- the CLI -----------------------------------------------------------------------------------------


def test_info_predicts_gpu_memory_without_a_gpu(collection, tmp_path):
    import json

    from click.testing import CliRunner

    from gpusparse.cli import main

    Index.build(collection).save(tmp_path / "idx")
    args = ["info", str(tmp_path / "idx"), "--device", "cuda", "--batch-size", "8", "-k", "20"]
    res = CliRunner().invoke(main, [*args, "--device-memory-limit", "1GiB"])
    assert res.exit_code == 0, res.output
    assert "GPU memory" in res.output and "peak" in res.output and "under a 1.07 GB limit: lists fits" in res.output
    res = CliRunner().invoke(main, [*args, "--json"])
    report = json.loads(res.output)["gpu_memory"]
    assert set(report["modes"]) == {"lists", "tiled", "scatter"} and report["batch_size"] == 8
    assert report["modes"]["lists"]["peak"] > report["modes"]["lists"]["resident"] > 0
    res = CliRunner().invoke(main, [*args, "--device-memory-limit", "1MiB"])
    assert res.exit_code == 0 and "refused: a search of batches of 8" in res.output
    res = CliRunner().invoke(main, ["info", str(tmp_path / "idx"), "--device-memory-limit", "lots"])
    assert res.exit_code == 2


# -- on a GPU ----------------------------------------------------------------------------------------


def cuda_kernel_available() -> bool:
    from gpusparse.kernels import cupy_launch

    return torch.cuda.is_available() and cupy_launch.available()


@pytest.fixture
def uncapped():
    """Lift the caps a limited search set on this process's allocators, after the test."""
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    try:
        import cupy

        cupy.get_default_memory_pool().set_limit(size=0)
    except ImportError:
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_kernel_available(), reason="needs a CUDA device and CuPy")
def test_under_a_limit_the_search_falls_back_and_matches(collection, uncapped):
    queries = random_collection(np.random.default_rng(5), 40, 20, 6)
    free = Index.build(collection).search(queries, 100, device="cuda")
    index = Index.build(collection)
    p = peaks(IndexShape(index), batch_size=40, k=100)
    # The limit caps the whole process: first free what earlier tests of this process left
    # behind (unreachable objects, and the cuBLAS workspace PyTorch keeps for each stream a
    # matrix product ran on: ~35 MB on the CUDA-graph capture stream of the encoder tests).
    gc.collect()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capped = index.search(queries, 100, device="cuda", batch_size=40, device_memory_limit=limit_for(p["tiled"]))
    assert [str(w.message) for w in caught if w.category is DeviceMemoryWarning]
    assert torch.equal(capped.ids, free.ids) and torch.equal(capped.scores, free.scores)
    assert index.device.type == "cpu"  # the lists stayed on the host: the tiled view searched on the GPU
    assert [d.type for d in index.derived.views] == ["cuda"]
    assert torch.cuda.max_memory_allocated() - before <= p["tiled"]  # the prediction held


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_kernel_available(), reason="needs a CUDA device and CuPy")
def test_a_limit_nothing_fits_is_refused_before_allocating(collection, uncapped):
    queries = random_collection(np.random.default_rng(6), 10, 20, 6)
    index = Index.build(collection)
    before = torch.cuda.memory_allocated()
    with pytest.raises(DeviceMemoryError, match="does not fit"):
        index.search(queries, 100, device="cuda", device_memory_limit=2 << 20)
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_kernel_available(), reason="needs a CUDA device and CuPy")
def test_the_limit_caps_pytorch(collection, uncapped):
    from gpusparse.device_memory import device_memory, enforce

    dev = torch.device("cuda", torch.cuda.current_device())
    shares = enforce(dev, 1 << 30, device_memory(dev))
    assert shares["torch"] + shares["cupy"] == 1 << 30
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 << 30, dtype=torch.uint8, device=dev)


def test_serve_passes_the_limit_to_every_search(collection, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from click.testing import CliRunner

    import gpusparse.serve
    from gpusparse.cli import main

    seen = {}
    monkeypatch.setattr(gpusparse.serve, "create_app", lambda index, **kw: seen.update(kw) or "app")
    monkeypatch.setattr(gpusparse.serve, "serve", lambda app, **kw: None)
    Index.build(collection).save(tmp_path / "idx")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "idx"), "--device", "cpu", "--device-memory-limit", "2GiB"])
    assert r.exit_code == 0, r.output
    # the server's worker thread does not see the CLI's settings: the limit goes with each search
    assert seen["search_kwargs"]["device_memory_limit"] == 2 << 30


def test_without_a_limit_the_default_plans_only_when_it_might_not_fit():
    """No user limit: a search plans within the GPU's available memory only when the default
    layouts might not fit (about 3.5x the lists' bytes at their peak), and then says so in
    the warning's wording rather than naming a limit."""
    from gpusparse.device_memory import surely_fits

    assert surely_fits(1 << 30, 8 << 30) and not surely_fits(8 << 30, 24 << 30)
    rng = np.random.default_rng(9)
    shape = IndexShape(Index.build(random_collection(rng, 300, 30, 8)))
    lists = decide(shape, 1 << 40)  # everything fits: the configured mode
    plan = dataclasses.replace(
        decide(shape, lists.wanted.peak - 1, memory=DeviceMemory(1 << 40, 1 << 40)), implicit=True
    )  # fmt: skip
    assert plan.fallback and "available on the GPU" in plan.message() and "limit" not in plan.message()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_kernel_available(), reason="needs a CUDA device and CuPy")
def test_without_a_limit_a_search_that_might_not_fit_takes_the_tiled_layout(collection, monkeypatch):
    """A GPU whose available memory (faked small) holds the tiled layout but not the default
    layouts: the search without a limit takes the tiled layout, says so, and matches."""
    import gpusparse.index as index_module

    queries = random_collection(np.random.default_rng(8), 30, 20, 6)
    free = Index.build(collection).search(queries, 50, device="cuda")
    index = Index.build(collection)
    p = peaks(IndexShape(index), batch_size=30, k=50)
    small = limit_for(p["tiled"])  # the tiled layout fits, the default layouts do not
    monkeypatch.setattr(index_module, "available_memory", lambda device: small)
    monkeypatch.setattr(index_module, "surely_fits", lambda lists_bytes, available: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = index.search(queries, 50, device="cuda", batch_size=30)
    assert any("available on the GPU" in str(w.message) for w in caught if w.category is DeviceMemoryWarning)
    assert torch.equal(got.ids, free.ids) and torch.equal(got.scores, free.scores)
    assert index.device.type == "cpu"  # the lists stayed on the host
