"""An updatable index: immutable segments, deletion bitmaps and an atomically switched manifest.

A :class:`SegmentedIndex` wraps ordinary :class:`~gpusparse.Index` objects (one per segment)
the way FAISS wraps indexes; the index itself is unchanged. Its folder holds::

    CURRENT                      "MANIFEST-000007.json <sha256>": the live manifest
    MANIFEST-000007.json         segments in order, their doc counts, the deletion files
    segments/seg-000003-1a2b3c4d/   an ordinary index folder (Index.save), never modified
    deletions/seg-000003-1a2b3c4d-000007.npy   packed bitmap of that segment's deleted docs
    LOCK                         held (flock) by the one writer at a time

**Global order.** Document ``j`` of segment ``s`` has global number ``base_s + j`` (bases in
manifest order), so ranking by score descending, then global number ascending, is ranking by
insertion order on ties: the same results as a fresh :meth:`Index.build` of the surviving
documents in insertion order (an upserted document counts as inserted when re-added).

**Crash safety.** A writer only creates new files (a new segment, new bitmaps, a new
manifest, each fsynced), then replaces ``CURRENT`` atomically (temporary file, fsync,
``os.replace``, fsync of the folder): that replace is the commit. A process killed anywhere
leaves either the old or the new state readable; what it left behind (temporary folders,
unreferenced segments, bitmaps and manifests) is ignored by readers and removed by the next
writer. Every file is checked against a SHA-256: the manifest against ``CURRENT``, segment
manifests and bitmaps against the manifest, segment arrays against their segment manifest.

**Snapshots.** :meth:`SegmentedIndex.load` reads ``CURRENT``, then the manifest, then the
files it names: a loaded index is a snapshot and does not see later commits (call
:meth:`SegmentedIndex.refresh`). A load that races with a writer's clean-up retries on
the newer state, so a reader sees the old or the new state, never a mix. Writes
(:meth:`~SegmentedIndex.add`, :meth:`~SegmentedIndex.delete`, :meth:`~SegmentedIndex.compact`)
apply to the latest committed state, not to the snapshot, and then move the snapshot to the
state they committed.

A plain index folder (format 1) opens as a one-segment snapshot; the first write converts it
in place (its files are hard-linked into a segment; the folder stays a plain index until the
commit).

**Quantized indexes.** A quantized index (:mod:`gpusparse.quantize`) stays quantized with the
same bits and step through every write, so its results equal a fresh quantized build with
that step: added documents are quantized with it (a weight above the largest level is refused
unless ``clip``), and compaction keeps it. The manifest records the quantization, and a
snapshot whose segments disagree is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ._version import __version__
from .collection import SparseCollection
from .errors import IndexFormatError, InputError
from .index import Index
from .layout.postings import MAX_DOCS
from .quantize import Quantization, quantize_to
from .queries import as_queries
from .storage import (
    MANIFEST,
    _fsync_dir,
    _sha256,
    _write_synced,
    check_count,
    missing_current,
    parse_json,
    plain_name,
    read_manifest,
)
from .topk import merge_results
from .vocab import Vocabulary

FORMAT = "gpusparse-segmented-index"
FORMAT_VERSION = 1
CURRENT = "CURRENT"
LOCK = "LOCK"
SEGMENTS = "segments"
DELETIONS = "deletions"
_LOAD_RETRIES = 20


class SegmentedResults(NamedTuple):
    """Top-k results over all segments: ``scores`` float32, ``positions`` int64 global numbers
    (``-1`` padded) and ``ids`` the string ids (``None`` padded), all ``[n_queries, k]``."""

    scores: torch.Tensor
    positions: torch.Tensor
    ids: list[list[str | None]]


@dataclass
class Segment:
    """One immutable segment of a snapshot: its index, base offset and deletion bitmap."""

    name: str
    index: Index
    base: int
    deleted: np.ndarray  # bool [n_docs]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_deleted(self) -> int:
        return int(self.deleted.sum())


@dataclass(frozen=True)
class UpdateReport:
    """What a write did: ``generation`` committed, documents ``added``, ``deleted``
    (upserts included) and ``unknown`` ids asked to be deleted that were not live."""

    generation: int
    added: int = 0
    deleted: int = 0
    unknown: int = 0


class SegmentedIndex:
    """An index that grows by segments and deletes by bitmap; see the module docstring.

    Create with :meth:`create`, open with :meth:`load`, update with :meth:`add`,
    :meth:`delete`, :meth:`compact`; query with :meth:`search` / :meth:`retrieve`.
    """

    def __init__(
        self,
        path: Path,
        generation: int,
        segments: list[Segment],
        vocab: Vocabulary,
        quantization: Quantization | None = None,
        **opts: Any,
    ) -> None:
        self.path = path
        self.generation = generation
        self.segments = segments
        self.vocab = vocab
        # Every segment's (and every added document's) quantization; None for float weights.
        self.quantization = quantization
        self._opts = opts  # device, mmap, verify: how segments are loaded
        self._all_ids: list[str] | None = None

    # -- opening ------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | Path,
        documents: SparseCollection | Vocabulary,
        *,
        device: str | torch.device = "cpu",
        quantize: int | Quantization | None = None,
    ) -> SegmentedIndex:
        """A new index folder at ``path`` holding ``documents`` (or empty, over a vocabulary).

        ``quantize``: store quantized impacts, as :meth:`Index.build`; bits (the step then
        comes from ``documents``' largest weight, so they must not be empty) or a
        :class:`~gpusparse.quantize.Quantization` giving bits and step (weights above its
        largest level are clipped, as a fresh build with that step clips them).
        """
        path = Path(path)
        if path.exists() and any(path.iterdir()):
            raise FileExistsError(f"{path} already exists and is not empty")
        vocab = documents if isinstance(documents, Vocabulary) else documents.vocab
        quantization = quantize if isinstance(quantize, Quantization) or quantize is None else None
        if isinstance(quantize, int):
            if not isinstance(documents, SparseCollection) or not len(documents) or not documents.nnz:
                raise ValueError("an empty quantized index needs its step: pass quantize=Quantization(bits, step)")
            from .quantize import quantize_collection

            _, report = quantize_collection(documents, quantize)
            quantization = report.quantization
        (path / SEGMENTS).mkdir(parents=True, exist_ok=True)
        (path / DELETIONS).mkdir(exist_ok=True)
        with _locked(path):
            entries = []
            if isinstance(documents, SparseCollection) and len(documents):
                entries.append(_write_segment(path, _build(documents, quantization, clip=True), 1))
            _commit(path, 1, entries, vocab, quantization)
        return cls.load(path, device=device)

    @classmethod
    def load(
        cls, path: str | Path, *, device: str | torch.device = "cpu", mmap: bool = True, verify: bool = True
    ) -> SegmentedIndex:
        """A snapshot of the index at ``path`` (a segmented folder or a plain index folder).

        Raises:
            IndexFormatError: missing, torn or corrupted files (named in the message).
        """
        path = Path(path)
        opts = {"device": torch.device(device), "mmap": mmap, "verify": verify}
        return cls(path, *_load_state(path, {}, opts), **opts)

    def refresh(self) -> SegmentedIndex:
        """Move this snapshot to the latest committed state (unchanged segments are reused)."""
        self.generation, self.segments, self.vocab, self.quantization = _load_state(
            self.path, self._by_name(), self._opts
        )
        self._all_ids = None
        return self

    def _by_name(self) -> dict[str, Index]:
        return {s.name: s.index for s in self.segments}

    # -- contents -----------------------------------------------------------------------

    @property
    def n_docs(self) -> int:
        """Live (not deleted) documents."""
        return sum(s.index.n_docs - s.n_deleted for s in self.segments)

    @property
    def n_positions(self) -> int:
        """Global numbers in use: documents of all segments, deleted ones included."""
        return sum(s.index.n_docs for s in self.segments)

    @property
    def ids(self) -> list[str]:
        """String ids of the live documents, in global (insertion) order."""
        return [i for s in self.segments for i, d in zip(s.index.ids, s.deleted, strict=True) if not d]

    @property
    def position_ids(self) -> list[str]:
        """String ids by global number (deleted documents included), as ``search`` numbers them."""
        if self._all_ids is None:
            self._all_ids = [i for s in self.segments for i in s.index.ids]
        return self._all_ids

    def id_at(self, position: int) -> str:
        """The string id at a global number."""
        for s in self.segments:
            if s.base <= position < s.base + s.index.n_docs:
                return s.index.ids[position - s.base]
        raise IndexError(f"no document at global number {position}")

    def __repr__(self) -> str:
        return (
            f"SegmentedIndex({str(self.path)!r}, generation={self.generation}, segments={len(self.segments)}, "
            f"n_docs={self.n_docs})"
        )

    # -- search -------------------------------------------------------------------------

    def search(self, queries: object, k: int = 1000, **kwargs: Any) -> SegmentedResults:
        """Exact top-``k`` over all segments, deleted documents left out.

        Each segment is searched for ``k`` plus its deleted count (at most its size), so
        its live top-``k`` is among the results; the lists are merged by score descending,
        then global number ascending. ``kwargs`` go to :meth:`Index.search`.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive integer, not {k!r}")
        q = as_queries(queries, self.vocab)
        n_q = len(q)
        scores = [torch.zeros((n_q, 0), dtype=torch.float32)]
        positions = [torch.zeros((n_q, 0), dtype=torch.int64)]
        for s in self.segments:
            live = s.index.n_docs - s.n_deleted
            if live == 0:
                continue
            kk = min(k + s.n_deleted, s.index.n_docs)
            res = s.index.search(q, kk, **kwargs)
            local = res.ids
            ok = local >= 0
            if s.n_deleted:
                gone = torch.from_numpy(s.deleted)[local.clamp_min(0)]
                ok &= ~gone
            scores.append(res.scores)
            positions.append(torch.where(ok, local + s.base, torch.full_like(local, -1)))
        out_s, out_p = merge_results(torch.cat(scores, dim=1), torch.cat(positions, dim=1), k)
        names = self._names_of(out_p)
        return SegmentedResults(out_s, out_p, names)

    def _names_of(self, positions: torch.Tensor) -> list[list[str | None]]:
        names = self.position_ids  # built once per snapshot
        return [[names[p] if p >= 0 else None for p in row] for row in positions.tolist()]

    def retrieve(self, queries: SparseCollection, k: int = 1000, **kwargs: Any) -> dict[str, list[tuple[str, float]]]:
        """``{query id: [(document id, score), ...]}``, as :meth:`Index.retrieve`."""
        q = as_queries(queries, self.vocab)
        res = self.search(q, k, **kwargs)
        return {
            qid: [(d, float(s)) for d, s in zip(res.ids[i], res.scores[i].tolist(), strict=True) if d is not None]
            for i, qid in enumerate(q.ids)
        }

    # -- updates ------------------------------------------------------------------------

    def _latest(self) -> tuple[int, list[Segment]]:
        """The latest committed state, for a writer holding the lock (a plain index is
        given its segment folder first)."""
        gen, segs, _, quantization = _load_state(self.path, self._by_name(), self._opts)
        if gen == 0:
            _convert_plain(self.path, segs[0])
        return gen, segs, quantization

    def add(self, documents: SparseCollection, *, upsert: bool = False, clip: bool = False) -> UpdateReport:
        """Add ``documents`` as a new segment, in one commit.

        An id already live is refused (:class:`InputError`) unless ``upsert``, which deletes
        the old document in the same commit (the new one ranks as inserted now).

        On a quantized index the documents are quantized with the index's bits and step, as
        a fresh build with that step would store them. A weight above the largest level
        (``(2**bits - 1) · step``) is refused (:class:`InputError`, nothing written) unless
        ``clip``, which stores it as that largest level; a new step needs a rebuild.
        """
        documents = _in_vocab(documents, self.vocab)
        # Quantized (and refused) before the lock and the conversion of a plain folder, so a
        # refusal writes nothing; redone below only if the folder was replaced meanwhile.
        segment = _build(documents, self.quantization, clip=clip) if len(documents) else None
        with _locked(self.path):
            gen, segs, quantization = self._latest()
            if segment is not None and quantization != self.quantization:
                segment = _build(documents, quantization, clip=clip)
            live = _live_positions(segs)
            clash = [i for i in documents.ids if i in live]
            if clash and not upsert:
                raise InputError(
                    f"{len(clash):,} id(s) already in the index, e.g. {clash[0]!r} (delete them first, or upsert)",
                    field="id",
                )
            if sum(s.index.n_docs for s in segs) + len(documents) > MAX_DOCS:
                raise ValueError(f"more than {MAX_DOCS} documents in all segments: compact first")
            changed = _mark_deleted(segs, [live[i] for i in clash])
            entries = [_entry_of(s) for s in segs]
            _write_bitmaps(self.path, segs, changed, entries, gen + 1)
            if segment is not None:
                entries.append(_write_segment(self.path, segment, gen + 1))
            _commit(self.path, gen + 1, entries, self.vocab, quantization)
            self.refresh()
            _collect_garbage(self.path)
        return UpdateReport(gen + 1, added=len(documents), deleted=len(clash))

    def delete(self, ids: Iterable[str]) -> UpdateReport:
        """Mark the live documents with these string ids deleted; unknown ids are counted."""
        wanted = list(dict.fromkeys(ids))
        with _locked(self.path):
            gen, segs, quantization = self._latest()
            live = _live_positions(segs)
            found = [live[i] for i in wanted if i in live]
            changed = _mark_deleted(segs, found)
            entries = [_entry_of(s) for s in segs]
            _write_bitmaps(self.path, segs, changed, entries, gen + 1)
            _commit(self.path, gen + 1, entries, self.vocab, quantization)
            self.refresh()
            _collect_garbage(self.path)
        return UpdateReport(gen + 1, deleted=len(found), unknown=len(wanted) - len(found))

    def compact(self) -> UpdateReport:
        """Merge all segments into one, without the deleted documents (same search results;
        a quantized index keeps its bits and step)."""
        with _locked(self.path):
            gen, segs, quantization = self._latest()
            parts = [_live_documents(s) for s in segs]
            parts = [p for p in parts if len(p)]
            entries = []
            if parts:
                merged = SparseCollection.concat(parts) if len(parts) > 1 else parts[0]
                # The weights are already levels times the step: quantizing again keeps them as they are.
                entries.append(_write_segment(self.path, _build(merged, quantization, clip=True), gen + 1))
            _commit(self.path, gen + 1, entries, self.vocab, quantization)
            self.refresh()
            _collect_garbage(self.path)
        return UpdateReport(gen + 1, deleted=sum(s.n_deleted for s in segs))


def read_ids(source: str | Path) -> list[str]:
    """The document ids listed in ``source`` (``"-"``: standard input), one per line; blank
    lines are skipped and surrounding white space is stripped, as ``gpusparse delete`` reads
    its id file.

    Raises:
        InputError: the file cannot be read, or is not UTF-8 (naming the line and column).
    """
    name = "<stdin>" if str(source) == "-" else str(source)
    try:
        data = sys.stdin.buffer.read() if str(source) == "-" else Path(source).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read the id file ({exc.strerror or exc})", path=name) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(
            f"byte {data[exc.start]:#04x} at column {column} is not UTF-8: ids are UTF-8 text, one per line "
            "(convert the file, e.g. with iconv -t UTF-8)",
            path=name,
            line=line,
        ) from None
    return [line.strip() for line in text.splitlines() if line.strip()]


