"""The inverted index layout, the builder and the collection type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpusparse import Index, InputError, SparseCollection, Vocabulary
from gpusparse.layout.postings import build_inverted_index

from .reference import random_collection

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def check_layout(index: Index, docs: SparseCollection) -> None:
    """Every invariant of the paper's layout, and every posting accounted for."""
    a = {k: v.cpu().numpy() for k, v in index.arrays().items()}
    assert a["doc_ids"].dtype == np.int32 and a["scores"].dtype == np.float32
    assert a["offsets"].dtype == np.int64 and a["lengths"].dtype == np.int32
    assert (a["padded_lengths"] % 32 == 0).all()
    assert (a["padded_lengths"] >= a["lengths"]).all()
    assert (a["padded_lengths"] - a["lengths"] < 32).all()
    assert ((a["lengths"] == 0) == (a["padded_lengths"] == 0)).all()
    assert (np.cumsum(a["padded_lengths"]) - a["padded_lengths"] == a["offsets"]).all()
    assert a["doc_ids"].size == a["padded_lengths"].sum()
    dense = docs.to_scipy().toarray()
    for t in range(len(docs.vocab)):
        o, n, p = a["offsets"][t], a["lengths"][t], a["padded_lengths"][t]
        ids, sc = a["doc_ids"][o : o + p], a["scores"][o : o + p]
        assert (ids[n:] == -1).all() and (sc[n:] == 0).all()
        assert (np.diff(ids[:n]) > 0).all(), "doc ids ascending and unique inside a list"
        expected = np.nonzero(dense[:, t])[0]
        np.testing.assert_array_equal(ids[:n], expected)
        np.testing.assert_array_equal(sc[:n], dense[expected, t])
        assert a["max_scores"][t] == (dense[:, t].max() if n else 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 25])
def test_layout_and_chunked_build(rng, device, chunk):
    docs = random_collection(rng, 300, 80, 10, empty_fraction=0.1)
    index = Index.build(docs, device=device, chunk_postings=chunk)
    check_layout(index, docs)
    whole = build_inverted_index(docs, device=device)
    for name, arr in index.arrays().items():
        assert torch.equal(arr, whole[name]), name


def test_stats():
    docs = SparseCollection.from_dicts([{"capital": 1.0, "paris": 0.5}, {}, {"capital": 2.0}])
    st = Index.build(docs).stats()
    assert (st.n_docs, st.n_postings, st.n_nonempty_terms, st.n_empty_docs) == (3, 3, 2, 1)
    assert st.n_padded == 64 and st.padding_overhead == pytest.approx(61 / 3)
    assert st.bytes > 0


def test_collection_sums_duplicates_and_drops_zeros():
    coll = SparseCollection([0, 4, 4], [5, 2, 5, 3], [1.0, 2.0, 0.5, 0.0], vocab=Vocabulary.integer(10))
    assert coll.indptr.tolist() == [0, 2, 2]
    assert coll.indices.tolist() == [2, 5] and coll.values.tolist() == [2.0, 1.5]
    assert coll.indices.dtype == np.int32 and coll.values.dtype == np.float32 and coll.indptr.dtype == np.int64
    assert coll.stats().n_empty == 1


@pytest.mark.parametrize(
    ("values", "match"),
    [([float("nan")], "not finite"), ([float("inf")], "not finite"), ([-1.0], "negative"), ([1e39], "overflows")],
)
def test_collection_refuses_bad_weights(values, match):
    with pytest.raises(InputError, match=match):
        SparseCollection([0, 1], [0], values, vocab=Vocabulary.integer(3))


def test_collection_refuses_bad_ids_and_terms():
    with pytest.raises(InputError, match="duplicate id"):
        SparseCollection([0, 0, 0], [], [], ids=["a", "a"], vocab=Vocabulary.integer(3))
    with pytest.raises(InputError, match="whitespace"):
        SparseCollection([0, 0], [], [], ids=["a b"], vocab=Vocabulary.integer(3))
    with pytest.raises(InputError, match="outside the vocabulary"):
        SparseCollection([0, 1], [3], [1.0], vocab=Vocabulary.integer(3))
    with pytest.raises(InputError, match="unknown token"):
        SparseCollection.from_dicts([{"notatoken_xyz": 1.0}])
    skipped = SparseCollection.from_dicts([{"notatoken_xyz": 1.0, "paris": 1.0}], unknown="skip")
    assert skipped.row(0) == {"paris": 1.0}


def test_collection_slicing_and_concat(rng):
    coll = random_collection(rng, 50, 30, 4)
    parts = [coll[:10], coll[10:31], coll[31:]]
    again = SparseCollection.concat(parts)
    assert again.ids == coll.ids
    for name in ("indptr", "indices", "values"):
        np.testing.assert_array_equal(getattr(again, name), getattr(coll, name))


def test_vocabularies():
    bert = Vocabulary.bert()
    assert len(bert) == 30522 and bert.get("[PAD]") == 0 and bert.token(bert.get("capital")) == "capital"
    assert Vocabulary.resolve("bert") == bert and Vocabulary.resolve(None) == bert
    ints = Vocabulary.resolve("integer:100")
    assert ints.is_integer and ints.get("42") == 42 and ints.get("100") is None and ints.get("x") is None
    assert ints != Vocabulary.integer(101)
    with pytest.raises(InputError):
        Vocabulary.resolve("integer:abc")


def test_vocabulary_from_tokenizer_folder(tmp_path):
    model = Vocabulary.from_pretrained(_shared() / "models" / "splade-tiny")
    assert model == Vocabulary.bert()
    (tmp_path / "vocab.txt").write_text("a\nb\nc\n", encoding="utf-8")
    v = Vocabulary.from_pretrained(tmp_path)
    assert v.tokens() == ["a", "b", "c"]
    v.save(tmp_path / "saved.txt")
    assert Vocabulary.load(tmp_path / "saved.txt") == v
    Vocabulary.integer(7).save(tmp_path / "int.txt")
    assert Vocabulary.load(tmp_path / "int.txt") == Vocabulary.integer(7)


def _shared():
    from pathlib import Path

    p = Path(__file__).resolve().parents[1] / ".." / "shared"
    if not (p / "models" / "splade-tiny" / "tokenizer.json").is_file():
        pytest.skip("../shared is not present")
    return p


def test_collection_leaves_the_callers_arrays_alone():
    indptr = np.array([0, 3, 4])
    indices = np.array([2, 0, 2, 1], dtype=np.int32)
    values = np.array([1.0, 0.0, 2.0, 0.5], dtype=np.float32)
    before = (indptr.copy(), indices.copy(), values.copy())
    coll = SparseCollection(indptr, indices, values, vocab=Vocabulary.integer(3))
    assert coll.indices.tolist() == [2, 1] and coll.values.tolist() == [3.0, 0.5]
    for arr, orig in zip((indptr, indices, values), before, strict=True):
        np.testing.assert_array_equal(arr, orig)
    mat = coll.to_scipy().copy()
    mat.data[0] = 0.0
    snapshot = (mat.indptr.copy(), mat.indices.copy(), mat.data.copy())
    SparseCollection.from_scipy(mat)
    for arr, orig in zip((mat.indptr, mat.indices, mat.data), snapshot, strict=True):
        np.testing.assert_array_equal(arr, orig)
