"""Quantized segmented indexes: every write keeps the bits and the step (issue 24, item 1)."""

from __future__ import annotations

import hashlib
import json
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusparse import Index, IndexFormatError, InputError, SparseCollection, write_jsonl
from gpusparse.cli import main
from gpusparse.quantize import Quantization, quantize_collection
from gpusparse.segments import SegmentedIndex

from .segment_writer import VOCAB, docs_for

Q = Quantization(3, 0.25)  # levels 0..7: weights up to 1.75 (1.875 rounds to 7), below 0.125 dropped
KS = (1, 5, 200)


def qdocs_for(ids: list[str], scale: float = 2.5) -> SparseCollection:
    """Vectors determined by their ids, with weights in (0, scale) that 3-bit levels do not
    represent exactly (so a lost quantization changes scores), some above ``Q``'s largest."""
    base = docs_for(ids)
    lens = np.diff(base.indptr)
    rng = (np.random.default_rng(zlib.crc32(f"w{i}".encode())) for i in ids)
    rows = [g.uniform(0.01, scale, n) for g, n in zip(rng, lens, strict=True)]
    values = np.concatenate([*rows, np.zeros(0)]).astype(np.float32)
    return SparseCollection(base.indptr, base.indices, values, list(base.ids), VOCAB)


def fresh_build(live: list[str], q: Quantization) -> Index:
    """A fresh quantized build of ``live`` in order with the step ``q`` (weights clipped)."""
    coll, _ = quantize_collection(qdocs_for(live), q.bits, q.step)
    index = Index.build(coll)
    index.quantization = q
    return index


def assert_same_as_fresh(index: SegmentedIndex, live: list[str], qs: SparseCollection, q: Quantization) -> None:
    assert index.ids == live
    assert index.quantization == q and all(s.index.quantization == q for s in index.segments)
    fresh = fresh_build(live, q)
    for k in KS:
        got, want = index.search(qs, k), fresh.search(qs, k)
        assert got.scores.numpy().tobytes() == want.scores.numpy().tobytes(), k
        assert got.ids == [[fresh.ids[d] if d >= 0 else None for d in row] for row in want.ids.tolist()], k


_OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), st.integers(0, 2)),  # new documents, upserted ones
    st.tuples(st.just("delete"), st.lists(st.integers(0, 40), max_size=4), st.none()),
    st.tuples(st.just("compact"), st.none(), st.none()),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OPS, min_size=1, max_size=6), start=st.integers(0, 5), plain=st.booleans())