# -- state on disk ------------------------------------------------------------------------


def is_segmented(path: str | Path) -> bool:
    """Whether ``path`` is a segmented index folder (it has a ``CURRENT`` file)."""
    return (Path(path) / CURRENT).is_file()


def _read_current(path: Path) -> tuple[str, str]:
    try:
        text = (path / CURRENT).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise IndexFormatError(f"{path}: no {CURRENT} file") from None
    parts = text.split()
    if len(parts) != 2 or not parts[0].startswith("MANIFEST-"):
        raise IndexFormatError(f"{path}/{CURRENT}: unreadable ({text[:60]!r})")
    return plain_name(parts[0], path / CURRENT, "manifest"), parts[1]


_State = tuple[int, list[Segment], Vocabulary, Quantization | None]


def _load_state(path: Path, reuse: dict[str, Index], opts: dict[str, Any]) -> _State:
    """``(generation, segments, vocabulary, quantization)`` of the committed state, retried if
    a writer's clean-up removes files while we read them."""
    if not path.is_dir():
        raise IndexFormatError(f"{path}: no such index folder")
    for attempt in range(_LOAD_RETRIES):
        current = _read_current(path) if is_segmented(path) else None
        try:
            if current is not None:
                return _load_manifest(path, current, reuse, opts)
            if (path / MANIFEST).is_file():
                return _load_plain(path, reuse, opts)
            missing = missing_current(path)
            raise IndexFormatError(missing or f"{path}: not a GPUSparse index (no {CURRENT} or {MANIFEST})")
        except (IndexFormatError, OSError):
            now = _read_current(path) if is_segmented(path) else None
            if attempt + 1 == _LOAD_RETRIES or now == current:
                raise  # nothing moved under us: the files really are bad
    raise AssertionError("unreachable")


