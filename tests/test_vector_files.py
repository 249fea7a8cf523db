"""The binary vector files the encoder writes: Seismic .bin byte for byte as Seismic's own
converter lays it out, and GPUSparse .npz round trips (ids, tokens, vocabulary mapping)."""

from __future__ import annotations

import struct
import zipfile

import numpy as np
import pytest

from gpusparse import InputError, SparseCollection, Vocabulary, read_vectors
from gpusparse.formats import ReadStats
from gpusparse.vector_writers import write_seismic_bin, write_vectors
from gpusparse.vectors_npz import read_npz, write_npz


def collection(n: int = 40, seed: int = 0, vocab: Vocabulary | None = None) -> SparseCollection:
    vocab = vocab or Vocabulary.bert()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 9, n)
    lengths[3] = 0
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    indices = np.concatenate([np.sort(rng.choice(len(vocab), k, replace=False)) for k in lengths]).astype(np.int32)
    values = rng.random(indices.size).astype(np.float32) + np.float32(1e-3)
    return SparseCollection(indptr, indices, values, ids=[f"doc-{i}" for i in range(n)], vocab=vocab)


def seismic_reference_bytes(coll: SparseCollection) -> bytes:
    """Seismic's scripts/convert_json_to_inner_format.py layout, written record by record."""
    out = [len(coll).to_bytes(4, "little")]
    for i in range(len(coll)):
        a, b = coll.indptr[i], coll.indptr[i + 1]
        out.append(int(b - a).to_bytes(4, "little"))
        out.extend(int(t).to_bytes(4, "little") for t in coll.indices[a:b])
        out.extend(struct.pack("<f", float(w)) for w in coll.values[a:b])
    return b"".join(out)


@pytest.mark.parametrize("chunk", [1, 5, 1 << 24])
def test_seismic_bin_is_seismic_layout_and_reads_back(tmp_path, chunk):
    coll = collection()
    path = tmp_path / "docs.bin"
    write_seismic_bin(coll, path, chunk_postings=chunk)
    assert path.read_bytes() == seismic_reference_bytes(coll)
    back = read_vectors(path, progress=False)
    assert back.ids == [str(i) for i in range(len(coll))]  # Seismic files have no ids
    np.testing.assert_array_equal(back.indptr, coll.indptr)
    np.testing.assert_array_equal(back.indices, coll.indices)
    np.testing.assert_array_equal(back.values, coll.values)


def test_npz_round_trip_keeps_ids_tokens_and_exact_weights(tmp_path):
    coll = collection()
    path = tmp_path / "corpus.npz"
    write_vectors(coll, path)
    f = read_npz(path)
    assert f.ids == coll.ids and f.tokens == Vocabulary.bert().tokens()
    back = read_vectors(path, progress=False)
    assert back.ids == coll.ids
    for name in ("indptr", "indices", "values"):
        np.testing.assert_array_equal(getattr(back, name), getattr(coll, name))
    # Written by name: .npz, .bin and JSONL read back the same vectors.
    for name in ("c.bin", "c.jsonl.gz"):
        write_vectors(coll, tmp_path / name)
        other = read_vectors(tmp_path / name, progress=False)
        np.testing.assert_array_equal(other.values, coll.values)
    with pytest.raises(ValueError, match="decimals"):
        write_vectors(coll, tmp_path / "d.npz", decimals=3)


def test_npz_maps_tokens_into_the_readers_vocabulary(tmp_path):
    small = Vocabulary(["z", "a", "b", "q"])
    coll = SparseCollection([0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0], ids=["x", "y"], vocab=small)
    write_npz(coll, tmp_path / "v.npz")
    target = Vocabulary(["a", "b", "c", "z"])
    back = read_vectors(tmp_path / "v.npz", target, progress=False)
    assert back.row(0) == {"z": 1.0, "b": 2.0} and back.row(1) == {"a": 3.0}
    with pytest.raises(InputError, match=r"v.npz record 1.*token 'z' is not in the vocabulary"):
        read_vectors(tmp_path / "v.npz", Vocabulary(["a", "b"]), progress=False)
    stats = ReadStats()
    skipped = read_vectors(tmp_path / "v.npz", Vocabulary(["a", "b"]), unknown="skip", progress=False, stats=stats)
    assert skipped.row(0) == {"b": 2.0} and skipped.row(1) == {"a": 3.0} and stats.unknown_tokens_skipped == 1


def test_npz_ids_are_checked_across_files(tmp_path):
    coll = collection(5)
    write_npz(coll, tmp_path / "a.npz")
    write_npz(coll[:2], tmp_path / "b.npz")
    with pytest.raises(InputError, match=r"b.npz record 1.*duplicate id 'doc-0'"):
        read_vectors([tmp_path / "a.npz", tmp_path / "b.npz"], progress=False)
    both = read_vectors([tmp_path / "a.npz", tmp_path / "b.npz"][:1], progress=False)
    assert both.ids == coll.ids


def test_bad_npz_files_are_refused_with_the_member(tmp_path):
    path = tmp_path / "x.npz"
    path.write_bytes(b"not a zip")
    with pytest.raises(InputError, match=r"x.npz.*cannot read as .npz"):
        read_vectors(path, progress=False)
    np.savez(path, a=np.zeros(3))
    with pytest.raises(InputError, match="not a GPUSparse vector file"):
        read_vectors(path, progress=False)
    coll = collection(4)
    write_npz(coll, path)
    with zipfile.ZipFile(path) as z:
        members = {name.removesuffix(".npy"): np.lib.format.read_array(z.open(name)) for name in z.namelist()}
    for member, bad, message in (
        ("indices", members["indices"] + 40000, "term ids must be in"),
        ("indptr", members["indptr"][::-1].copy(), "offsets must start at 0"),
        ("values", members["values"].astype(np.int32), "expected a 1-D array"),
        ("format", np.frombuffer(b"gpusparse-vectors/9", np.uint8), "written by another version"),
    ):
        with path.open("wb") as f:
            np.savez(f, **{**members, member: bad})
        with pytest.raises(InputError, match=message):
            read_vectors(path, progress=False)


def test_an_encoded_folder_with_a_binary_corpus_is_not_read_whole(tmp_path):
    for name in ("corpus.npz", "corpus.bin"):
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        write_vectors(collection(5), folder / name)
        write_vectors(collection(4, seed=1), folder / "queries.jsonl.gz")
        with pytest.raises(InputError, match="both a corpus and queries"):
            read_vectors(folder, progress=False)
