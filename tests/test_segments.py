"""Segmented indexes: add / delete / compact against fresh builds, crashes, torn files, races."""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusparse import Index, IndexFormatError, InputError, SparseCollection, write_jsonl
from gpusparse.cli import main
from gpusparse.segments import SegmentedIndex

from .segment_writer import VOCAB, docs_for, run_batches, run_writer

KS = (1, 3, 10, 200)


def queries(seed: int, n: int = 12) -> SparseCollection:
    q = docs_for([f"q{seed}-{i}" for i in range(n)])
    return SparseCollection(q.indptr, q.indices, q.values, q.ids, VOCAB)


def assert_same_as_fresh(index: SegmentedIndex, live: list[str], qs: SparseCollection) -> None:
    """Same top-k string ids and bit-identical scores as a fresh build of ``live``, in order."""
    assert index.ids == live
    assert index.n_docs == len(live)
    fresh = Index.build(docs_for(live)) if live else None
    for k in KS:
        got = index.search(qs, k)
        if fresh is None:
            assert (got.positions == -1).all() and (got.scores == 0).all()
            continue
        want = fresh.search(qs, k)
        assert got.scores.numpy().tobytes() == want.scores.numpy().tobytes(), k
        want_ids = [[fresh.ids[d] if d >= 0 else None for d in row] for row in want.ids.tolist()]
        assert got.ids == want_ids, k


# -- random sequences against a fresh build ------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_updates_match_fresh_build(tmp_path, seed):
    rng = np.random.default_rng(seed)
    qs = queries(seed)
    first = [f"s{seed}-0-{j}" for j in range(int(rng.integers(0, 12)))]
    index = SegmentedIndex.create(tmp_path / "idx", docs_for(first) if first else VOCAB)
    live = list(first)  # insertion order
    for op in range(1, 10):
        r = rng.random()
        if r < 0.45:
            new = [f"s{seed}-{op}-{j}" for j in range(int(rng.integers(0, 9)))]
            upsert = live and rng.random() < 0.4
            again = rng.choice(live, size=min(2, len(live)), replace=False).tolist() if upsert else []
            rep = index.add(docs_for(new + again), upsert=bool(upsert))
            assert (rep.added, rep.deleted) == (len(new) + len(again), len(again))
            live = [i for i in live if i not in again] + new + again
        elif r < 0.85:
            gone = rng.choice(live, size=min(len(live), int(rng.integers(0, 6))), replace=False).tolist()
            rep = index.delete([*gone, "no-such-id"])
            assert (rep.deleted, rep.unknown) == (len(gone), 1)
            live = [i for i in live if i not in gone]
        else:
            index.compact()
            assert len(index.segments) == (1 if live else 0)
        assert_same_as_fresh(index, live, qs)
    assert_same_as_fresh(SegmentedIndex.load(tmp_path / "idx", mmap=False), live, qs)


_OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 6), st.integers(0, 2)),  # new documents, upserted ones
    st.tuples(st.just("delete"), st.lists(st.integers(0, 40), max_size=5), st.booleans()),  # picks, unknown id
    st.tuples(st.just("compact"), st.none(), st.none()),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OPS, min_size=1, max_size=7), start=st.integers(0, 5))
def test_property_updates_match_fresh_build(ops, start):
    qs = queries(11, n=6)
    with tempfile.TemporaryDirectory() as tmp:
        first = [f"h0-{j}" for j in range(start)]
        index = SegmentedIndex.create(Path(tmp) / "idx", docs_for(first) if first else VOCAB)
        live = list(first)
        for n, (kind, a, b) in enumerate(ops, start=1):
            if kind == "add":
                new, again = [f"h{n}-{j}" for j in range(a)], live[:b]
                index.add(docs_for(new + again), upsert=True)
                live = [i for i in live if i not in again] + new + again
            elif kind == "delete":
                gone = sorted({live[i % len(live)] for i in a}) if live else []
                rep = index.delete(gone + (["nope"] if b else []))
                assert (rep.deleted, rep.unknown) == (len(gone), int(b))
                live = [i for i in live if i not in gone]
            else:
                index.compact()
        assert_same_as_fresh(index, live, qs)
        assert_same_as_fresh(SegmentedIndex.load(Path(tmp) / "idx"), live, qs)


