"""Updates of a sharded index folder (``gpusparse index --shards N``): add, delete, compact.

A sharded folder stays a folder of plain shards (:mod:`gpusparse.shards`) through every
update, so everything that reads one (:meth:`Index.load`, ``search --distributed``,
``serve``, ``verify``, ``info``) reads an updated folder unchanged:

* :func:`add_sharded` appends the documents to the last shard if it then holds at most
  ``max_shard_docs`` documents (default: as many as the folder's largest shard, so a folder
  built with ``--shards N`` fills its last shard to the size it was built with), else
  writes them as a new shard at the end. An id already in any shard is refused unless
  ``upsert``, which deletes the old document in its shard in the same commit.
* :func:`delete_sharded` rewrites each shard holding one of the ids without it
  (:func:`~gpusparse.shards.drop_documents`: the arrays of a build of its surviving
  documents); a shard left empty is removed (one stays, if all are).
* :func:`compact_sharded` spreads the documents evenly over the same number of shards
  (sizes within one, as ``index --shards N`` cuts them). Shards never hold deleted
  documents, so that is all there is to compact.

**Order.** The shards' documents in order are the collection: the documents as they were,
deleted ones left out, then the added ones (an upserted document counts as added now),
which is the order a segmented folder ranks ties by too. So every search of an updated
folder equals one of a fresh build of that collection, ties included.

**Cost.** An update rewrites the shards it changes (time and disk in proportion to their
postings): an add the last shard (or none, when it starts a new one), a delete the shards
holding the ids. A segmented folder (:mod:`gpusparse.segments`) only writes a bitmap or a
segment; shards stay plain so that each process of a distributed search maps its own.

**Crash safety.** An update writes the new shards under new names, each atomically
(:func:`~gpusparse.storage.save_index`: a temporary folder renamed into place, fsynced),
then replaces ``manifest.json`` (temporary file, fsync, ``os.replace``, fsync of the
folder): that replace is the commit. Shards the manifest no longer names are removed after
the commit, or by the next writer if the process died first; a process killed anywhere
leaves the old state or the new one. Readers read the manifest, then the shards it names,
and redo a read that failed because a commit replaced them
(:func:`~gpusparse.shards.read_snapshot`). One writer at a time (a ``LOCK`` file).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .collection import SparseCollection
from .errors import InputError
from .layout.postings import MAX_DOCS, PostingLists
from .quantize import Quantization
from .segment_files import locked
from .segments import UpdateReport, build_segment, in_vocabulary
from .shards import (
    concat_indexes,
    document_ranges,
    drop_documents,
    load_sharded,
    read_sharded_manifest,
    save_shard,
    shard_ids,
    sharded_manifest,
    slice_documents,
)
from .storage import MANIFEST, _fsync_dir, _write_synced, load_index
from .vocab import Vocabulary

SHARD_PREFIX = "shard-"


def add_sharded(
    path: str | Path,
    documents: SparseCollection,
    *,
    upsert: bool = False,
    clip: bool = False,
    max_shard_docs: int | None = None,
) -> UpdateReport:
    """Add ``documents`` to the sharded folder at ``path`` in one commit (module docstring).

    An id already in a shard is refused (:class:`InputError`, nothing written) unless
    ``upsert``. A quantized folder quantizes them with its bits and step; a weight above its
    largest level is refused unless ``clip`` (as :meth:`SegmentedIndex.add`).
    ``max_shard_docs``: the most documents the last shard may hold after the add (default:
    the largest shard's count); more start a new shard.
    """
    path = Path(path)
    if max_shard_docs is not None and max_shard_docs < 1:
        raise ValueError("max_shard_docs must be at least 1")
    vocab, quantization = vocabulary_and_quantization(path)
    documents = in_vocabulary(documents, vocab)
    # Quantized (and refused) before the lock, so a refusal writes nothing.
    added = build_segment(documents, quantization, clip=clip) if len(documents) else None
    with locked(path):
        m = read_sharded_manifest(path)
        _collect_garbage(path, m)
        vocab2, quantization2 = vocabulary_and_quantization(path, m)
        if vocab2 != vocab or quantization2 != quantization:  # replaced meanwhile (index --overwrite)
            raise InputError(f"{path}: the index was replaced while the documents were read: run the add again")
        where = _positions(path, m)
        clash = [i for i in documents.ids if i in where]
        if clash and not upsert:
            listed = ", ".join(repr(i) for i in clash[:5]) + (", ..." if len(clash) > 5 else "")
            raise InputError(
                f"{len(clash):,} id(s) already in the index: {listed} (delete them first, or add --upsert)", field="id"
            )
        shards = _without(path, m, [where[i] for i in clash])
        if added is not None:
            cap = min(max_shard_docs or max(e["n_docs"] for e in m["shards"]), MAX_DOCS)
            last = shards[-1]
            if last.n_docs and last.n_docs + added.n_docs <= cap:
                shards[-1] = _Shard(path, None, concat_indexes([last.load(), added]))
            elif last.n_docs:
                shards.append(_Shard(path, None, added))
            else:  # every document was deleted: the new ones are the collection
                shards[-1] = _Shard(path, None, added)
        gen = _commit(path, m, shards, vocab) if clash or added is not None else m.get("generation", 0)
    return UpdateReport(gen, added=len(documents), deleted=len(clash))


def delete_sharded(path: str | Path, ids: Iterable[str]) -> UpdateReport:
    """Delete the documents with these string ids from whichever shards hold them, in one
    commit; ids in no shard are counted (and listed in ``unknown_ids``), not an error."""
    path = Path(path)
    wanted = list(dict.fromkeys(ids))
    with locked(path):
        m = read_sharded_manifest(path)
        _collect_garbage(path, m)
        where = _positions(path, m)
        found = [where[i] for i in wanted if i in where]
        unknown = tuple(i for i in wanted if i not in where)
        gen = m.get("generation", 0)
        if found:
            vocab, _ = vocabulary_and_quantization(path, m)
            gen = _commit(path, m, _without(path, m, found), vocab)
    return UpdateReport(gen, deleted=len(found), unknown=len(unknown), unknown_ids=unknown)


def compact_sharded(path: str | Path) -> UpdateReport:
    """Spread the folder's documents evenly over its number of shards (same search results);
    nothing is written when they already are."""
    path = Path(path)
    with locked(path):
        m = read_sharded_manifest(path)
        _collect_garbage(path, m)
        entries = m["shards"]
        sizes = [e["n_docs"] for e in entries]
        n = sum(sizes)
        ranges = document_ranges(n, max(1, min(n, len(entries))))  # fewer documents than shards: one each
        if n == 0 or [b - a for a, b in ranges] == sizes:
            return UpdateReport(m.get("generation", 0))
        sources = [_Shard(path, e) for e in entries]
        shards = []
        for a, b in ranges:
            parts = []
            for s, e in zip(sources, entries, strict=True):
                lo, hi = max(a, e["offset"]), min(b, e["offset"] + e["n_docs"])
                if lo < hi:
                    parts.append(slice_documents(s.load(), lo - e["offset"], hi - e["offset"]))
            shards.append(_Shard(path, None, concat_indexes(parts) if len(parts) > 1 else parts[0]))
        vocab, _ = vocabulary_and_quantization(path, m)
        gen = _commit(path, m, shards, vocab)
    return UpdateReport(gen)


def vocabulary_and_quantization(
    path: str | Path, m: dict[str, Any] | None = None
) -> tuple[Vocabulary, Quantization | None]:
    """The vocabulary and quantization of the sharded folder at ``path`` (all its shards share
    both; ``m``: its manifest as read): the first shard's, its arrays mapped, not read."""
    first = load_sharded(path, range(1), verify=False, manifest=m)[0]
    return first.vocab, first.quantization


# -- inside the lock ----------------------------------------------------------------------


class _Shard:
    """A shard of the state being written: an entry of the folder's manifest, kept as it is
    (``entry``; its index loaded on demand), or a new index written at the commit."""

    def __init__(self, path: Path, entry: dict[str, Any] | None, index: PostingLists | None = None) -> None:
        self.path, self.entry, self.index = path, entry, index

    @property
    def n_docs(self) -> int:
        return self.index.n_docs if self.index is not None else self.entry["n_docs"]  # type: ignore[index]

    def load(self) -> PostingLists:
        if self.index is None:
            self.index = load_index(self.path / self.entry["name"], device="cpu", mmap=True, verify=True)  # type: ignore[index]
        return self.index


def _positions(path: Path, m: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """String id -> (shard number, document number inside the shard)."""
    ids = shard_ids(path, manifest=m)
    out: dict[str, tuple[int, int]] = {}
    for si, e in enumerate(m["shards"]):
        for j in range(e["n_docs"]):
            out[ids[e["offset"] + j]] = (si, j)
    return out


def _without(path: Path, m: dict[str, Any], where: list[tuple[int, int]]) -> list[_Shard]:
    """The shards with the documents at ``where`` dropped; a shard left empty is removed
    unless it is the only one left."""
    deleted: dict[int, np.ndarray] = {}
    for si, j in where:
        deleted.setdefault(si, np.zeros(m["shards"][si]["n_docs"], dtype=bool))[j] = True
    shards = []
    for si, e in enumerate(m["shards"]):
        s = _Shard(path, e)
        if si in deleted:
            s = _Shard(path, None, drop_documents(s.load(), deleted[si]))
        shards.append(s)
    kept = [s for s in shards if s.n_docs]
    return kept or shards[-1:]


def _commit(path: Path, m: dict[str, Any], shards: list[_Shard], vocab: Vocabulary) -> int:
    """Write the new shards, then the manifest naming ``shards`` in order (the commit), then
    remove what it no longer names. Returns the new generation."""
    gen = m.get("generation", 0) + 1
    entries, offset = [], 0
    for s in shards:
        if s.index is None:
            e = {**s.entry, "offset": offset}  # type: ignore[dict-item]
        else:
            e = save_shard(s.index, path, f"{SHARD_PREFIX}{gen:06d}-{uuid.uuid4().hex[:8]}", offset)
        entries.append(e)
        offset += e["n_docs"]
    data = json.dumps(sharded_manifest(entries, vocab, gen), indent=2).encode()
    tmp = path / f".{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
    _write_synced(tmp, data)
    _fsync_dir(path)
    os.replace(tmp, path / MANIFEST)  # the commit
    _fsync_dir(path)
    _collect_garbage(path, read_sharded_manifest(path))
    return gen


def _collect_garbage(path: Path, m: dict[str, Any]) -> None:
    """Remove the shards ``m`` does not name and the temporary files and folders of dead
    writers (called under the lock, so no writer is alive but us)."""
    names = {e["name"] for e in m["shards"]}
    for p in path.iterdir():
        stale_shard = p.name.startswith(SHARD_PREFIX) and p.name not in names
        leftover = p.name.startswith((f".{SHARD_PREFIX}", f".{MANIFEST}.tmp-")) and (".tmp-" in p.name)
        if stale_shard or leftover:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    _fsync_dir(path)
