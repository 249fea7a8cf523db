"""add, delete, upsert and compact on sharded folders (gpusparse.shard_updates).

After every update the folder must search like a fresh build of the collection it now
holds (the old documents in order, deleted ones left out, then the added ones), compared
with the float64 reference, ties included: the collections repeat documents, so tied
scores fall across shards. Everything runs on the CPU in seconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import Index, SparseCollection, write_jsonl
from gpusparse.errors import InputError
from gpusparse.quantize import Quantization, quantize_collection
from gpusparse.serve.served import load_served
from gpusparse.shard_updates import add_sharded, compact_sharded, delete_sharded
from gpusparse.shards import document_ranges, drop_documents, load_sharded, read_sharded_manifest, save_sharded

from .reference import canonical_scores, random_collection, reference_topk
from .test_distributed import N_TERMS, assert_one_line_error, queries_for, run, tied_collection, torchrun

KS = [1, 5, 40, 200]


def rows_of(coll: SparseCollection) -> dict[str, sp.csr_matrix]:
    m = coll.to_scipy()
    return {i: m[r] for r, i in enumerate(coll.ids)}


def collection(rows: dict[str, sp.csr_matrix]) -> SparseCollection:
    """The documents in ``rows``' order (insertion order: the order ties are ranked by)."""
    mat = sp.vstack(list(rows.values()), format="csr") if rows else sp.csr_matrix((0, N_TERMS), dtype=np.float32)
    return SparseCollection.from_scipy(mat.astype(np.float32), ids=list(rows))


def fresh(ids_seed: str, base: SparseCollection) -> SparseCollection:
    """Documents with new ids ``{ids_seed}0 ..``, copies of ``base``'s (so their scores tie)."""
    return SparseCollection.from_scipy(base.to_scipy(), ids=[f"{ids_seed}{i}" for i in range(len(base))])


def assert_searches_like(folder: Path, rows: dict[str, sp.csr_matrix], qs: SparseCollection) -> None:
    """``folder`` (loaded whole, and shard by shard) ranks as the float64 reference over ``rows``."""
    want_coll = collection(rows)
    index = Index.load(folder)
    assert index.ids == list(rows)
    plain = Index.build(want_coll)
    ref = canonical_scores(want_coll, qs)
    for k in KS:
        got = index.search(qs, k)
        want = plain.search(qs, k)
        assert torch.equal(got.ids, want.ids) and got.scores.numpy().tobytes() == want.scores.numpy().tobytes(), k
        rs, ri = reference_topk(ref, k)
        w = min(k, got.ids.shape[1])
        assert np.array_equal(got.ids[:, :w].numpy(), ri[:, :w]) and np.array_equal(
            got.scores[:, :w].numpy(), rs[:, :w]
        )
    m = read_sharded_manifest(folder)
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("shard-")) == sorted(
        e["name"] for e in m["shards"]
    )  # no shard left behind
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]
    for i, e in enumerate(m["shards"]):
        part, offset = load_sharded(folder, range(i, i + 1))
        assert offset == e["offset"] and part.ids == list(rows)[offset : offset + part.n_docs]


def sharded_folder(tmp_path: Path, docs: SparseCollection, n: int, name: str = "sh") -> Path:
    folder = tmp_path / name
    save_sharded((Index.build(docs[a:b]) for a, b in document_ranges(len(docs), n)), folder)
    return folder


# -- dropping documents ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drop_documents_equals_a_build_of_the_survivors(seed):
    docs = tied_collection(seed)
    rng = np.random.default_rng(seed)
    for gone in (rng.random(len(docs)) < 0.3, np.zeros(len(docs), bool), np.ones(len(docs), bool)):
        got = drop_documents(Index.build(docs), gone)
        keep = np.flatnonzero(~gone)
        want = Index.build(SparseCollection.from_scipy(docs.to_scipy()[keep], ids=[docs.ids[i] for i in keep]))
        for name, arr in want.arrays().items():
            assert torch.equal(got.arrays()[name], arr), name
        assert got.ids == want.ids and got.stats() == want.stats()
    with pytest.raises(ValueError, match="shape"):
        drop_documents(Index.build(docs), np.zeros(3, bool))