def test_many_segments_and_compact_give_the_same_results(tmp_path):
    qs = queries(99, n=20)
    index = SegmentedIndex.create(tmp_path / "idx", VOCAB)
    live: list[str] = []
    for b in range(8):
        ids = [f"m{b}-{j}" for j in range(15)]
        index.add(docs_for(ids))
        live += ids
    index.delete(live[::3])
    live = [i for i in live if i not in set(live[::3])]
    assert len(index.segments) == 8
    before = index.search(qs, 50)
    assert_same_as_fresh(index, live, qs)
    index.compact()
    after = index.search(qs, 50)
    assert len(index.segments) == 1 and after.ids == before.ids and (after.scores == before.scores).all()
    assert_same_as_fresh(index, live, qs)


def test_re_adding_a_live_id_is_an_error_unless_upsert(tmp_path):
    index = SegmentedIndex.create(tmp_path / "idx", docs_for(["a", "b"]))
    with pytest.raises(InputError, match=r"already in the index.*'b'"):
        index.add(docs_for(["c", "b"]))
    assert index.refresh().ids == ["a", "b"] and index.generation == 1  # nothing committed
    index.delete(["b"])
    index.add(docs_for(["b"]))  # deleted ids may come back
    rep = index.add(docs_for(["a"]), upsert=True)
    assert rep.deleted == 1 and index.ids == ["b", "a"]


def test_snapshot_does_not_see_later_commits(tmp_path):
    writer = SegmentedIndex.create(tmp_path / "idx", docs_for(["a"]))
    reader = SegmentedIndex.load(tmp_path / "idx")
    writer.add(docs_for(["b"]))
    writer.compact()  # the reader's segment files are gone from the folder now
    assert reader.ids == ["a"]
    assert reader.search(queries(1), 5).scores.shape == (12, 5)
    assert reader.refresh().ids == ["a", "b"]
    reader.delete(["a"])  # writes apply to the latest state
    assert writer.refresh().ids == ["b"]


def test_plain_index_folder_opens_and_converts_on_first_write(tmp_path):
    ids = [f"p{i}" for i in range(20)]
    Index.build(docs_for(ids)).save(tmp_path / "plain")
    qs = queries(5)
    index = SegmentedIndex.load(tmp_path / "plain")
    assert index.generation == 0 and len(index.segments) == 1
    assert_same_as_fresh(index, ids, qs)
    index.delete(["p3"])
    index.add(docs_for(["p20"]))
    live = [i for i in ids if i != "p3"] + ["p20"]
    assert_same_as_fresh(SegmentedIndex.load(tmp_path / "plain"), live, qs)
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [
        "CURRENT", "LOCK", "MANIFEST-000002.json", "deletions", "segments",
    ]  # fmt: skip


def test_garbage_from_crashes_is_ignored_then_cleaned(tmp_path):
    path = tmp_path / "idx"
    index = SegmentedIndex.create(path, docs_for(["a", "b"]))
    (path / "segments" / ".seg-000009-dead.tmp-1234").mkdir()
    Index.build(docs_for(["zombie"])).save(path / "segments" / "seg-000009-deadbeef")
    (path / "MANIFEST-000009.json").write_text("{")
    (path / ".CURRENT.tmp-abcd").write_text("MANIFEST-000009.json 00")
    (path / "deletions" / "seg-x-000009-dead.npy").write_bytes(b"junk")
    assert SegmentedIndex.load(path).ids == ["a", "b"]
    index.delete(["a"])
    assert sorted(p.name for p in path.iterdir()) == [
        "CURRENT",
        "LOCK",
        "MANIFEST-000002.json",
        "deletions",
        "segments",
    ]
    assert [p.name for p in (path / "segments").iterdir()] == [index.segments[0].name]
    assert len(list((path / "deletions").iterdir())) == 1


# -- torn and corrupted files --------------------------------------------------------------


