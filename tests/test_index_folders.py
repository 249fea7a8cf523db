"""Index folders against crafted and damaged manifests (issue 24): names that reach outside
the folder, malformed structure, and one-line errors instead of tracebacks."""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import signal
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpusparse import Index, IndexFormatError, InputError, write_jsonl
from gpusparse import storage as storage_mod
from gpusparse.cli import main
from gpusparse.segments import SegmentedIndex, read_ids
from gpusparse.shards import load_sharded, save_sharded, slice_documents

from .overwrite_writer import overwrite
from .segment_writer import docs_for

IDS = [f"d{i}" for i in range(12)]


def cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line(res, *fragments: str) -> None:
    assert isinstance(res.exception, SystemExit) and res.exit_code == 1, repr(res.exception)
    assert "Traceback" not in res.output
    last = res.stderr.splitlines()[-1]
    assert last.startswith("gpusparse: error: ") and all(f in last for f in fragments), res.stderr


def write_manifest(folder: Path, m: dict) -> None:
    """Write a plain or sharded manifest as a crafter would: consistent in every checksum,
    its own included (so each refusal below does not rest on that checksum)."""
    (folder / "manifest.json").write_text(json.dumps(storage_mod.seal(m)))


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


@pytest.fixture
def plain(tmp_path) -> Path:
    Index.build(docs_for(IDS)).save(tmp_path / "idx")
    return tmp_path / "idx"


def commit_segmented(path: Path, edit) -> None:
    """Rewrite the live segmented manifest with ``edit`` and re-point CURRENT at it, checksum
    and all, as a crafter who knows the format would."""
    name, _ = (path / "CURRENT").read_text().split()
    m = json.loads((path / name).read_text())
    edit(m)
    data = json.dumps(m).encode()
    (path / name).write_bytes(data)
    (path / "CURRENT").write_text(f"{name} {hashlib.sha256(data).hexdigest()}\n")


# -- item 5: listed names stay inside the folder -------------------------------------------


@pytest.mark.parametrize("absolute", [False, True])
def test_plain_manifest_naming_a_file_outside_is_refused_and_add_deletes_nothing(plain, absolute):
    victim = plain.parent / "victim.txt"
    victim.write_text("precious\n")
    m = read_manifest(plain)
    name = str(victim) if absolute else "../victim.txt"
    m["files"][name] = storage_mod._describe(victim)  # size and checksum match
    write_manifest(plain, m)
    with pytest.raises(IndexFormatError, match=r"is not a plain file name inside the index folder"):
        Index.load(plain)
    write_jsonl(docs_for(["new"]), plain.parent / "new.jsonl")
    assert_one_line(cli("add", plain, plain.parent / "new.jsonl"), "victim.txt", "not a plain file name")
    assert victim.read_text() == "precious\n"
    assert not (plain / "CURRENT").exists()


@pytest.mark.parametrize(
    ("where", "edit"),
    [
        ("segment", lambda m: m["segments"][0].update(name="../../elsewhere")),
        ("segment", lambda m: m["segments"][0].update(name="/tmp")),
        ("deletion file", lambda m: m["segments"][0]["deleted"].update(file="../../victim.txt")),
        ("vocabulary file", lambda m: m.update(vocab="../victim.txt")),
    ],
)
def test_segmented_manifest_naming_a_path_outside_is_refused(tmp_path, where, edit):
    path = tmp_path / "idx"
    index = SegmentedIndex.create(path, docs_for(IDS))
    index.delete(["d1"])
    commit_segmented(path, edit)
    with pytest.raises(IndexFormatError, match=rf"{where} .* is not a plain file name"):
        SegmentedIndex.load(path)
    assert_one_line(cli("delete", path, "-"), "not a plain file name")


def test_current_naming_a_path_outside_is_refused(tmp_path):
    path = tmp_path / "idx"
    SegmentedIndex.create(path, docs_for(IDS))
    (tmp_path / "MANIFEST-evil.json").write_text("{}")
    (path / "CURRENT").write_text(f"MANIFEST-x/../../MANIFEST-evil.json {hashlib.sha256(b'{}').hexdigest()}\n")
    with pytest.raises(IndexFormatError, match=r"CURRENT: manifest .* is not a plain file name"):
        SegmentedIndex.load(path)