# -- the Python API ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_random_updates_search_like_a_fresh_build(tmp_path, seed):
    rng = np.random.default_rng(seed)
    docs, qs = tied_collection(seed), queries_for(seed)
    folder = sharded_folder(tmp_path, docs, 3)
    rows = rows_of(docs)
    made = 0
    for step in range(8):
        op = (
            ["add", "delete", "upsert", "compact"][step % 4]
            if step < 4
            else str(rng.choice(["add", "delete", "upsert"]))
        )
        if op == "add":
            new = fresh(f"s{step}-", docs[int(rng.integers(0, 50)) :][: int(rng.integers(1, 30))])
            rep = add_sharded(folder, new, max_shard_docs=int(rng.integers(20, 60)))
            rows.update(rows_of(new))
            assert rep.added == len(new)
        elif op == "delete":
            ids = [str(i) for i in rng.choice(list(rows), size=min(len(rows), 12), replace=False)] + ["no-such-id"]
            rep = delete_sharded(folder, ids)
            for i in ids[:-1]:
                del rows[i]
            assert (rep.deleted, rep.unknown, rep.unknown_ids) == (len(ids) - 1, 1, ("no-such-id",))
        elif op == "upsert":
            old = [str(i) for i in rng.choice(list(rows), size=5, replace=False)]
            new = SparseCollection.from_scipy(
                random_collection(rng, 5, N_TERMS, 5, quantized=True).to_scipy(), ids=[*old[:4], f"u{made}"]
            )
            made += 1
            rep = add_sharded(folder, new, upsert=True)
            for i in old[:4]:
                del rows[i]  # the new version counts as added now: it goes to the end
            rows.update(rows_of(new))
            assert (rep.added, rep.deleted) == (5, 4)
        else:
            n_shards = len(read_sharded_manifest(folder)["shards"])
            compact_sharded(folder)
            sizes = [e["n_docs"] for e in read_sharded_manifest(folder)["shards"]]
            assert max(sizes) - min(sizes) <= 1 and len(sizes) == n_shards
        assert_searches_like(folder, rows, qs)
    assert read_sharded_manifest(folder)["generation"] == 8


def test_add_fills_the_last_shard_then_starts_a_new_one(tmp_path):
    docs = tied_collection(4)  # 100 documents: shards of 33, 33, 34
    folder = sharded_folder(tmp_path, docs, 3)
    add_sharded(folder, fresh("a", docs[:5]))  # the last shard holds the most already: a new shard
    assert [e["n_docs"] for e in read_sharded_manifest(folder)["shards"]] == [33, 33, 34, 5]
    add_sharded(folder, fresh("b", docs[:20]))  # 25 <= 34: into the last shard
    assert [e["n_docs"] for e in read_sharded_manifest(folder)["shards"]] == [33, 33, 34, 25]
    add_sharded(folder, fresh("c", docs[:10]), max_shard_docs=100)
    assert [e["n_docs"] for e in read_sharded_manifest(folder)["shards"]] == [33, 33, 34, 35]
    names = [e["name"] for e in read_sharded_manifest(folder)["shards"]]
    compact_sharded(folder)
    assert [e["n_docs"] for e in read_sharded_manifest(folder)["shards"]] == [33, 34, 34, 34]
    gen = read_sharded_manifest(folder)["generation"]
    assert compact_sharded(folder).generation == gen  # already even: nothing written
    assert names[:3] == ["shard-0000", "shard-0001", "shard-0002"]  # untouched shards were kept, not copied


def test_deleting_everything_then_adding(tmp_path):
    docs, qs = tied_collection(5), queries_for(5)
    folder = sharded_folder(tmp_path, docs, 2)
    assert delete_sharded(folder, docs.ids).deleted == len(docs)
    assert [e["n_docs"] for e in read_sharded_manifest(folder)["shards"]] == [0]  # one empty shard stays
    assert Index.load(folder).search(qs, 5).ids.max() == -1
    assert compact_sharded(folder).generation == 1
    new = fresh("n", docs[:7])
    add_sharded(folder, new)
    assert [e["n_docs"] for e in read_sharded_manifest(folder)["shards"]] == [7]
    assert_searches_like(folder, rows_of(new), qs)


def test_refusals_write_nothing(tmp_path):
    docs = tied_collection(6)
    folder = sharded_folder(tmp_path, docs, 2)
    before = (folder / "manifest.json").read_bytes()
    with pytest.raises(InputError, match=r"2 id\(s\) already in the index: 'd3', 'd70'"):
        add_sharded(folder, SparseCollection.from_scipy(docs.to_scipy()[:3], ids=["d3", "new", "d70"]))
    other = SparseCollection.from_dicts([{"x": 1.0}], ids=["x1"])
    with pytest.raises(InputError, match="vocabulary"):
        add_sharded(folder, other)
    assert delete_sharded(folder, ["nope"]).unknown_ids == ("nope",)
    assert (folder / "manifest.json").read_bytes() == before