@pytest.fixture
def two_segments(tmp_path) -> Path:
    index = SegmentedIndex.create(tmp_path / "idx", docs_for([f"t{i}" for i in range(30)]))
    index.add(docs_for(["u1", "u2"]))
    index.delete(["t1"])
    return tmp_path / "idx"


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_torn_segment_file_is_refused(two_segments, damage):
    seg = sorted((two_segments / "segments").iterdir())[0]
    f = seg / "scores.npy"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40
    else:
        data = data[: len(data) // 2]
    f.write_bytes(bytes(data))
    what = "checksum" if damage == "flip" else "truncated"
    with pytest.raises(IndexFormatError, match=rf"segment {seg.name}: .*scores.npy.*{what}"):
        SegmentedIndex.load(two_segments)


@pytest.mark.parametrize(
    "target", ["manifest", "missing-manifest", "current", "deletions", "segment-manifest", "missing-segment"]
)
def test_torn_metadata_is_refused(two_segments, target):
    if target == "manifest":
        f = next(two_segments.glob("MANIFEST-*.json"))
        f.write_bytes(f.read_bytes()[:-10])
    elif target == "missing-manifest":
        next(two_segments.glob("MANIFEST-*.json")).unlink()
    elif target == "current":
        (two_segments / "CURRENT").write_text("MANIFEST-0000")
    elif target == "deletions":
        f = next((two_segments / "deletions").iterdir())
        f.write_bytes(f.read_bytes()[:-1] + b"\xff")
    elif target == "segment-manifest":
        f = next((two_segments / "segments").iterdir()) / "manifest.json"
        f.write_text(f.read_text().replace('"n_docs"', '"n_docs" ', 1))
    else:
        for seg in (two_segments / "segments").iterdir():
            (seg / "manifest.json").unlink()
    with pytest.raises(IndexFormatError, match=r"corrupted|unreadable|missing"):
        SegmentedIndex.load(two_segments)


def test_not_an_index(tmp_path):
    with pytest.raises(IndexFormatError, match="no such index folder"):
        SegmentedIndex.load(tmp_path / "nothing")
    with pytest.raises(IndexFormatError, match="not a GPUSparse index"):
        SegmentedIndex.load(tmp_path)


# -- crashes and concurrent readers --------------------------------------------------------


def _context() -> multiprocessing.context.BaseContext:
    """Forked from a server that imported gpusparse once: a writer starts in milliseconds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.segment_writer"])
    return ctx


def _apply(live: list[str], rec: dict) -> list[str]:
    if rec["begin"] == "add":
        return live + rec["ids"]
    if rec["begin"] == "delete":
        return [i for i in live if i not in set(rec["ids"])]
    return live


def test_writer_killed_at_random_points_loses_no_commit(tmp_path):
    path, log = tmp_path / "idx", tmp_path / "log.jsonl"
    SegmentedIndex.create(path, docs_for(["seed-0", "seed-1"]))
    ctx, rng = _context(), np.random.default_rng(2026)
    live, qs = ["seed-0", "seed-1"], queries(7)
    states = {"old": 0, "new": 0, "mid_op": 0}
    deadline = time.monotonic() + 40
    trials = 0
    while trials < 25 and time.monotonic() < deadline:
        log.write_text("")
        proc = ctx.Process(target=run_writer, args=(str(path), str(log), trials, f"k{trials}", 1000))
        proc.start()
        time.sleep(float(rng.uniform(0.02, 0.6)))
        proc.kill()  # SIGKILL
        proc.join()
        records = [json.loads(line) for line in log.read_text().splitlines()]
        inflight = None
        for rec in records:
            if "begin" in rec:
                inflight = rec
            else:
                live, inflight = _apply(live, inflight), None
        states["mid_op"] += inflight is not None
        index = SegmentedIndex.load(path)
        got = index.ids
        if inflight is not None and got == _apply(live, inflight) != live:
            live = got
            states["new"] += 1
        else:
            assert got == live, (trials, inflight)
            states["old"] += 1
        hits = {i for row in index.search(qs, 10).ids for i in row if i is not None}
        assert hits <= set(got)
        trials += 1
    assert trials >= 20, f"only {trials} trials in time"
    assert states["mid_op"] >= 5, states  # most kills land inside an add, delete or compact
    assert_same_as_fresh(SegmentedIndex.load(path), live, qs)
    index = SegmentedIndex.load(path)
    index.delete([])  # the next writer cleans what the crashes left
    assert not [p for p in path.rglob("*") if ".tmp" in p.name]


def test_concurrent_reader_sees_whole_commits(tmp_path):
    path, batch = tmp_path / "idx", 4
    SegmentedIndex.create(path, VOCAB)
    proc = _context().Process(target=run_batches, args=(str(path), "c", 40, batch))
    proc.start()
    qs = queries(3)
    generations = set()
    try:
        while proc.is_alive() or not generations:
            index = SegmentedIndex.load(path)
            generations.add(index.generation)
            counts: dict[str, int] = {}
            for i in index.ids:
                counts[i.split("-")[0]] = counts.get(i.split("-")[0], 0) + 1
            assert set(counts.values()) <= {batch}, counts  # no half-applied commit
            hits = {i for row in index.search(qs, 20).ids for i in row if i is not None}
            assert hits <= set(index.ids)
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert len(generations) > 3


# -- command line --------------------------------------------------------------------------


def _cli(*args: object, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_cli_add_delete_compact(tmp_path):
    ids = [f"d{i}" for i in range(10)]
    Index.build(docs_for(ids)).save(tmp_path / "idx")
    write_jsonl(docs_for(["n1", "n2"]), tmp_path / "new.jsonl")
    res = _cli("add", tmp_path / "idx", tmp_path / "new.jsonl")
    assert res.exit_code == 0, res.stderr
    assert "added 2 documents" in res.stderr and "12 live documents in 2 segments" in res.stderr
    (tmp_path / "gone.txt").write_text("d1\nd2\n\nnope\n")
    res = _cli("delete", tmp_path / "idx", tmp_path / "gone.txt")
    assert res.exit_code == 0, res.stderr
    assert "deleted 2 documents (1 id not found: 'nope')" in res.stderr
    res = _cli("delete", tmp_path / "idx", "-", input="d3\n")
    assert "deleted 1 documents" in res.stderr
    res = _cli("compact", tmp_path / "idx")
    assert res.exit_code == 0, res.stderr
    assert "dropped 3 deleted documents" in res.stderr and "9 live documents in 1 segment " in res.stderr
    live = [i for i in ids if i not in ("d1", "d2", "d3")] + ["n1", "n2"]
    assert_same_as_fresh(SegmentedIndex.load(tmp_path / "idx"), live, queries(4))


def _assert_one_line_error(res, fragment: str) -> None:
    assert isinstance(res.exception, SystemExit) and res.exit_code == 1, res.exception
    lines = res.stderr.splitlines()
    assert lines[-1].startswith("gpusparse: error: ") and fragment in lines[-1], res.stderr
    assert "Traceback" not in res.output


def test_cli_errors_are_one_line(tmp_path):
    SegmentedIndex.create(tmp_path / "idx", docs_for(["a"]))
    write_jsonl(docs_for(["a"]), tmp_path / "dup.jsonl")
    _assert_one_line_error(_cli("add", tmp_path / "idx", tmp_path / "dup.jsonl"), "already in the index")
    res = _cli("add", tmp_path / "idx", tmp_path / "dup.jsonl", "--upsert")
    assert res.exit_code == 0 and "(1 replaced)" in res.stderr
    _assert_one_line_error(_cli("compact", tmp_path / "nothing"), "no such index folder")
    _assert_one_line_error(_cli("delete", tmp_path / "idx", tmp_path / "no.txt"), "no.txt")
    (tmp_path / "idx" / "CURRENT").write_text("garbage")
    _assert_one_line_error(_cli("compact", tmp_path / "idx"), "CURRENT")


def test_plain_loader_names_a_segmented_folder(tmp_path):
    SegmentedIndex.create(tmp_path / "idx", docs_for(["a"]))
    with pytest.raises(IndexFormatError, match=r"segmented index.*SegmentedIndex\.load"):
        Index.load(tmp_path / "idx")
    # Every command reads both kinds now (verify too: tests/test_verify_folders.py checks its answers).
    write_jsonl(docs_for(["q"]), tmp_path / "q.jsonl")
    res = _cli("verify", tmp_path / "idx", tmp_path / "q.jsonl")
    assert res.exit_code == 0 and "exact: yes" in res.output, res.output


def test_cli_search_and_info_on_an_updated_index(tmp_path):
    """gpusparse search/info read a segmented folder: the run equals a fresh build's of the survivors."""
    ids = [f"d{i}" for i in range(40)]
    Index.build(docs_for(ids)).save(tmp_path / "idx")
    write_jsonl(docs_for(["n1", "n2", "n3"]), tmp_path / "new.jsonl")
    assert _cli("add", tmp_path / "idx", tmp_path / "new.jsonl").exit_code == 0
    (tmp_path / "gone.txt").write_text("d3\nd17\nn2\n")
    assert _cli("delete", tmp_path / "idx", tmp_path / "gone.txt").exit_code == 0
    survivors = [i for i in [*ids, "n1", "n2", "n3"] if i not in {"d3", "d17", "n2"}]
    Index.build(docs_for(survivors)).save(tmp_path / "fresh")
    queries = docs_for([f"q{i}" for i in range(12)])
    write_jsonl(queries, tmp_path / "q.jsonl")
    runs = {}
    for name in ("idx", "fresh"):
        out = tmp_path / f"{name}.trec"
        res = _cli("search", tmp_path / name, tmp_path / "q.jsonl", "-k", 50, "-o", out, "--device", "cpu")
        assert res.exit_code == 0, res.stderr
        runs[name] = out.read_text()
    assert runs["idx"] == runs["fresh"] and runs["idx"]
    info = _cli("info", tmp_path / "idx", "--json")
    assert info.exit_code == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["documents"] == len(survivors) and data["deleted_documents"] == 3 and data["segments"] == 2
