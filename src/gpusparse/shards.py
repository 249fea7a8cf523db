"""Sharded index folders, and an index's documents cut into ranges or joined back.

A sharded folder (``gpusparse index --shards N``, :func:`save_sharded`) splits the documents
into contiguous ranges, one ordinary index folder each::

    manifest.json      format "gpusparse-sharded-index": counts, vocabulary fingerprint and,
                       per shard, its folder, document offset, size and manifest SHA-256;
                       sealed with its own SHA-256 as a plain manifest (storage.seal)
    shard-0000/        an ordinary index folder (Index.save) of documents 0 .. n_0 - 1
    shard-0001/        documents n_0 .. n_0 + n_1 - 1, numbered from 0 inside the shard
    ...

Document ``j`` of a shard is document ``offset + j`` of the collection, so ranking the
shards' results by score descending, then ``offset + j`` ascending, is the ranking of one
index over all documents, ties included (:func:`gpusparse.topk.merge_results`).

:func:`load_sharded` loads a range of shards as one index (a process of a distributed
search loads only its own); :meth:`gpusparse.Index.load` loads them all, giving the same
arrays, bit for bit, as one build of the whole collection. :func:`slice_documents` and
:func:`concat_indexes` cut an index into document ranges and join them back, without
rebuilding: inside a posting list documents are ascending, so a range of documents is a
contiguous run of each list.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from ._version import __version__
from .errors import IndexFormatError, InputError
from .layout.postings import PostingLists, bisect_lists, empty_lists, list_arrays
from .storage import (
    MANIFEST,
    _sha256,
    _write_synced,
    check_count,
    check_seal,
    discard_folder,
    load_index,
    new_folder,
    parse_json,
    plain_name,
    replace_folder,
    save_index,
    seal,
)

FORMAT = "gpusparse-sharded-index"
FORMAT_VERSION = 1
_CHUNK = 1 << 24  # postings moved per step when slicing or joining
T = TypeVar("T")


def document_ranges(n_docs: int, n_parts: int) -> list[tuple[int, int]]:
    """``n_parts`` contiguous ranges ``[a, b)`` covering ``0 .. n_docs - 1``, sizes within one."""
    if n_parts < 1:
        raise ValueError("the number of parts must be at least 1")
    if n_parts > max(n_docs, 1):
        raise InputError(f"cannot split {n_docs:,} documents into {n_parts:,} non-empty parts")
    bounds = [n_docs * i // n_parts for i in range(n_parts + 1)]
    return list(itertools.pairwise(bounds))


# -- cutting and joining ------------------------------------------------------------------


def slice_documents(index: PostingLists, start: int, stop: int) -> PostingLists:
    """Documents ``start .. stop - 1`` of ``index`` as an index of their own (numbered from 0),
    on the index's device: each list keeps its run of those documents, in order."""
    if not 0 <= start <= stop <= index.n_docs:
        raise ValueError(f"document range [{start}, {stop}) is outside 0 .. {index.n_docs}")
    ends = index.offsets + index.lengths.to(torch.int64)
    lo = bisect_lists(index.doc_ids, index.offsets, ends, start)
    hi = bisect_lists(index.doc_ids, lo, ends, stop)
    arrays = _assemble([(index, lo, hi - lo, -start)], len(index.vocab), index.device)
    ids = index._ids[start:stop] if index._ids is not None else None
    return PostingLists(arrays, ids=ids, vocab=index.vocab, n_docs=stop - start, quantization=index.quantization)


def concat_indexes(parts: Sequence[PostingLists]) -> PostingLists:
    """One index of ``parts``' documents in order (part ``i``'s document ``j`` becomes document
    ``j`` plus the sizes of the parts before it), on the first part's device."""
    if not parts:
        raise ValueError("nothing to join")
    vocab, dev = parts[0].vocab, parts[0].device
    for p in parts[1:]:
        if p.vocab != vocab:
            raise ValueError("cannot join indexes with different vocabularies")
        if p.quantization != parts[0].quantization:
            raise ValueError("cannot join indexes quantized differently")
    spec, base = [], 0
    for p in parts:
        p = p.to(dev)
        spec.append((p, p.offsets, p.lengths.to(torch.int64), base))
        base += p.n_docs
    arrays = _assemble(spec, len(vocab), dev)
    named = all(p._ids is not None for p in parts)
    ids = [i for p in parts for i in p.ids] if named else None
    empties = [p._n_empty_docs for p in parts]
    n_empty = sum(empties) if all(e is not None for e in empties) else None  # type: ignore[misc]
    return PostingLists(
        arrays, ids=ids, vocab=vocab, n_docs=base, n_empty_docs=n_empty, quantization=parts[0].quantization
    )