def _load_plain(path: Path, reuse: dict[str, Index], opts: dict[str, Any]) -> _State:
    index = reuse.get("") or Index.load(path, **opts)
    return 0, [Segment("", index, 0, np.zeros(index.n_docs, dtype=bool))], index.vocab, index.quantization


def _load_manifest(path: Path, current: tuple[str, str], reuse: dict[str, Index], opts: dict[str, Any]) -> _State:
    name, digest = current
    mpath = path / name
    try:
        data = mpath.read_bytes()
    except FileNotFoundError:
        raise IndexFormatError(f"{path}: {name}, named by {CURRENT}, is missing") from None
    if _sha(data) != digest:
        raise IndexFormatError(f"{mpath}: does not match its checksum in {CURRENT} (corrupted)")
    m = parse_json(data, mpath)
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("format_version"), int):
        raise IndexFormatError(f"{mpath}: not a GPUSparse segmented-index manifest")
    if m["format_version"] > FORMAT_VERSION:
        raise IndexFormatError(
            f"{path}: segmented format {m['format_version']} was written by a newer GPUSparse "
            f"({m.get('created_by', '?')}); this version reads format {FORMAT_VERSION}: upgrade gpusparse"
        )
    for key in ("generation", "vocab_fingerprint", "segments"):
        if key not in m:
            raise IndexFormatError(f"{mpath}: manifest lacks {key!r}")
    check_count(m["generation"], mpath, "generation")
    if not isinstance(m["segments"], list):
        raise IndexFormatError(f"{mpath}: 'segments' is a {type(m['segments']).__name__}, expected a list")
    for e in m["segments"]:
        _check_entry(mpath, e)
    if m.get("vocab") is not None:
        plain_name(m["vocab"], mpath, "vocabulary file")
    vocab = None
    segs, base = [], 0
    for e in m["segments"]:
        sdir = path / SEGMENTS / e["name"]
        smanifest = sdir / MANIFEST
        if not smanifest.is_file():
            raise IndexFormatError(f"{path}: segment {e['name']} is missing")
        if _sha256(smanifest) != e["manifest_sha256"]:
            raise IndexFormatError(f"{smanifest}: does not match its checksum in {name} (corrupted)")
        index = reuse.get(e["name"])
        if index is None:
            try:
                index = Index.load(sdir, **opts)
            except IndexFormatError as exc:
                raise IndexFormatError(f"segment {e['name']}: {exc}") from None
        if index.n_docs != e["n_docs"]:
            raise IndexFormatError(f"{sdir}: {index.n_docs} documents, the manifest says {e['n_docs']}")
        deleted = np.zeros(index.n_docs, dtype=bool)
        if e.get("deleted"):
            deleted = _read_bitmap(path, e["deleted"], index.n_docs)
        vocab = vocab or index.vocab
        segs.append(Segment(e["name"], index, base, deleted, e))
        base += index.n_docs
    if vocab is None:
        vocab = Vocabulary.load(path / m["vocab"]) if m.get("vocab") else Vocabulary.bert()
    if vocab.fingerprint != m["vocab_fingerprint"]:
        raise IndexFormatError(f"{mpath}: the segments' vocabulary does not match the manifest's")
    return int(m["generation"]), segs, vocab, _quantization_of(mpath, m, segs)


