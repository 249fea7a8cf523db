"""Shards and streaming: sharded folders, gloo processes and torchrun against one process's search.

Collections repeat documents at random positions, so exact score ties fall across shard
(and piece) boundaries; results must equal single-process search byte for byte.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner, Result

import gpusparse
from gpusparse import Index, IndexFormatError, SparseCollection, write_jsonl, write_trec_run
from gpusparse.cli import main
from gpusparse.distributed import load_shard
from gpusparse.shards import (
    concat_indexes,
    document_ranges,
    load_sharded,
    save_sharded,
    shard_ids,
    slice_documents,
)
from gpusparse.streaming import StreamedIndex, open_for_search

from .distributed_worker import search_worker
from .reference import random_collection

N_TERMS = 40
KS = [1, 3, 10, 37, 150]  # 37 is more than a shard of 4 holds, 150 more than all documents


def tied_collection(seed: int, n_base: int = 30, copies: int = 3, extra: int = 10) -> SparseCollection:
    """``copies`` copies of ``n_base`` random documents (plus ``extra`` more copies) in random
    order: identical documents, hence tied scores, sit in different shards."""
    rng = np.random.default_rng(seed)
    base = random_collection(rng, n_base, N_TERMS, 5, quantized=True, empty_fraction=0.1).to_scipy()
    mat = sp.vstack([base] * copies + [base[:extra]]).tocsr()
    mat = mat[rng.permutation(mat.shape[0])]
    ids = [f"d{i}" for i in range(mat.shape[0])]
    return SparseCollection.from_scipy(mat, ids=ids)


def queries_for(seed: int, n: int = 10) -> SparseCollection:
    rng = np.random.default_rng(seed + 1000)
    q = random_collection(rng, n, N_TERMS, 3, quantized=True, empty_fraction=0.1).to_scipy()
    return SparseCollection.from_scipy(q, ids=[f"q{i}" for i in range(n)])


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: object) -> None:
    assert torch.equal(got[1], want[1]), what
    assert got[0].numpy().tobytes() == want[0].numpy().tobytes(), what


def run_text(path: Path, qs: SparseCollection, names: list[str], res: tuple[torch.Tensor, torch.Tensor]) -> bytes:
    write_trec_run(path, qs.ids, names, res[0].numpy(), res[1].numpy())
    return path.read_bytes()


# -- cutting, joining, folders ----------------------------------------------------------------


@pytest.mark.parametrize("n_parts", [1, 2, 3, 7])
def test_slices_equal_builds_and_join_back(n_parts):
    docs = tied_collection(n_parts)
    full = Index.build(docs)
    ranges = document_ranges(len(docs), n_parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(docs)
    assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in itertools.pairwise(ranges))
    parts = [slice_documents(full, a, b) for a, b in ranges]
    for (a, b), part in zip(ranges, parts, strict=True):
        built = Index.build(docs[a:b])
        for name, array in built.arrays().items():
            assert torch.equal(part.arrays()[name], array), (a, b, name)
        assert part.ids == built.ids
    joined = concat_indexes(parts)
    for name, array in full.arrays().items():
        assert torch.equal(joined.arrays()[name], array), name
    assert joined.ids == full.ids and joined.stats() == full.stats()


def test_document_ranges_refuse_empty_parts():
    with pytest.raises(gpusparse.InputError, match="cannot split 3 documents into 4"):
        document_ranges(3, 4)


def test_sharded_folder_loads_as_one_build(tmp_path):
    docs = tied_collection(5)
    full = Index.build(docs)
    ranges = document_ranges(len(docs), 3)
    save_sharded((Index.build(docs[a:b]) for a, b in ranges), tmp_path / "sh")
    loaded = Index.load(tmp_path / "sh", mmap=False)
    for name, array in full.arrays().items():
        assert torch.equal(loaded.arrays()[name], array), name
    assert loaded.ids == full.ids == shard_ids(tmp_path / "sh")
    part, offset = load_sharded(tmp_path / "sh", range(1, 3))
    assert offset == ranges[1][0] and part.n_docs == len(docs) - ranges[1][0]
    assert part.ids == docs.ids[ranges[1][0] :]
    with pytest.raises(FileExistsError):
        save_sharded(iter([full]), tmp_path / "sh")
    save_sharded(iter([full]), tmp_path / "sh", overwrite=True)
    assert Index.load(tmp_path / "sh").n_docs == len(docs)
    assert [p.name for p in tmp_path.iterdir()] == ["sh"]  # no temporary folders left


@pytest.mark.parametrize("kernel", ["reference", "tiled"])
def test_streamed_pieces_equal_resident_search(kernel):
    docs, qs = tied_collection(7), queries_for(7)
    full = Index.build(docs)
    for n_pieces in (2, 7):
        streamed = StreamedIndex(full, n_pieces, "cpu", kernel=kernel)
        assert len(streamed.pieces) == n_pieces and streamed.ids == full.ids
        for k in KS:
            assert_same(streamed.search(qs, k, batch_size=4), full.search(qs, k, kernel=kernel), (n_pieces, k))
    single_documents = StreamedIndex(full, len(docs), "cpu", kernel=kernel)  # one document a piece
    assert_same(single_documents.search(qs, 37), full.search(qs, 37, kernel=kernel), "one document a piece")


def test_open_for_search_streams_what_does_not_fit():
    full = Index.build(tied_collection(8))
    assert open_for_search(full, "cpu") is full  # no limit on the CPU
    nbytes = sum(t.numel() * t.element_size() for t in full.arrays().values())
    assert isinstance(open_for_search(full, "cpu", index_memory=nbytes * 2), Index)
    small = open_for_search(full, "cpu", index_memory=nbytes // 2)
    assert isinstance(small, StreamedIndex) and len(small.pieces) == 4  # two pieces fit at once
    assert len(open_for_search(full, "cpu", pieces=3).pieces) == 3


# -- processes (gloo) ----------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_processes_equal_single_process(tmp_path, world):
    docs, qs = tied_collection(world), queries_for(world)
    write_jsonl(qs, tmp_path / "queries.jsonl")
    folders = [tmp_path / f"shards-{world}"]
    if world == 2:
        folders.append(tmp_path / "shards-4")  # two shards per process
    for folder in folders:
        n = int(folder.name.split("-")[1])
        save_sharded((Index.build(docs[a:b]) for a, b in document_ranges(len(docs), n)), folder)
    # "flagged": some rows on each process are searched again after the merge
    kernels = ["reference", "flagged", "tiled-whole", "tiled-exchange"]
    if world == 2:  # and one process's shard streamed beside the other's resident one
        kernels += ["tiled", "tiled-mixed"]
    mp.spawn(search_worker, args=(world, str(tmp_path), [str(f) for f in folders], KS, kernels), nprocs=world)

    full = Index.build(docs)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    results = {key: got for key, got in per_rank[0].items() if key[0] != "merged_floor calls"}
    assert len(results) == len(folders) * len(kernels) * 2 * len(KS)
    for folder in folders:  # shards exchange lower bounds before rescoring if asked: a tiled batch of > 8
        calls = {name: per_rank[0][("merged_floor calls", folder.name, name)] for name in kernels}
        assert calls.pop("tiled-exchange") == len(KS) and not any(calls.values()), calls  # resident only
    crossing_ties = 0
    for key, got in results.items():
        for other in per_rank[1:]:
            assert_same(other[key], got, key)  # every process holds the merged results
        want = full.search(qs, key[-1], kernel="reference")
        assert_same(got, (want.scores, want.ids), key)
        a = run_text(tmp_path / "got.trec", qs, docs.ids, got)
        assert a and a == run_text(tmp_path / "want.trec", qs, docs.ids, (want.scores, want.ids)), key
        bounds = document_ranges(len(docs), world)
        shard_of = np.searchsorted([b for _, b in bounds], got[1].numpy(), side="right")
        s = got[0].numpy()
        crossing_ties += int(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] > 0) & (shard_of[:, 1:] != shard_of[:, :-1])).sum())
    assert crossing_ties > 0  # the data really has tied scores across shards


# -- the command line ----------------------------------------------------------------------------


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result: Result, *fragments: str) -> None:
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if not ln.startswith("read ")]
    assert len(lines) == 1 and lines[0].startswith("gpusparse: error: "), result.stderr
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])


@pytest.fixture(scope="module")
def cli_data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    docs, qs = tied_collection(11), queries_for(11)
    write_jsonl(docs, d / "docs.jsonl")
    write_jsonl(qs, d / "queries.jsonl")
    vocab = f"integer:{N_TERMS}"
    # Continuous weights and one large one in the first shard only: quantizing each shard on
    # its own would give the shards different steps.
    rng = np.random.default_rng(11)
    cdocs = random_collection(rng, 100, N_TERMS, 5).to_scipy()
    cdocs[0, 1] = 200.0
    write_jsonl(SparseCollection.from_scipy(cdocs, ids=[f"d{i}" for i in range(100)]), d / "cdocs.jsonl")
    write_jsonl(random_collection(rng, 10, N_TERMS, 3), d / "cqueries.jsonl")
    builds = [("plain", "docs", []), *((f"sh{n}", "docs", ["--shards", n]) for n in (2, 3, 4))]
    builds += [
        ("float", "cdocs", []),
        ("q8", "cdocs", ["--quantize", 8]),
        ("q8sh2", "cdocs", ["--quantize", 8, "--shards", 2]),
    ]
    for name, docs_file, extra in builds:
        result = run("index", d / f"{docs_file}.jsonl", "-o", d / name, "--vocab", vocab, "--no-progress", *extra)
        assert result.exit_code == 0, result.stderr
    for k in (7, 25):
        for folder, prefix, queries in (
            ("plain", "single", "queries"),
            ("q8", "single-q8", "cqueries"),
            ("float", "single-float", "cqueries"),
        ):
            out = d / f"{prefix}-{k}.trec"
            result = run("search", d / folder, d / f"{queries}.jsonl", "-o", out, "--k", k, "--no-progress")
            assert result.exit_code == 0, result.stderr
    return {"dir": d, "docs": d / "docs.jsonl", "queries": d / "queries.jsonl", "cqueries": d / "cqueries.jsonl"}


def test_cli_sharded_index_info_and_search(cli_data, tmp_path):
    d = cli_data["dir"]
    info = run("info", d / "sh3")
    assert info.exit_code == 0, info.stderr
    assert "documents      100" in info.stdout and "shards         3" in info.stdout
    data = json.loads(run("info", d / "sh3", "--json").stdout)
    assert [s["offset"] for s in data["shards"]] == [0, 33, 66] and data["documents"] == 100
    assert data["postings"] == json.loads(run("info", d / "plain", "--json").stdout)["postings"]
    single = (d / "single-25.trec").read_bytes()
    for folder, extra in (("sh3", []), ("sh4", ["--pieces", "3"]), ("plain", ["--index-memory", "4KiB"])):
        out = tmp_path / f"{folder}.trec"
        result = run("search", d / folder, cli_data["queries"], "-o", out, "--k", 25, "--no-progress", *extra)
        assert result.exit_code == 0, result.stderr
        assert out.read_bytes() == single, (folder, extra)
    assert "streamed in" in result.stderr


def test_cli_sharded_quantized_index_ranks_like_one_quantized_index(cli_data, tmp_path):
    """Shards share the collection's quantization step (a shard's own step would rank differently)."""
    d = cli_data["dir"]
    assert (d / "single-q8-25.trec").read_bytes() != (d / "single-float-25.trec").read_bytes()  # it shows
    for extra in ([], ["--pieces", "3"]):
        out = tmp_path / "q8sh2.trec"
        result = run(
            "search", d / "q8sh2", cli_data["cqueries"], "-o", out, "--k", 25, "--no-progress", "--overwrite", *extra
        )
        assert result.exit_code == 0, result.stderr
        assert out.read_bytes() == (d / "single-q8-25.trec").read_bytes(), extra


def torchrun(tmp: Path, nproc: int, *args: object) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=nproc gpusparse ARGS`` with this tree's package."""
    launcher = tmp / "gpusparse_main.py"
    launcher.write_text("from gpusparse.cli import main\n\nmain()\n", encoding="utf-8")
    src = str(Path(gpusparse.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", launcher]
    return subprocess.run(
        [str(c) for c in cmd + list(args)], capture_output=True, text=True, timeout=300, env=env, check=False
    )


@pytest.mark.parametrize(
    ("nproc", "folder", "k", "extra"),
    [(2, "sh4", 25, ["--pieces", "2"]), (3, "sh3", 7, []), (2, "q8sh2", 25, [])],
)
def test_cli_torchrun_writes_the_single_process_run(cli_data, tmp_path, nproc, folder, k, extra):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "run.trec"
    queries = cli_data["cqueries"] if folder.startswith("q8") else cli_data["queries"]
    proc = torchrun(
        tmp_path,
        nproc,
        "search",
        cli_data["dir"] / folder,
        queries,
        "-o",
        out,
        "--k",
        k,
        "--no-progress",
        "--distributed",
        "--device",
        "cpu",
        *extra,
    )  # fmt: skip  (gloo on the CPU: a GPU machine may have fewer GPUs than processes)
    assert proc.returncode == 0, proc.stderr
    single = f"single-q8-{k}.trec" if folder.startswith("q8") else f"single-{k}.trec"
    assert out.read_bytes() == (cli_data["dir"] / single).read_bytes()
    assert [p.name for p in out_dir.iterdir()] == ["run.trec"]  # other processes wrote nothing
    assert proc.stderr.count("searched 10 queries on") == 1  # one report, from process 0
    assert f"on {nproc} processes" in proc.stderr


def test_cli_torchrun_more_processes_than_shards(cli_data, tmp_path):
    out = tmp_path / "run.trec"
    proc = torchrun(
        tmp_path,
        3,
        "search",
        cli_data["dir"] / "sh2",
        cli_data["queries"],
        "-o",
        out,
        "--no-progress",
        "--distributed",
        "--device",
        "cpu",
    )  # fmt: skip  (gloo: a GPU machine may have fewer GPUs than processes)
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("gpusparse: error: ")]
    assert len(ours) == 1, proc.stderr  # printed once, by process 0
    assert "the index has 2 shard(s) but 3 processes" in ours[0] and "--shards 3" in ours[0]
    assert "gpusparse/cli/" not in proc.stderr  # no traceback from our processes (torchrun prints its own)
    assert not out.exists()


def test_cli_distributed_without_torchrun(cli_data, tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    result = run("search", cli_data["dir"] / "sh2", cli_data["queries"], "-o", tmp_path / "r", "--distributed")
    assert_one_line_error(result, "runs under torchrun")
    assert not (tmp_path / "r").exists()


def test_cli_bad_shard_and_streaming_options(cli_data, tmp_path):
    d = cli_data["dir"]
    assert run("index", cli_data["docs"], "-o", tmp_path / "x", "--shards", 0).exit_code == 2
    assert_one_line_error(
        run("index", cli_data["docs"], "-o", tmp_path / "x", "--shards", 101, "--vocab", "integer:40"),
        "cannot split 100 documents into 101",
    )
    assert not (tmp_path / "x").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    q, out = cli_data["queries"], tmp_path / "r"
    assert run("search", d / "sh2", q, "-o", out, "--pieces", 0).exit_code == 2
    assert run("search", d / "sh2", q, "-o", out, "--index-memory", "lots").exit_code == 2
    assert_one_line_error(run("search", d / "sh2", q, "-o", out, "--pieces", 1000), "cannot split 100 documents")
    assert not out.exists()


def test_cli_damaged_sharded_folders(cli_data, tmp_path):
    import shutil

    q, out = cli_data["queries"], tmp_path / "r"
    bad = tmp_path / "bad"
    shutil.copytree(cli_data["dir"] / "sh3", bad)
    scores = bad / "shard-0001" / "scores.npy"
    data = bytearray(scores.read_bytes())
    data[-1] ^= 0xFF
    scores.write_bytes(bytes(data))
    assert_one_line_error(run("search", bad, q, "-o", out), "shard shard-0001", "checksum")
    with pytest.raises(IndexFormatError, match="shard-0001"):
        Index.load(bad)
    shutil.rmtree(bad / "shard-0001")
    assert_one_line_error(run("search", bad, q, "-o", out), "shard shard-0001 is missing")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["format_version"] = 99
    (bad / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(run("info", bad), "upgrade gpusparse")
    # A sharded folder takes updates (tests/test_shard_updates.py); ids it holds are refused.
    assert_one_line_error(run("add", cli_data["dir"] / "sh2", cli_data["docs"]), "100 id(s) already in the index")
    assert not out.exists()


def test_load_shard_of_a_plain_folder(cli_data):
    index, offset, n = load_shard(cli_data["dir"] / "plain")
    assert (offset, n, index.n_docs) == (0, 100, 100)
    with pytest.raises(gpusparse.InputError, match="1 shard"):
        load_shard(cli_data["dir"] / "plain", 1, 2)


# -- GPUs ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_on_cuda_equals_resident():
    docs, qs = tied_collection(21, n_base=300, copies=4), queries_for(21, 40)
    full = Index.build(docs)
    resident = full.to("cuda")
    import gpusparse.layout.tiled as tiled_mod

    for n_pieces in (2, 5):
        streamed = StreamedIndex(full, n_pieces, "cuda")
        assert all(p.doc_ids.is_pinned() for _, p in streamed.pieces)
        for k in (1, 10, 500):
            want = resident.search(qs, k)
            # Each piece brings the layout the search uses: none is built while searching.
            with pytest.MonkeyPatch.context() as m:
                m.setattr(tiled_mod, "build_tiled", lambda *a, **kw: pytest.fail("layout rebuilt per search"))
                got = streamed.search(qs, k, batch_size=16)
            assert_same(got, (want.scores, want.ids), (n_pieces, k))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_shards_equal_one_gpu(tmp_path):
    """Two GPUs' shards (lower bounds exchanged before rescoring, pipelined batches) against
    one GPU's search of the whole synthetic collection, bit for bit."""
    from gpusparse import Vocabulary
    from gpusparse.synthetic import generate

    from .distributed_worker import nccl_worker

    n_docs, n_queries, ks = 60_000, 40, [1, 10, 100, 1000]
    mp.spawn(nccl_worker, args=(2, str(tmp_path), n_docs, n_queries, ks), nprocs=2)
    (di, dt, dw), (qi, qt, qw) = generate(n_docs, n_queries, seed=3)
    index = Index.from_csr(di, dt, dw, Vocabulary.bert(), device="cuda")
    queries = SparseCollection(qi.numpy(), qt.numpy(), qw.numpy(), vocab=Vocabulary.bert())
    got = [torch.load(tmp_path / f"nccl{r}.pt") for r in range(2)]
    for k in ks:
        want = index.search(queries, k)
        assert int((want.ids >= 0).sum()) > 0
        keys = [(k, None), (k, 16)] + ([("rerun", k, None), ("rerun", k, 16)] if k == max(ks) else [])
        for key in keys:
            for per_rank in got:
                assert_same(per_rank[key], (want.scores, want.ids), key)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cli_nccl_two_gpus(cli_data, tmp_path):
    out = tmp_path / "run.trec"
    proc = torchrun(
        tmp_path, 2, "search", cli_data["dir"] / "sh2", cli_data["queries"], "-o", out, "--k", 25,
        "--no-progress", "--distributed", "--device", "cuda",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "(cuda)" in proc.stderr
    assert out.read_bytes() == (cli_data["dir"] / "single-25.trec").read_bytes()