def drop_documents(index: PostingLists, deleted: np.ndarray) -> PostingLists:
    """``index`` without the documents where ``deleted`` (bool ``[n_docs]``) is set, the others
    renumbered in order from 0, on the index's device: the same arrays, bit for bit, as a build
    of the surviving documents (each list keeps its surviving postings, in order)."""
    deleted = np.asarray(deleted, dtype=bool)
    if deleted.shape != (index.n_docs,):
        raise ValueError(f"deleted has shape {deleted.shape}, expected ({index.n_docs},)")
    dev = index.device
    gone = torch.from_numpy(deleted).to(dev)
    shift = torch.cumsum(gone.to(torch.int64), 0) - gone.to(torch.int64)  # deleted documents before each
    n_terms = len(index.vocab)
    ends = torch.cumsum(index.padded_lengths.to(torch.int64), 0)
    n_slots = int(ends[-1]) if n_terms else 0

    def surviving(a: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The surviving postings among slots ``a .. a + _CHUNK - 1``: their slots and terms."""
        slot = torch.arange(a, min(n_slots, a + _CHUNK), device=dev)
        doc = index.doc_ids[slot].to(torch.int64)
        slot = slot[(doc >= 0) & ~gone[doc.clamp_min(0)]]  # padding is -1
        return slot, torch.searchsorted(ends, slot, right=True)

    # Pass 1: the new list lengths (and which documents keep a posting); pass 2 places them.
    lengths = torch.zeros(n_terms, dtype=torch.int64, device=dev)
    present = torch.zeros(index.n_docs, dtype=torch.bool, device=dev)
    for a in range(0, n_slots, _CHUNK):
        slot, term = surviving(a)
        lengths += torch.bincount(term, minlength=n_terms)
        present[index.doc_ids[slot].to(torch.int64)] = True
    padded, offsets, doc_ids, scores, max_scores = empty_lists(lengths)
    placed = torch.zeros(n_terms, dtype=torch.int64, device=dev)  # postings placed per list
    for a in range(0, n_slots, _CHUNK):
        slot, term = surviving(a)  # slots ascend, so terms ascend and each list keeps its order
        counts = torch.bincount(term, minlength=n_terms)
        first = torch.cumsum(counts, 0) - counts
        dst = offsets[term] + placed[term] + torch.arange(term.numel(), device=dev) - first[term]
        doc = index.doc_ids[slot].to(torch.int64)
        doc_ids[dst] = (doc - shift[doc]).to(torch.int32)
        w = index.scores[slot]
        scores[dst] = w
        max_scores.scatter_reduce_(0, term, w, reduce="amax")
        placed += counts
    arrays = list_arrays(doc_ids, scores, offsets, lengths, padded, max_scores)
    survivors = np.flatnonzero(~deleted)
    ids = [index.ids[j] for j in survivors] if index._ids is not None else None
    n_empty = int((~present & ~gone).sum())
    return PostingLists(
        arrays,
        ids=ids,
        vocab=index.vocab,
        n_docs=len(survivors),
        n_empty_docs=n_empty,
        quantization=index.quantization,
    )


def _assemble(
    parts: Sequence[tuple[PostingLists, torch.Tensor, torch.Tensor, int]], n_terms: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Index arrays whose list of term ``t`` is, for each ``(index, start, count, shift)`` in
    order, ``index``'s postings ``start[t] .. start[t] + count[t] - 1`` with ``shift`` added to
    their document numbers; padded as the builder pads (see :mod:`gpusparse.index`)."""
    lengths = torch.zeros(n_terms, dtype=torch.int64, device=device)
    for _, _, count, _ in parts:
        lengths += count
    padded, offsets, doc_ids, scores, max_scores = empty_lists(lengths)
    before = torch.zeros(n_terms, dtype=torch.int64, device=device)  # postings placed per list
    for index, start, count, shift in parts:
        ends = torch.cumsum(count, 0)
        first = ends - count
        n = int(ends[-1]) if n_terms else 0
        for a in range(0, n, _CHUNK):
            flat = torch.arange(a, min(n, a + _CHUNK), device=device)
            term = torch.searchsorted(ends, flat, right=True)
            rank = flat - first[term]
            src = start[term] + rank
            dst = offsets[term] + before[term] + rank
            doc_ids[dst] = (index.doc_ids[src].to(torch.int64) + shift).to(torch.int32)
            w = index.scores[src]
            scores[dst] = w
            max_scores.scatter_reduce_(0, term, w, reduce="amax")
        before += count
    return list_arrays(doc_ids, scores, offsets, lengths, padded, max_scores)


# -- folders ------------------------------------------------------------------------------


def save_sharded(shards: Iterable[PostingLists], path: str | Path, *, overwrite: bool = False) -> list[dict[str, Any]]:
    """Write ``shards`` (consecutive document ranges of one collection, in order) as a sharded
    folder at ``path``, atomically: a temporary folder renamed into place. ``shards`` may be a
    generator, so that only one shard is in memory at a time. Returns the manifest's entries."""
    path = Path(path)
    tmp = new_folder(path, overwrite)
    try:
        entries: list[dict[str, Any]] = []
        vocab = None
        offset = 0
        for i, shard in enumerate(shards):
            if vocab is not None and shard.vocab != vocab:
                raise ValueError("all shards must share one vocabulary")
            vocab = shard.vocab
            entries.append(save_shard(shard, tmp, f"shard-{i:04d}", offset))
            offset += shard.n_docs
        if vocab is None:
            raise ValueError("no shards to save")
        _write_synced(tmp / MANIFEST, json.dumps(sharded_manifest(entries, vocab), indent=2).encode())
        replace_folder(tmp, path, overwrite=overwrite)
    except BaseException:
        discard_folder(tmp)
        raise
    return entries


def save_shard(shard: PostingLists, folder: Path, name: str, offset: int) -> dict[str, Any]:
    """Write ``shard`` as the index folder ``folder / name`` (atomically, fsynced) and return
    its manifest entry, its first document being global number ``offset``."""
    save_index(shard, folder / name)
    st = shard.stats()
    return {
        "name": name,
        "offset": offset,
        "n_docs": st.n_docs,
        "n_postings": st.n_postings,
        "manifest_sha256": _sha256(folder / name / MANIFEST),
    }


def sharded_manifest(entries: list[dict[str, Any]], vocab: Any, generation: int = 0) -> dict[str, Any]:
    """The sealed manifest of a sharded folder whose shards are ``entries`` (in order, their
    offsets consecutive). ``generation`` counts the updates (gpusparse add/delete/compact) it
    went through; 0 (left out) for a folder as ``index --shards`` wrote it."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"gpusparse {__version__}",
        "n_docs": sum(e["n_docs"] for e in entries),
        "n_terms": len(vocab),
        "n_postings": sum(e["n_postings"] for e in entries),
        "vocab_fingerprint": vocab.fingerprint,
        "shards": entries,
    }
    if generation:
        manifest["generation"] = generation
    return seal(manifest)


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded index folder."""
    m = Path(path) / MANIFEST
    if not m.is_file():
        return False
    try:
        data = json.loads(m.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, OSError):
        return False  # the plain loader reports what is wrong with it
    return isinstance(data, dict) and data.get("format") == FORMAT


def read_sharded_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a sharded folder, checked for format, version and consistent offsets."""
    path = Path(path)
    mpath = path / MANIFEST
    try:
        m = parse_json(mpath.read_bytes(), mpath)
    except FileNotFoundError:
        raise IndexFormatError(f"{path}: no such index folder") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("format_version"), int):
        raise IndexFormatError(f"{mpath}: not a GPUSparse sharded-index manifest")
    if m["format_version"] > FORMAT_VERSION:
        raise IndexFormatError(
            f"{path}: sharded format {m['format_version']} was written by a newer GPUSparse "
            f"({m.get('created_by', '?')}); this version reads format {FORMAT_VERSION}: upgrade gpusparse"
        )
    for key in ("n_docs", "n_terms", "vocab_fingerprint", "shards"):
        if key not in m:
            raise IndexFormatError(f"{mpath}: manifest lacks {key!r}")
    if not isinstance(m["shards"], list):
        raise IndexFormatError(f"{mpath}: 'shards' is a {type(m['shards']).__name__}, expected a list")
    offset = 0
    for e in m["shards"]:
        if not isinstance(e, dict) or e.get("offset") != offset or not isinstance(e.get("n_docs"), int):
            raise IndexFormatError(f"{mpath}: shard offsets are not consecutive")
        plain_name(e.get("name"), mpath, "shard")  # a folder inside this one, never a path
        check_count(e["n_docs"], mpath, f"shard {e['name']}'s n_docs")
        if not isinstance(e.get("manifest_sha256"), str):
            raise IndexFormatError(f"{mpath}: shard {e['name']} has no manifest_sha256 string")
        offset += e["n_docs"]
    check_count(m.get("generation", 0), mpath, "generation")
    if not m["shards"] or offset != m["n_docs"]:
        raise IndexFormatError(f"{mpath}: the shards hold {offset} documents, the manifest says {m['n_docs']}")
    check_seal(m, mpath)
    return m


def assign_shards(n_shards: int, world_size: int, rank: int) -> range:
    """The shards process ``rank`` of ``world_size`` searches: a contiguous run of about
    ``n_shards / world_size`` of them. More processes than shards is an error."""
    if world_size > n_shards:
        raise InputError(
            f"the index has {n_shards} shard(s) but {world_size} processes search it: rebuild it with "
            f"gpusparse index --shards {world_size} (or a multiple), or start at most {n_shards} processes"
        )
    return range(rank * n_shards // world_size, (rank + 1) * n_shards // world_size)


LOAD_RETRIES = 20  # reads redone when an update (gpusparse add/delete/compact) replaced the folder's shards


def read_snapshot(path: Path, read: Callable[[dict[str, Any]], T], manifest: dict[str, Any] | None) -> T:
    """``read(manifest)`` of the folder's manifest (or of ``manifest``, pinned by the caller).
    An update commits a new manifest, then removes the shards it replaced: a read that fails
    while the manifest changed under it is redone on the new one, so a reader sees one
    committed state, never a mix."""
    if manifest is not None:
        return read(manifest)
    for attempt in range(LOAD_RETRIES):
        m = read_sharded_manifest(path)
        try:
            return read(m)
        except (IndexFormatError, OSError):
            if attempt + 1 == LOAD_RETRIES or read_sharded_manifest(path) == m:
                raise  # nothing moved under us: the files really are bad
    raise AssertionError("unreachable")


def load_sharded(
    path: str | Path,
    shards: range | None = None,
    *,
    device: str | torch.device = "cpu",
    mmap: bool = True,
    verify: bool = True,
    manifest: dict[str, Any] | None = None,
) -> tuple[PostingLists, int]:
    """Load shards ``shards`` (default all) of a sharded folder as one index, and the global
    number of its first document. Only those shards' files are read. ``manifest``: the
    folder's manifest as the caller read it (:func:`read_sharded_manifest`), to read that
    state and no later one (its shards may be gone after an update: an error, never a mix)."""
    path = Path(path)

    def read(m: dict[str, Any]) -> tuple[PostingLists, int]:
        return _load_shards(path, m, shards, device=device, mmap=mmap, verify=verify)

    return read_snapshot(path, read, manifest)


def _load_shards(
    path: Path, m: dict[str, Any], shards: range | None, *, device: str | torch.device, mmap: bool, verify: bool
) -> tuple[PostingLists, int]:
    entries = m["shards"]
    shards = range(len(entries)) if shards is None else shards
    if not shards or shards.start < 0 or shards.stop > len(entries) or shards.step != 1:
        raise ValueError(f"shards {shards} are not a run of the folder's {len(entries)}")
    several = len(shards) > 1
    parts = []
    for e in (entries[s] for s in shards):
        sdir = path / e["name"]
        if not (sdir / MANIFEST).is_file():
            raise IndexFormatError(f"{path}: shard {e['name']} is missing")
        if verify and _sha256(sdir / MANIFEST) != e["manifest_sha256"]:
            raise IndexFormatError(f"{sdir / MANIFEST}: does not match its checksum in {path / MANIFEST} (corrupted)")
        try:
            part = load_index(sdir, device="cpu" if several else device, mmap=mmap, verify=verify)
        except IndexFormatError as exc:
            raise IndexFormatError(f"shard {e['name']}: {exc}") from None
        if part.n_docs != e["n_docs"] or part.vocab.fingerprint != m["vocab_fingerprint"]:
            raise IndexFormatError(f"{sdir}: its documents or vocabulary do not match {path / MANIFEST}")
        parts.append(part)
    index = concat_indexes(parts).to(device) if several else parts[0]
    return index, entries[shards.start]["offset"]


def shard_ids(path: str | Path, *, verify: bool = True, manifest: dict[str, Any] | None = None) -> list[str]:
    """The string ids of all documents of a sharded folder, by global number (reads only the
    shards' ``ids.txt``); ``manifest`` as for :func:`load_sharded`."""
    path = Path(path)
    return read_snapshot(path, lambda m: _shard_ids(path, m, verify), manifest)


def _shard_ids(path: Path, m: dict[str, Any], verify: bool) -> list[str]:
    ids: list[str] = []
    for e in m["shards"]:
        f = path / e["name"] / "ids.txt"
        try:
            want = json.loads((path / e["name"] / MANIFEST).read_text(encoding="utf-8"))["files"]["ids.txt"]["sha256"]
            ok = not verify or _sha256(f) == want
            part = f.read_text(encoding="utf-8").split("\n")[:-1]
        except (OSError, KeyError, TypeError, ValueError, RecursionError) as exc:
            raise IndexFormatError(f"{path}: cannot read the ids of shard {e['name']} ({exc})") from None
        if not ok:
            raise IndexFormatError(f"{f}: does not match its checksum (corrupted)")
        if len(part) != e["n_docs"]:
            raise IndexFormatError(f"{f}: {len(part)} ids, the manifest says {e['n_docs']}")
        ids += part
    return ids