@pytest.mark.parametrize("name", ["../idx", "/tmp", "a/b"])
def test_shard_manifest_naming_a_path_outside_is_refused(tmp_path, name):
    whole = Index.build(docs_for(IDS))
    save_sharded([slice_documents(whole, 0, 6), slice_documents(whole, 6, 12)], tmp_path / "sh")
    m = read_manifest(tmp_path / "sh")
    m["shards"][0]["name"] = name
    write_manifest(tmp_path / "sh", m)
    with pytest.raises(IndexFormatError, match=r"shard .* is not a plain file name"):
        load_sharded(tmp_path / "sh")


# -- item 8: malformed manifests give one line, not a traceback ----------------------------


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda m: m.update(files=list(m["files"])), "'files' is a list"),
        (lambda m: m.update(files={**m["files"], "ids.txt": 7}), "entry of ids.txt"),
        (lambda m: m.update(n_docs="12"), "n_docs"),
        (lambda m: m["files"].pop("vocab.txt"), "lists no vocab.txt"),
    ],
)
def test_malformed_plain_manifest_is_one_line(plain, edit, words):
    m = read_manifest(plain)
    edit(m)
    write_manifest(plain, m)
    with pytest.raises(IndexFormatError, match=words):
        Index.load(plain)
    assert_one_line(cli("info", plain), words)


def test_manifest_nested_too_deep_is_one_line(plain, tmp_path):
    deep = "[" * 200_000 + "]" * 200_000
    (plain / "manifest.json").write_text(deep)
    with pytest.raises(IndexFormatError, match="nested too deep"):
        Index.load(plain)
    assert_one_line(cli("info", plain), "nested too deep")
    path = tmp_path / "seg"
    SegmentedIndex.create(path, docs_for(IDS))
    name, _ = (path / "CURRENT").read_text().split()
    (path / name).write_text(deep)
    (path / "CURRENT").write_text(f"{name} {hashlib.sha256(deep.encode()).hexdigest()}\n")
    assert_one_line(cli("compact", path), "nested too deep")


def test_malformed_segment_entries_are_one_line(tmp_path):
    path = tmp_path / "idx"
    SegmentedIndex.create(path, docs_for(IDS))
    commit_segmented(path, lambda m: m.update(segments={"a": 1}))
    assert_one_line(cli("compact", path), "'segments' is a dict")
    commit_segmented(path, lambda m: m.update(segments=[{"name": "x"}]))
    assert_one_line(cli("compact", path), "n_docs")


# -- item 6: the manifests carry their own checksum ----------------------------------------


def tamper(folder: Path, edit) -> None:
    """Edit a manifest by hand, leaving its own checksum as it was."""
    m = read_manifest(folder)
    edit(m)
    (folder / "manifest.json").write_text(json.dumps(m, indent=1))


@pytest.mark.parametrize(
    ("quantize", "edit"),
    [
        (8, lambda m: m["quantization"].update(bits=4)),
        (None, lambda m: m.update(quantization={"bits": 8, "step": 0.0078125})),
        (None, lambda m: m.update(n_empty_docs=0)),
        (None, lambda m: m["files"].update(extra={"bytes": 1, "sha256": "0" * 64})),
    ],
)
def test_edited_plain_manifest_is_refused(tmp_path, quantize, edit):
    Index.build(docs_for(IDS), quantize=quantize).save(tmp_path / "idx")
    tamper(tmp_path / "idx", edit)
    with pytest.raises(IndexFormatError, match=r"manifest.json: the manifest does not match its own checksum"):
        Index.load(tmp_path / "idx")
    write_jsonl(docs_for(["q"]), tmp_path / "q.jsonl")
    res = cli("search", tmp_path / "idx", tmp_path / "q.jsonl", "-o", tmp_path / "run", "--device", "cpu")
    assert_one_line(res, "does not match its own checksum", "rebuild")


def test_reindented_manifest_still_loads(plain):
    (plain / "manifest.json").write_text(json.dumps(read_manifest(plain), indent=7, sort_keys=True))
    assert Index.load(plain).ids == IDS