def test_quantized_folder_keeps_its_step(tmp_path):
    """Added documents are quantized with the folder's step (not their own), as one quantized
    build of the final collection with that step ranks them."""
    rng = np.random.default_rng(7)
    docs = SparseCollection.from_scipy(
        random_collection(rng, 60, N_TERMS, 5).to_scipy(), ids=[f"d{i}" for i in range(60)]
    )
    qs = queries_for(7)
    qdocs, report = quantize_collection(docs, 8)
    q = report.quantization
    parts = []
    for a, b in document_ranges(60, 3):
        part = Index.build(qdocs[a:b])
        part.quantization = q
        parts.append(part)
    folder = tmp_path / "q"
    save_sharded(parts, folder)
    new = SparseCollection.from_scipy(
        random_collection(rng, 8, N_TERMS, 5).to_scipy() * 0.5, ids=[f"n{i}" for i in range(8)]
    )
    add_sharded(folder, new)
    delete_sharded(folder, ["d0", "d31"])
    keep = [i for i in range(60) if i not in (0, 31)]
    kept = SparseCollection.from_scipy(docs.to_scipy()[keep], ids=[docs.ids[i] for i in keep])
    final = SparseCollection.concat([kept, new])
    want = Index.build(quantize_collection(final, q.bits, q.step)[0])
    want.quantization = q
    got = Index.load(folder)
    assert got.quantization == q
    for k in KS:
        a, b = got.search(qs, k), want.search(qs, k)
        assert torch.equal(a.ids, b.ids) and a.scores.numpy().tobytes() == b.scores.numpy().tobytes()
    too_big = SparseCollection.from_dicts([{"3": 1e6}], ids=["big"], vocab=docs.vocab)
    with pytest.raises(InputError):
        add_sharded(folder, too_big)
    assert (
        Quantization.from_dict(
            json.loads((folder / read_sharded_manifest(folder)["shards"][-1]["name"] / "manifest.json").read_text())[
                "quantization"
            ]
        )
        == q
    )


def test_a_crash_leaves_the_old_or_the_new_state(tmp_path, monkeypatch):
    import gpusparse.shard_updates as su

    docs, qs = tied_collection(8), queries_for(8)
    folder = sharded_folder(tmp_path, docs, 3)
    rows = rows_of(docs)

    def crash(*_: object) -> None:
        raise KeyboardInterrupt  # killed before the manifest is replaced: the new shards are garbage

    with monkeypatch.context() as mp:
        mp.setattr(su.os, "replace", crash)
        with pytest.raises(KeyboardInterrupt):
            delete_sharded(folder, ["d1", "d2", "d90"])
    assert len([p for p in folder.iterdir() if p.name.startswith("shard-")]) > 3  # left behind
    assert Index.load(folder).ids == list(rows)  # the old state
    with monkeypatch.context() as mp:  # killed after the commit, before the old shards are removed
        mp.setattr(su, "_collect_garbage", lambda *a: None)
        delete_sharded(folder, ["d1"])
    del rows["d1"]
    assert Index.load(folder).ids == list(rows)  # the new state, though the old shards are still there
    add_sharded(folder, fresh("z", docs[:3]))  # the next writer removes them
    rows.update(rows_of(fresh("z", docs[:3])))
    assert_searches_like(folder, rows, qs)


def test_a_reader_redoes_a_read_that_an_update_raced(tmp_path, monkeypatch):
    """A reader that read the manifest before an update committed and removed its shards
    reads the new state instead of failing (or mixing the two)."""
    import gpusparse.shards as shards_mod

    docs = tied_collection(9)
    folder = sharded_folder(tmp_path, docs, 2)
    real = shards_mod._load_shards
    calls = []

    def racing(path, m, *args, **kwargs):
        if not calls:  # the first read: an update commits in between
            calls.append(1)
            delete_sharded(folder, ["d0"])
        return real(path, m, *args, **kwargs)

    monkeypatch.setattr(shards_mod, "_load_shards", racing)
    assert Index.load(folder).ids == docs.ids[1:]