def _quantization_of(mpath: Path, m: dict[str, Any], segs: list[Segment]) -> Quantization | None:
    """The manifest's quantization, which every segment must share: segments quantized
    differently (or some not at all) would rank with different scales, a wrong answer."""
    if "quantization" in m:
        try:
            q = None if m["quantization"] is None else Quantization.from_dict(m["quantization"])
        except (KeyError, TypeError, ValueError) as exc:
            raise IndexFormatError(f"{mpath}: bad quantization in the manifest ({exc})") from None
    else:  # written before the manifest recorded it: the segments' own
        q = segs[0].index.quantization if segs else None
    for s in segs:
        if s.index.quantization != q:
            raise IndexFormatError(
                f"{mpath}: segment {s.name} is quantized as {s.index.quantization}, the index as {q}: its results "
                "would mix scales (an add or compact by an older gpusparse lost the quantization); "
                "rebuild the index from its documents"
            )
    return q


def _check_entry(mpath: Path, e: object) -> None:
    """A segment entry's shape: names are plain file names (nothing outside the folder is
    ever read or deleted), counts are integers, checksums strings."""
    if not isinstance(e, dict):
        raise IndexFormatError(f"{mpath}: a segment entry is a {type(e).__name__}, expected an object")
    plain_name(e.get("name"), mpath, "segment")
    check_count(e.get("n_docs"), mpath, f"segment {e['name']}'s n_docs")
    if not isinstance(e.get("manifest_sha256"), str):
        raise IndexFormatError(f"{mpath}: segment {e['name']} has no manifest_sha256 string")
    d = e.get("deleted")
    if d is not None:
        if not isinstance(d, dict) or not isinstance(d.get("sha256"), str):
            raise IndexFormatError(f"{mpath}: segment {e['name']}'s deletion entry is malformed")
        plain_name(d.get("file"), mpath, "deletion file")
        check_count(d.get("count"), mpath, f"segment {e['name']}'s deletion count")


