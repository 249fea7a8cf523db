"""Index folders: save atomically, load (mapped or read, verified or not), refuse bad folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpusparse import Index, IndexFormatError, SparseCollection, Vocabulary
from gpusparse import storage as storage_mod

from .test_formats import make_collection


def hidden_entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def assert_same_index(a: Index, b: Index) -> None:
    for name, t in a.arrays().items():
        u = b.arrays()[name]
        assert u.dtype == t.dtype, name
        assert torch.equal(t.cpu(), u.cpu()), name
    assert b.ids == a.ids
    assert b.vocab == a.vocab
    assert b.vocab.is_integer == a.vocab.is_integer
    assert b.vocab.tokens() == a.vocab.tokens()
    assert b.stats() == a.stats()


@pytest.fixture
def built(tmp_path) -> tuple[Index, SparseCollection, Path]:
    coll = make_collection(301, n=60)
    index = Index.build(coll)
    path = tmp_path / "idx"
    index.save(path)
    return index, coll, path


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize(("vocab_kind", "seed"), [("bert", 311), ("integer", 312)])
def test_save_load_round_trip(tmp_path, mmap, vocab_kind, seed):
    vocab = Vocabulary.bert() if vocab_kind == "bert" else Vocabulary.integer(700)
    coll = make_collection(seed + int(mmap), n=50, vocab=vocab)
    index = Index.build(coll)
    path = tmp_path / "sub" / "idx"  # parent created on demand
    index.save(path)
    assert (path / "manifest.json").is_file()
    loaded = Index.load(path, mmap=mmap, verify=True)
    assert_same_index(index, loaded)
    assert loaded.device == torch.device("cpu")
    assert hidden_entries(path.parent) == []
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == storage_mod.FORMAT_VERSION
    assert manifest["n_docs"] == 50 and manifest["n_postings"] == coll.nnz
    assert manifest["n_empty_docs"] == coll.stats().n_empty
    assert set(manifest["files"]) == {f"{n}.npy" for n in index.arrays()} | {"ids.txt", "vocab.txt"}


def test_round_trip_without_verify(built):
    index, _, path = built
    assert_same_index(index, Index.load(path, verify=False))


def test_round_trip_token_vocabulary(tmp_path):
    vocab = Vocabulary(["alpha", "beta", "γ", "##d", "[CLS]", "e f"])
    coll = SparseCollection([0, 2, 3, 3], [0, 2, 5], np.array([1.0, 2.0, 0.5], np.float32), ["x", "y", "z"], vocab)
    index = Index.build(coll)
    index.save(tmp_path / "idx")
    loaded = Index.load(tmp_path / "idx")
    assert_same_index(index, loaded)
    assert loaded.vocab.tokens() == ["alpha", "beta", "γ", "##d", "[CLS]", "e f"]


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_without_postings(tmp_path, mmap):
    for name, coll in {
        "all-empty": SparseCollection([0, 0, 0, 0], [], [], ids=["a", "b", "c"]),
        "no-docs": SparseCollection([0], [], []),
    }.items():
        index = Index.build(coll)
        index.save(tmp_path / name)
        loaded = Index.load(tmp_path / name, mmap=mmap)
        assert_same_index(index, loaded)
        assert loaded.n_docs == len(coll)


@pytest.mark.parametrize(("mmap", "seed"), [(True, 321), (False, 322)])
def test_loaded_index_searches_like_the_built_one(tmp_path, mmap, seed):
    vocab = Vocabulary.integer(400)
    docs = make_collection(seed, n=80, vocab=vocab, max_len=30)
    queries = make_collection(seed + 1000, n=12, vocab=vocab, max_len=10, empty_rows=1, id_prefix="q")
    index = Index.build(docs)
    index.save(tmp_path / "idx")
    loaded = Index.load(tmp_path / "idx", mmap=mmap)
    for k in (1, 7, 200):
        a, b = index.search(queries, k), loaded.search(queries, k)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.scores, b.scores)
    assert index.retrieve(queries, 5) == loaded.retrieve(queries, 5)


# -- saving ---------------------------------------------------------------------------------


def test_save_refuses_an_existing_folder(built):
    index, _, path = built
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(FileExistsError):
        index.save(path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert hidden_entries(path.parent) == []


def test_save_overwrite_replaces_the_index(built):
    _, _, path = built
    other = Index.build(make_collection(331, n=9, id_prefix="new"))
    other.save(path, overwrite=True)
    loaded = Index.load(path)
    assert_same_index(other, loaded)
    assert loaded.ids[0] == "new-é0"
    assert hidden_entries(path.parent) == []


def test_save_overwrite_refuses_a_folder_that_is_not_an_index(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    (path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        Index.build(make_collection(341, n=5)).save(path, overwrite=True)
    assert (path / "precious.txt").read_text() == "keep me"
    assert hidden_entries(tmp_path) == []


def test_failed_save_leaves_nothing(tmp_path):
    # a token with a newline cannot be written to vocab.txt: save fails midway
    vocab = Vocabulary(["ok", "bad\ntoken"])
    index = Index.build(SparseCollection([0, 1], [1], [1.0], ["a"], vocab))
    with pytest.raises(ValueError):
        index.save(tmp_path / "idx")
    assert not (tmp_path / "idx").exists()
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_index(built, monkeypatch):
    index, _, path = built

    def boom(f: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device", str(f))

    monkeypatch.setattr(storage_mod, "_write_synced", boom)
    with pytest.raises(OSError):
        Index.build(make_collection(351, n=5)).save(path, overwrite=True)
    monkeypatch.undo()
    assert hidden_entries(path.parent) == []
    assert_same_index(index, Index.load(path))


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    def interrupt(f: Path) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(storage_mod, "_describe", interrupt)
    with pytest.raises(KeyboardInterrupt):
        Index.build(make_collection(352, n=5)).save(tmp_path / "idx")
    assert list(tmp_path.iterdir()) == []


# -- loading bad folders --------------------------------------------------------------------


def load_error(path: Path, **kwargs) -> str:
    with pytest.raises(IndexFormatError) as info:
        Index.load(path, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_load_missing_folder(tmp_path):
    assert "no such index folder" in load_error(tmp_path / "nope")


def test_load_a_file_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    load_error(tmp_path / "f")


def test_load_folder_without_manifest(tmp_path):
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "doc_ids.npy").write_bytes(b"x")
    assert "manifest.json" in load_error(tmp_path / "idx")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda m: m.update(format_version=999), "newer"),
        (lambda m: m.update(format="something-else"), "not a GPUSparse index"),
        (lambda m: m.pop("format_version"), "format_version"),
        (lambda m: m.pop("files"), "files"),
        (lambda m: m.pop("n_docs"), "n_docs"),
    ],
)
def test_load_bad_manifest(built, edit, words):
    _, _, path = built
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))
    msg = load_error(path)
    assert words in msg
    if words == "newer":
        assert "999" in msg and "upgrade" in msg


def test_load_unreadable_manifest(built):
    _, _, path = built
    (path / "manifest.json").write_text("{not json")
    load_error(path)
    (path / "manifest.json").write_text("[1, 2]")
    load_error(path)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("fname", ["scores.npy", "doc_ids.npy", "ids.txt", "vocab.txt"])
def test_load_truncated_file(built, fname, verify):
    _, _, path = built
    f = path / fname
    f.write_bytes(f.read_bytes()[:-3])
    msg = load_error(path, verify=verify)
    assert fname in msg and "truncated" in msg


@pytest.mark.parametrize("fname", ["scores.npy", "offsets.npy", "ids.txt"])
def test_load_corrupted_byte(built, fname):
    index, _, path = built
    f = path / fname
    data = bytearray(f.read_bytes())
    data[-2] ^= 0x01  # same size, one bit off
    f.write_bytes(bytes(data))
    msg = load_error(path, verify=True)
    assert fname in msg and "checksum" in msg
    if fname == "scores.npy":
        # without verification the corruption goes unnoticed
        loaded = Index.load(path, verify=False)
        assert loaded.n_docs == index.n_docs
        assert not torch.equal(loaded.scores, index.scores)


def test_load_corrupted_vocab_without_verify_is_still_caught(built):
    _, _, path = built
    f = path / "vocab.txt"
    data = bytearray(f.read_bytes())
    data[10] = ord("Z") if data[10] != ord("Z") else ord("Y")
    f.write_bytes(bytes(data))
    assert "vocab" in load_error(path, verify=False)


@pytest.mark.parametrize("fname", ["doc_ids.npy", "max_scores.npy", "ids.txt", "vocab.txt"])
def test_load_missing_file(built, fname):
    _, _, path = built
    (path / fname).unlink()
    msg = load_error(path)
    assert fname in msg and "missing" in msg


def test_load_array_with_wrong_dtype(built):
    # a consistent manifest around a wrong array: caught by the dtype check
    _, _, path = built
    np.save(path / "lengths.npy", np.zeros(len(Vocabulary.bert()), np.int64))
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["lengths.npy"] = storage_mod._describe(path / "lengths.npy")
    (path / "manifest.json").write_text(json.dumps(storage_mod.seal(m)))  # consistent: its own checksum too
    assert "lengths.npy" in load_error(path)


def test_read_manifest(built):
    index, _, path = built
    m = storage_mod.read_manifest(path)
    assert m["n_docs"] == index.n_docs and m["vocab_fingerprint"] == index.vocab.fingerprint