def test_processes_that_loaded_different_states_all_refuse(tmp_path):
    import torch.multiprocessing as mp

    from .distributed_worker import snapshot_worker

    mp.spawn(snapshot_worker, args=(2, str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert (tmp_path / f"snapshot{rank}.txt").read_text() == "ok refused ok"


# -- the command line ----------------------------------------------------------------------------


def test_cli_updates_give_a_fresh_builds_run(tmp_path):
    """index --shards, then add / add --upsert / delete / compact: search, search --distributed
    (gloo, two processes), verify, info and the server read the folder, and the run equals
    that of a plain index built from the final collection."""
    docs, qs = tied_collection(12), queries_for(12)
    d = tmp_path
    write_jsonl(docs, d / "docs.jsonl")
    write_jsonl(qs, d / "q.jsonl")
    vocab = ["--vocab", f"integer:{N_TERMS}"]
    assert run("index", d / "docs.jsonl", "-o", d / "sh", "--shards", 3, "--no-progress", *vocab).exit_code == 0
    rows = rows_of(docs)
    new = fresh("n", docs[10:40])
    write_jsonl(new, d / "new.jsonl")
    r = run("add", d / "sh", d / "new.jsonl", "--no-progress")
    assert r.exit_code == 0, r.stderr
    assert "added 30 documents" in r.stderr and "in 4 shards (generation 1)" in r.stderr
    rows.update(rows_of(new))
    up = SparseCollection.from_scipy(docs.to_scipy()[:3], ids=["d5", "n7", "u0"])
    write_jsonl(up, d / "up.jsonl")
    assert_one_line_error(run("add", d / "sh", d / "up.jsonl", "--no-progress"), "2 id(s) already in the index", "'d5'")
    r = run("add", d / "sh", d / "up.jsonl", "--upsert", "--no-progress")
    assert r.exit_code == 0 and "(2 replaced)" in r.stderr, r.stderr
    del rows["d5"], rows["n7"]
    rows.update(rows_of(up))
    (d / "gone.txt").write_text("d0\nd99\nn3\nmissing-1\nmissing-2\n", encoding="utf-8")
    r = run("delete", d / "sh", d / "gone.txt")
    assert r.exit_code == 0, r.stderr
    assert "deleted 3 documents (2 ids not found: 'missing-1', 'missing-2')" in r.stderr
    for i in ("d0", "d99", "n3"):
        del rows[i]
    r = run("compact", d / "sh")
    assert r.exit_code == 0 and "spread the documents evenly" in r.stderr, r.stderr

    final = collection(rows)
    write_jsonl(final, d / "final.jsonl")
    assert run("index", d / "final.jsonl", "-o", d / "plain", "--no-progress", *vocab).exit_code == 0
    want = d / "plain.trec"
    assert run("search", d / "plain", d / "q.jsonl", "-o", want, "--k", 40, "--no-progress").exit_code == 0
    got = d / "sh.trec"
    r = run("search", d / "sh", d / "q.jsonl", "-o", got, "--k", 40, "--no-progress")
    assert r.exit_code == 0, r.stderr
    assert got.read_bytes() == want.read_bytes()
    r = run("verify", d / "sh", d / "q.jsonl", "--at", "10 40", "--device", "cpu", "--no-progress")
    assert r.exit_code == 0, r.stdout + r.stderr
    info = json.loads(run("info", d / "sh", "--json").stdout)
    assert info["documents"] == len(rows) and len(info["shards"]) == 4
    served = load_served(d / "sh")
    assert served.ids == list(rows) and torch.equal(
        served.search(qs, 40).ids, Index.load(d / "plain").search(qs, 40).ids
    )
    out_dir = d / "dist"
    out_dir.mkdir()
    proc = torchrun(
        d, 2, "search", d / "sh", d / "q.jsonl", "-o", out_dir / "run.trec", "--k", 40, "--no-progress",
        "--distributed", "--device", "cpu",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (out_dir / "run.trec").read_bytes() == want.read_bytes()


def test_cli_update_errors_are_one_line(tmp_path):
    docs = tied_collection(13)
    write_jsonl(docs[:5], tmp_path / "few.jsonl")
    write_jsonl(SparseCollection.from_dicts([{"x": 1.0}], ids=["x"]), tmp_path / "bert.jsonl")
    assert (
        run(
            "index", tmp_path / "few.jsonl", "-o", tmp_path / "sh", "--shards", 2, "--vocab", f"integer:{N_TERMS}"
        ).exit_code
        == 0
    )
    assert_one_line_error(
        run("add", tmp_path / "sh", tmp_path / "few.jsonl", "--no-progress"), "already in the index", "'d0'"
    )
    r = run("add", tmp_path / "sh", tmp_path / "bert.jsonl", "--no-progress")
    assert r.exit_code == 1 and r.stderr.count("gpusparse: error: ") == 1, r.stderr
    assert_one_line_error(run("delete", tmp_path / "sh", tmp_path / "no-such-file.txt"), "cannot read the id file")
    os.remove(tmp_path / "sh" / read_sharded_manifest(tmp_path / "sh")["shards"][0]["name"] / "ids.txt")
    assert_one_line_error(run("delete", tmp_path / "sh", tmp_path / "few.jsonl"), "ids")