def _read_bitmap(path: Path, meta: dict[str, Any], n: int) -> np.ndarray:
    f = path / DELETIONS / meta["file"]
    if not f.is_file():
        raise IndexFormatError(f"{path}: deletion file {meta['file']} is missing")
    data = f.read_bytes()
    if _sha(data) != meta["sha256"]:
        raise IndexFormatError(f"{f}: does not match its checksum (corrupted)")
    bits = np.load(io.BytesIO(data), allow_pickle=False)
    deleted = np.unpackbits(bits, count=n).astype(bool)
    if int(deleted.sum()) != meta["count"]:
        raise IndexFormatError(f"{f}: {int(deleted.sum())} deletions, the manifest says {meta['count']}")
    return deleted


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# -- writing ------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One writer at a time (an advisory ``flock``, released if the process dies)."""
    if not path.is_dir():
        raise IndexFormatError(f"{path}: no such index folder")
    with (path / LOCK).open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _in_vocab(documents: SparseCollection, vocab: Vocabulary) -> SparseCollection:
    if not isinstance(documents, SparseCollection):
        raise TypeError("documents must be a SparseCollection")
    if documents.vocab == vocab:
        return documents
    if documents.vocab.is_integer and len(documents.vocab) <= len(vocab):  # anonymous term ids
        return SparseCollection(documents.indptr, documents.indices, documents.values, documents.ids, vocab)
    raise InputError(
        f"the documents' vocabulary ({documents.vocab.fingerprint[:12]}, {len(documents.vocab)} tokens) is not "
        f"the index's ({vocab.fingerprint[:12]}, {len(vocab)} tokens)",
        field="vocabulary",
    )