def test_old_manifests_without_a_checksum_still_load(tmp_path):
    """Folders written before manifests were sealed (plain and sharded) load as before."""
    built = Index.build(docs_for(IDS), quantize=8)
    built.save(tmp_path / "idx")
    save_sharded([slice_documents(built, 0, 5), slice_documents(built, 5, 12)], tmp_path / "sh")
    top = read_manifest(tmp_path / "sh")
    for folder, entry in [(tmp_path / "idx", None), *((tmp_path / "sh" / e["name"], e) for e in top["shards"])]:
        m = read_manifest(folder)
        del m[storage_mod.SEAL]
        (folder / "manifest.json").write_text(json.dumps(m, indent=2))
        if entry is not None:
            entry["manifest_sha256"] = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    del top[storage_mod.SEAL]
    (tmp_path / "sh" / "manifest.json").write_text(json.dumps(top, indent=2))
    qs = docs_for([f"q{i}" for i in range(5)])
    want = built.search(qs, 10)
    for folder in (tmp_path / "idx", tmp_path / "sh"):
        got = Index.load(folder).search(qs, 10)
        assert got.ids.tolist() == want.ids.tolist() and got.scores.tolist() == want.scores.tolist()
    seg = SegmentedIndex.load(tmp_path / "idx")
    seg.add(docs_for(["new"]))  # an old plain folder still converts on its first write
    assert SegmentedIndex.load(tmp_path / "idx").ids == [*IDS, "new"]


@pytest.mark.parametrize("edit", [lambda m: m.update(n_postings=1), lambda m: m["shards"][1].update(n_postings=-5)])
def test_edited_shard_manifest_is_refused(tmp_path, edit):
    whole = Index.build(docs_for(IDS))
    save_sharded([slice_documents(whole, 0, 6), slice_documents(whole, 6, 12)], tmp_path / "sh")
    tamper(tmp_path / "sh", edit)
    with pytest.raises(IndexFormatError, match=r"sh/manifest\.json: the manifest does not match its own checksum"):
        load_sharded(tmp_path / "sh")
    assert_one_line(cli("info", tmp_path / "sh"), "does not match its own checksum")


# -- item 4: --overwrite under crashes, and the leftovers of killed writes ---------------


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_overwrite_killed_at_every_step_keeps_the_old_or_the_new_index(tmp_path, exchange):
    """SIGKILL before each file-changing step of an overwrite, one run per step: the path
    always loads as the old or the new index, and the next writer leaves no leftovers."""
    ctx = multiprocessing.get_context("forkserver")  # imports gpusparse once: a child starts in ms
    ctx.set_forkserver_preload(["tests.overwrite_writer"])
    path, new_ids = tmp_path / "idx", [f"n{i}" for i in range(7)]
    seen = {"old": 0, "new": 0, "no folder": 0}
    for step in range(1, 100):
        Index.build(docs_for(IDS)).save(path, overwrite=True)  # the next writer cleans up
        assert [p.name for p in tmp_path.iterdir()] == ["idx"], step
        proc = ctx.Process(target=overwrite, args=(str(path), new_ids, step, exchange))
        proc.start()
        proc.join()
        seen["no folder"] += not path.exists()
        got = Index.load(path).ids  # a missing folder loads from .idx.old-* (module docstring)
        assert got in (IDS, new_ids), step
        seen["old" if got == IDS else "new"] += 1
        if proc.exitcode == 0:
            break
        assert proc.exitcode == -signal.SIGKILL, (step, proc.exitcode)
    assert proc.exitcode == 0 and got == new_ids  # ran to the end: every step was a crash point
    assert seen["old"] >= 10 and seen["new"] >= 2, seen
    assert seen["no folder"] == (0 if exchange else 1), seen  # two renames: one window, recovered
    Index.build(docs_for(IDS)).save(path, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]


def test_a_live_writer_s_staging_folder_is_left_alone(tmp_path):
    path = tmp_path / "idx"
    Index.build(docs_for(IDS)).save(path)
    live = storage_mod.new_folder(path, True)  # held by this writer
    (tmp_path / ".idx.tmp-deadbeef").mkdir()  # a killed writer's
    (tmp_path / ".idx.tmp-deadbeef" / "scores.npy").write_bytes(b"x" * 1000)
    (tmp_path / ".other.tmp-12345678").mkdir()  # another index's: not this writer's business
    Index.build(docs_for(IDS[:3])).save(path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, ".other.tmp-12345678", "idx"]
    storage_mod.discard_folder(live)
    assert Index.load(path).ids == IDS[:3]


def test_no_index_but_an_interrupted_overwrite_s_old_folder(tmp_path):
    """Between the two renames (no renameat2): readers load the old folder; the next writer
    puts it back before anything else, so a write without --overwrite still refuses."""
    path = tmp_path / "idx"
    Index.build(docs_for(IDS)).save(path)
    path.rename(tmp_path / ".idx.old-0badf00d")
    assert Index.load(path).ids == IDS
    with pytest.raises(FileExistsError, match=r"idx already exists: pass overwrite=True \(gpusparse index"):
        Index.build(docs_for(["x"])).save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["idx"] and Index.load(path).ids == IDS


# -- item 8: the id file of gpusparse delete ------------------------------------------------