def test_property_quantized_updates_match_fresh_quantized_build(ops, start, plain):
    """Any add/upsert/delete/compact sequence on a quantized index equals a fresh quantized
    build with the same step, bit for bit (added weights above the top level clipped)."""
    qs = qdocs_for([f"hq-{i}" for i in range(8)], scale=3.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "idx"
        first = [f"h0-{j}" for j in range(start)]
        if plain and first:  # a plain folder from `gpusparse index --quantize 3`, its step from its weights
            built = Index.build(qdocs_for(first), quantize=3)
            built.save(path)
            q = built.quantization
            index = SegmentedIndex.load(path)
        else:
            q = Q
            index = SegmentedIndex.create(path, qdocs_for(first) if first else VOCAB, quantize=Q)
        live = list(first)
        for n, (kind, a, b) in enumerate(ops, start=1):
            if kind == "add":
                new, again = [f"h{n}-{j}" for j in range(a)], live[:b]
                index.add(qdocs_for(new + again), upsert=True, clip=True)
                live = [i for i in live if i not in again] + new + again
            elif kind == "delete":
                gone = sorted({live[i % len(live)] for i in a}) if live else []
                index.delete(gone)
                live = [i for i in live if i not in gone]
            else:
                index.compact()
            assert_same_as_fresh(index, live, qs, q)
        assert_same_as_fresh(SegmentedIndex.load(path), live, qs, q)


def test_compact_and_add_keep_a_plain_quantized_index_s_results(tmp_path):
    """The issue's repro: compact, then adding copies of documents, changes no score."""
    ids = [f"d{i}" for i in range(60)]
    built = Index.build(qdocs_for(ids), quantize=8)
    built.save(tmp_path / "idx")
    qs = qdocs_for([f"q{i}" for i in range(10)])
    before = built.search(qs, 20)
    index = SegmentedIndex.load(tmp_path / "idx")
    index.compact()
    after = index.search(qs, 20)
    assert after.scores.numpy().tobytes() == before.scores.numpy().tobytes()
    assert after.ids == [[built.ids[d] if d >= 0 else None for d in row] for row in before.ids.tolist()]
    index.delete(ids[:5])
    index.add(qdocs_for(ids[:5]))  # the same vectors again: the same levels, the same scores
    again = SegmentedIndex.load(tmp_path / "idx").search(qs, 20)
    assert sorted(again.scores.numpy().tobytes()) == sorted(before.scores.numpy().tobytes())
    assert json.loads((tmp_path / "idx" / "MANIFEST-000003.json").read_text())["quantization"] == (
        built.quantization.to_dict()
    )


def test_weight_above_the_top_level_is_refused_unless_clipped(tmp_path):
    index = SegmentedIndex.create(tmp_path / "idx", qdocs_for(["a", "b"]), quantize=Q)
    big = SparseCollection(
        np.array([0, 2]), np.array([3, 9], np.int32), np.array([0.5, 1.875], np.float32), ["big"], VOCAB
    )
    with pytest.raises(InputError, match=r"'big' has weight 1.875 for term '9', above 1.75.*clip=True.*--quantize 3"):
        index.add(big)
    assert index.refresh().ids == ["a", "b"] and index.generation == 1  # nothing committed
    assert [p.name for p in (tmp_path / "idx" / "segments").iterdir()] == [index.segments[0].name]
    ok = SparseCollection(np.array([0, 1]), np.array([9], np.int32), np.array([1.87], np.float32), ["ok"], VOCAB)
    index.add(ok)  # rounds to the top level: stored exactly as a fresh build with this step does
    index.add(big, clip=True)
    top = index.segments[-1].index
    assert float(top.max_scores[9]) == 1.75 and index.ids == ["a", "b", "ok", "big"]


def test_cli_add_to_a_quantized_index_refuses_a_weight_above_the_scale(tmp_path):
    Index.build(qdocs_for(["a", "b"], scale=1.0), quantize=3).save(tmp_path / "idx")
    write_jsonl(qdocs_for(["c"], scale=9.0), tmp_path / "new.jsonl")
    res = CliRunner().invoke(main, ["add", str(tmp_path / "idx"), str(tmp_path / "new.jsonl")])
    assert res.exit_code == 1 and "above" in res.stderr.splitlines()[-1] and "Traceback" not in res.output


def test_empty_quantized_index_needs_its_step(tmp_path):
    with pytest.raises(ValueError, match="Quantization"):
        SegmentedIndex.create(tmp_path / "idx", VOCAB, quantize=3)
    index = SegmentedIndex.create(tmp_path / "idx2", VOCAB, quantize=Q)
    assert SegmentedIndex.load(tmp_path / "idx2").quantization == Q
    index.add(qdocs_for(["x"]), clip=True)
    index.delete(["x"])
    index.compact()  # no segment left: the manifest alone remembers the step
    assert SegmentedIndex.load(tmp_path / "idx2").quantization == Q


def test_segments_quantized_differently_are_refused(tmp_path):
    """A folder left by an older gpusparse (an unquantized segment beside a quantized one)."""
    path = tmp_path / "idx"
    index = SegmentedIndex.create(path, qdocs_for(["a"]), quantize=Q)
    index.add(qdocs_for(["b"]), clip=True)
    name, _ = (path / "CURRENT").read_text().split()
    m = json.loads((path / name).read_text())
    del m["quantization"]  # as written before the manifest recorded it
    seg = path / "segments" / m["segments"][1]["name"]
    Index.build(qdocs_for(["b"])).save(seg, overwrite=True)  # what add wrote then
    m["segments"][1]["manifest_sha256"] = hashlib.sha256((seg / "manifest.json").read_bytes()).hexdigest()
    data = json.dumps(m).encode()
    (path / name).write_bytes(data)
    (path / "CURRENT").write_text(f"{name} {hashlib.sha256(data).hexdigest()}\n")
    with pytest.raises(IndexFormatError, match=r"quantized as None.*mix scales.*rebuild"):
        SegmentedIndex.load(path)