def _live_positions(segs: list[Segment]) -> dict[str, tuple[int, int]]:
    """Live string id → (segment number, local id)."""
    out: dict[str, tuple[int, int]] = {}
    for si, s in enumerate(segs):
        for j, (i, d) in enumerate(zip(s.index.ids, s.deleted, strict=True)):
            if not d:
                out[i] = (si, j)
    return out


def _mark_deleted(segs: list[Segment], where: list[tuple[int, int]]) -> set[int]:
    """Set the bits (copies of the bitmaps: snapshots share none); the segments changed."""
    changed: set[int] = set()
    for si, j in where:
        if si not in changed:
            segs[si].deleted = segs[si].deleted.copy()
            changed.add(si)
        segs[si].deleted[j] = True
    return changed


def _entry_of(s: Segment) -> dict[str, Any]:
    """A segment's manifest entry as committed (``_write_bitmaps`` replaces ``deleted``)."""
    return {
        "name": s.name,
        "n_docs": s.index.n_docs,
        "manifest_sha256": s.meta.get("manifest_sha256"),
        "deleted": s.meta.get("deleted"),
    }


def _write_bitmaps(path: Path, segs: list[Segment], changed: set[int], entries: list[dict], gen: int) -> None:
    for si in sorted(changed):
        s = segs[si]
        buf = io.BytesIO()
        np.save(buf, np.packbits(s.deleted))
        fname = f"{s.name}-{gen:06d}-{uuid.uuid4().hex[:8]}.npy"
        _write_synced(path / DELETIONS / fname, buf.getvalue())
        entries[si]["deleted"] = {"file": fname, "sha256": _sha(buf.getvalue()), "count": s.n_deleted}
    if changed:
        _fsync_dir(path / DELETIONS)