def test_read_ids_names_the_line_of_a_non_utf8_id(tmp_path, monkeypatch):
    f = tmp_path / "ids.txt"
    f.write_bytes(b"d1\n  d2 \n\nd\xe93\n")
    with pytest.raises(InputError, match=r"ids.txt:4: byte 0xe9 at column 2 is not UTF-8") as info:
        read_ids(f)
    assert "\n" not in str(info.value) and info.value.line == 4
    f.write_bytes("d1\n  d2 \n\nd\u00e93\r\n".encode())
    assert read_ids(f) == ["d1", "d2", "d\u00e93"]
    with pytest.raises(InputError, match=r"no.txt: cannot read the id file \(No such file"):
        read_ids(tmp_path / "no.txt")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a\n\xffb\n")))
    with pytest.raises(InputError, match=r"<stdin>:2: byte 0xff at column 1"):
        read_ids("-")


# -- item 11: messages that say what happened and what to do --------------------------------


def test_disk_full_names_the_file_and_the_index(tmp_path, monkeypatch):
    def short_write(file, arr, **kwargs):
        raise OSError("524576 requested and 524256 written")

    monkeypatch.setattr(np.lib.format, "write_array", short_write)  # what array_files.write_npy calls
    with pytest.raises(OSError, match=r"the disk is full: writing doc_ids.npy of the index failed") as info:
        Index.build(docs_for(IDS)).save(tmp_path / "idx")
    assert info.value.filename == str(tmp_path / "idx") and ".tmp-" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
    write_jsonl(docs_for(IDS), tmp_path / "docs.jsonl")
    res = cli("index", tmp_path / "docs.jsonl", "-o", tmp_path / "idx2", "--device", "cpu")
    assert_one_line(res, str(tmp_path / "idx2"), "the disk is full", "free space")


def test_an_index_written_meanwhile_is_named_not_the_temporary_folder(tmp_path):
    path = tmp_path / "idx"
    tmp = storage_mod.new_folder(path, False)
    Index.build(docs_for(IDS)).save(path)  # another process, between the check and the rename
    with pytest.raises(FileExistsError, match=r"idx already exists \(another process .*--overwrite") as info:
        storage_mod.replace_folder(tmp, path, overwrite=False)
    assert ".tmp-" not in str(info.value)
    storage_mod.discard_folder(tmp)


def test_output_under_a_file_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileExistsError, match=r"cannot create .*afile/x: .*afile is a file, not a folder"):
        Index.build(docs_for(IDS)).save(tmp_path / "afile" / "x")


def test_overwrite_replaces_a_segmented_index(tmp_path):
    SegmentedIndex.create(tmp_path / "idx", docs_for(IDS)).delete(["d1"])
    Index.build(docs_for(IDS[:2])).save(tmp_path / "idx", overwrite=True)
    assert Index.load(tmp_path / "idx").ids == IDS[:2]


def test_deleted_current_is_named(tmp_path):
    path = tmp_path / "idx"
    index = SegmentedIndex.create(path, docs_for(IDS))
    index.delete(["d1"])
    (path / "CURRENT").unlink()
    want = r"segmented index .* whose CURRENT file, which names its live manifest, is missing.*MANIFEST-000002\.json"
    with pytest.raises(IndexFormatError, match=want):
        SegmentedIndex.load(path)
    with pytest.raises(IndexFormatError, match=want):
        Index.load(path)
    assert_one_line(cli("compact", path), "whose CURRENT file")
    # The hint in the message, followed, brings the index back.
    name = "MANIFEST-000002.json"
    (path / "CURRENT").write_text(f"{name} {hashlib.sha256((path / name).read_bytes()).hexdigest()}\n")
    assert SegmentedIndex.load(path).ids == IDS[:1] + IDS[2:]


def test_segments_share_one_vocabulary_file(tmp_path):
    """An added segment's vocab.txt is a hard link to an existing segment's, not a new copy."""
    path = tmp_path / "idx"
    index = SegmentedIndex.create(path, docs_for(IDS))
    index.add(docs_for(["a"]))
    index.add(docs_for(["b"]))
    index.delete(["d0"])
    index.compact()  # the old segments go; the link survives them
    index.add(docs_for(["c"]))
    vocabs = [path / "segments" / s.name / "vocab.txt" for s in index.segments]
    assert len(vocabs) == 2 and vocabs[0].samefile(vocabs[1])
    assert SegmentedIndex.load(path).ids == [*IDS[1:], "a", "b", "c"]
