"""The engine house: the registry and its one chooser, the configuration object, the derived
state an index keeps across searches, and the run files every engine writes."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch

from gpusparse import Index, engines, read_vectors, write_trec_run
from gpusparse.config import EngineConfig, engine_config, override_config

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"
# sha256 of TREC runs (k = 1000) of the shipped Cranfield sample, written by the code before
# the engine-house refactor (commit bd464e5): all 225 queries, and the first 40 (the tiled
# engine's PyTorch emulation takes minutes for all of them on a 2-core CPU); float32 weights
# and 8-bit impacts.
RUN_SHA256 = {
    (None, 225): "f878b9850745f9a00f84d5dbccbeb68dd28eb253403a8ed40a928da3a05c94d2",
    (8, 225): "7d32632769e863f81c8c36ddad7079d7883e1fcde485ee40e5f0e8ec8d831dbe",
    (None, 40): "ef8a32cdec961042948f5d525df90b24b2ba97d110c7d78a199c6101c525eb07",
    (8, 40): "af8d3b1291091216a4d0c3f655095d40b077f5ad61b4b779d4453b2cbfd75880",
}


def runnable(device: torch.device) -> list[str]:
    """Engines that run on ``device`` here (Triton's only on CUDA or under its interpreter)."""
    return [name for name in engines.names() if engines.get(name).unavailable(device) is None]


@pytest.fixture(scope="module")
def sample():
    return read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False)


def run_sha256(index: Index, queries, name: str, path: Path) -> str:
    res = index.search(queries, 1000, kernel=name)
    write_trec_run(path, queries.ids, index.ids, res.scores.numpy(), res.ids.numpy())
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("quantize", [None, 8])
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_every_engine_writes_the_pinned_run(sample, tmp_path, quantize, device):
    """The run files, byte for byte, from every engine that runs here, equal the ones written
    before the refactor (the GPU run covers the CUDA and Triton engines)."""
    index = Index.build(sample, quantize=quantize, device=device)
    queries = read_vectors(SAMPLE / "queries.jsonl.gz", index.vocab, progress=False)
    assert len(queries) == 225
    names = runnable(torch.device(device))
    assert "reference" in names and "tiled" in names
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        assert not {"scatter", "docpar"} & set(names)  # not without the interpreter
    for name in names:
        n = 225 if device == "cuda" or name == "reference" else 40
        got = run_sha256(index, queries[:n], name, tmp_path / f"{name}.trec")
        assert got == RUN_SHA256[(quantize, n)], (name, n)


def test_registry_and_chooser():
    assert engines.names() == ("reference", "scatter", "docpar", "tiled")
    cpu = torch.device("cpu")
    assert engines.choose("reference", cpu).name == "reference"
    assert engines.choose("tiled", cpu).name == "tiled"  # the PyTorch emulation, when asked for
    auto = engines.choose("auto", cpu)
    assert auto.name == "reference"  # an emulation or interpreter is never chosen by auto
    with pytest.raises(ValueError, match="unknown kernel 'nope'; choose one of: auto, reference"):
        engines.choose("nope", cpu)
    for name in engines.names():
        engine = engines.get(name)
        assert engine.name == name and engines.get(name) is engine  # one instance, imported once
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="scatter"):
            engines.choose("scatter", cpu)


def test_config_override_is_scoped_to_the_block_and_the_thread():
    default = engine_config()
    assert default == EngineConfig() and default.as_dict()["fixed_point"] is True
    seen: list[EngineConfig] = []
    with override_config(fixed_point=False, graph_max_batch=0) as cfg:
        assert engine_config() is cfg and not cfg.fixed_point and cfg.graph_max_batch == 0
        worker = threading.Thread(target=lambda: seen.append(engine_config()))
        worker.start()
        worker.join()
        with override_config(accumulator="carry"):
            assert engine_config().accumulator == "carry" and not engine_config().fixed_point
        assert engine_config().accumulator == "u32"
    assert engine_config() == default
    assert seen == [default]  # another thread (a server's worker) keeps the defaults
    with pytest.raises(ValueError, match="accumulator"):
        EngineConfig(accumulator="u64")
    with pytest.raises(TypeError), override_config(no_such_setting=1):
        pass


def test_config_changes_the_engine_not_the_results(sample):
    index = Index.build(sample)
    queries = read_vectors(SAMPLE / "queries.jsonl.gz", index.vocab, progress=False)[:40]
    want = index.search(queries, 100, kernel="reference")
    for changes in ({"fixed_point": False}, {"accumulator": "carry"}, {}):
        with override_config(**changes):
            got = index.search(queries, 100, kernel="tiled")
        assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores), changes


def test_derived_state_is_built_once_and_kept_for_another_device(sample):
    """A search on another device than the index's copies the index there once and keeps the
    copy with its layouts; ``to`` itself makes a fresh copy each time."""
    index = Index.build(sample)
    queries = read_vectors(SAMPLE / "queries.jsonl.gz", index.vocab, progress=False)
    index.search(queries, 10, kernel="tiled")
    layouts = dict(index.derived.layouts)
    assert len(layouts) == 1
    index.search(queries, 10, kernel="tiled", device="cpu")
    index.search(queries, 10, kernel="tiled", device=torch.device("cpu"))
    assert index.derived.layouts == layouts and index.derived.copy is None  # the same device: no copy
    meta = index.resident_on("meta")
    assert meta is not index and meta.device.type == "meta"
    assert index.resident_on(torch.device("meta")) is meta  # kept, not copied again
    assert index.to("meta") is not meta  # an explicit copy is the caller's
    assert meta.derived.layouts == {}  # layouts are built where they are searched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_index_searched_on_cuda_builds_its_layout_once(sample, monkeypatch):
    """``device="cuda"`` on a CPU index, and ``cuda`` against ``cuda:0``: the GPU copy, its
    tiled layout and forward copy are made on the first search only."""
    import gpusparse.layout.tiled as tiled_mod
    from gpusparse.layout import forward

    index = Index.build(sample)
    queries = read_vectors(SAMPLE / "queries.jsonl.gz", index.vocab, progress=False)
    first = index.search(queries, 100, device="cuda")
    builds = []
    for module, name in ((tiled_mod, "build_tiled"), (forward, "forward_index")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _n=name, **kw: builds.append(_n) or _real(*a, **kw))
    for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
        again = index.search(queries, 100, device=device)
        assert torch.equal(again.ids, first.ids) and torch.equal(again.scores, first.scores)
    assert builds == []
    gpu = index.to("cuda")
    gpu.search(queries, 100)
    gpu.search(queries, 100, device="cuda:0")
    assert builds.count("build_tiled") == 1  # the explicit copy builds its own, once