def _build(documents: SparseCollection, quantization: Quantization | None, *, clip: bool) -> Index:
    """A segment's index: ``documents`` quantized with the index's bits and step, if any."""
    if quantization is None:
        return Index.build(documents)
    index = Index.build(quantize_to(documents, quantization, clip=clip)[0])
    index.quantization = quantization
    return index


def _write_segment(path: Path, index: Index, gen: int) -> dict[str, Any]:
    name = f"seg-{gen:06d}-{uuid.uuid4().hex[:8]}"
    sdir = path / SEGMENTS / name
    index.save(sdir)  # atomic: temporary folder, then rename
    _share_vocabulary(path, sdir)
    return {"name": name, "n_docs": index.n_docs, "manifest_sha256": _sha256(sdir / MANIFEST), "deleted": None}


def _share_vocabulary(path: Path, sdir: Path) -> None:
    """Hard-link the new segment's ``vocab.txt`` to an identical one of another segment, so
    segments share one copy on disk (a BERT vocabulary is ~230 kB per segment otherwise).
    The segment is not committed yet, so a crash here leaves only garbage; where links are
    not possible the segment keeps its own copy."""
    mine = sdir / "vocab.txt"
    digest = _sha256(mine)
    for other in (path / SEGMENTS).iterdir():
        f = other / "vocab.txt"
        if other == sdir or other.name.startswith(".") or not f.is_file() or f.stat().st_size != mine.stat().st_size:
            continue
        if _sha256(f) != digest:
            continue
        tmp = sdir / f".vocab.txt.tmp-{uuid.uuid4().hex[:8]}"
        try:
            os.link(f, tmp)
            os.replace(tmp, mine)
        except OSError:
            tmp.unlink(missing_ok=True)
        return


def _commit(
    path: Path, gen: int, entries: list[dict[str, Any]], vocab: Vocabulary, quantization: Quantization | None
) -> None:
    """Write manifest ``gen`` and switch ``CURRENT`` to it: the commit point."""
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"gpusparse {__version__}",
        "generation": gen,
        "n_docs": sum(e["n_docs"] - (e["deleted"] or {}).get("count", 0) for e in entries),
        "vocab_fingerprint": vocab.fingerprint,
        "segments": entries,
        "quantization": None if quantization is None else quantization.to_dict(),
    }
    if not entries:  # an empty index still needs its vocabulary
        vname = f"vocab-{gen:06d}-{uuid.uuid4().hex[:8]}.txt"
        vocab.save(path / vname)
        with (path / vname).open("rb+") as fh:
            os.fsync(fh.fileno())
        manifest["vocab"] = vname
    data = json.dumps(manifest, indent=2).encode()
    name = f"MANIFEST-{gen:06d}.json"
    tmp = path / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    _write_synced(tmp, data)
    os.replace(tmp, path / name)
    tmp = path / f".{CURRENT}.tmp-{uuid.uuid4().hex[:8]}"
    _write_synced(tmp, f"{name} {_sha(data)}\n".encode())
    _fsync_dir(path)
    os.replace(tmp, path / CURRENT)  # the commit
    _fsync_dir(path)


def _convert_plain(path: Path, seg: Segment) -> None:
    """Hard-link (or copy) the plain index in ``path`` into a new segment folder; the
    folder stays a plain index until the writer commits."""
    plain = read_manifest(path)
    for sub in (SEGMENTS, DELETIONS):
        (path / sub).mkdir(exist_ok=True)
    name = f"seg-000000-{uuid.uuid4().hex[:8]}"
    tmp = path / SEGMENTS / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    for fname in [*plain["files"], MANIFEST]:
        try:
            os.link(path / fname, tmp / fname)
        except OSError:
            shutil.copy2(path / fname, tmp / fname)
    _fsync_dir(tmp)
    tmp.rename(path / SEGMENTS / name)
    _fsync_dir(path / SEGMENTS)
    seg.name = name
    seg.meta = {"name": name, "n_docs": seg.index.n_docs, "manifest_sha256": _sha256(path / SEGMENTS / name / MANIFEST)}


def _live_documents(s: Segment) -> SparseCollection:
    """The segment's live documents as a collection, in order (weights bit for bit)."""
    from .verify import documents_from_index_arrays

    idx = s.index
    arrays = {k: v.cpu().numpy() for k, v in idx.arrays().items()}
    mat = documents_from_index_arrays(
        arrays["doc_ids"], arrays["scores"], arrays["offsets"], arrays["lengths"], idx.n_docs
    )
    keep = np.flatnonzero(~s.deleted)
    mat = mat[keep]
    ids = [idx.ids[j] for j in keep]
    return SparseCollection(mat.indptr, mat.indices, mat.data, ids, idx.vocab, check_ids=False)


def _collect_garbage(path: Path) -> None:
    """Remove what no committed state needs: old manifests, unreferenced segments and
    bitmaps, temporary files of crashed writers, and a converted plain index's files.
    Called by writers, under the lock, after a commit."""
    name, _ = _read_current(path)
    m = json.loads((path / name).read_bytes())
    segs = {e["name"] for e in m["segments"]}
    bitmaps = {e["deleted"]["file"] for e in m["segments"] if e.get("deleted")}
    for p in (path / SEGMENTS).iterdir():
        if p.name not in segs:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for p in (path / DELETIONS).iterdir():
        if p.name not in bitmaps:
            p.unlink(missing_ok=True)
    if (path / MANIFEST).is_file():  # a converted plain index: its manifest first, then its files
        try:
            listed = list(read_manifest(path)["files"])  # checked: plain names inside the folder only
        except IndexFormatError:
            listed = []  # replaced since the conversion by something we cannot trust: delete none of it
        (path / MANIFEST).unlink()
        for fname in listed:
            (path / fname).unlink(missing_ok=True)
    for p in path.iterdir():
        stale_manifest = p.name.startswith("MANIFEST-") and p.name != name
        stale_vocab = p.name.startswith("vocab-") and p.name != m.get("vocab")
        if stale_manifest or stale_vocab or (p.name.startswith(".") and ".tmp-" in p.name):
            p.unlink(missing_ok=True)
    _fsync_dir(path)
