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

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .collection import SparseCollection
from .errors import InputError
from .index import Index
from .layout.postings import MAX_DOCS
from .layout.statistics import max_scores_host
from .quantize import Quantization, quantize_to
from .queries import as_queries, prepare_queries
from .search import result_width
from .segment_files import (
    DELETIONS,
    SEGMENTS,
    Segment,
    collect_garbage,
    commit,
    convert_plain,
    entry_of,
    load_state,
    locked,
    write_bitmaps,
    write_segment,
)
from .topk import merge_results
from .vocab import Vocabulary


class SegmentedResults(NamedTuple):
    """Top-k results over all segments: ``scores`` float32, ``positions`` int64 global numbers
    (``-1`` padded) and ``ids`` the string ids (``None`` padded), all ``[n_queries, k]``."""

    scores: torch.Tensor
    positions: torch.Tensor
    ids: list[list[str | None]]


@dataclass(frozen=True)
class UpdateReport:
    """What a write did: ``generation`` committed, documents ``added``, ``deleted``
    (upserts included) and ``unknown`` ids asked to be deleted that were not live (those
    ids in ``unknown_ids``)."""

    generation: int
    added: int = 0
    deleted: int = 0
    unknown: int = 0
    unknown_ids: tuple[str, ...] = ()


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
        with locked(path):
            entries = []
            if isinstance(documents, SparseCollection) and len(documents):
                entries.append(write_segment(path, build_segment(documents, quantization, clip=True), 1))
            commit(path, 1, entries, vocab, quantization)
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
        return cls(path, *load_state(path, {}, opts), **opts)

    def refresh(self) -> SegmentedIndex:
        """Move this snapshot to the latest committed state (unchanged segments are reused)."""
        self.generation, self.segments, self.vocab, self.quantization = load_state(
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
        then global number ascending. ``kwargs`` go to :meth:`Index.search`. The results
        have :meth:`Index.search`'s width for the live documents
        (:func:`~gpusparse.search.result_width`); a query whose scores could overflow
        float32 over all segments is refused (:class:`InputError`), as a compacted index
        would refuse it.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive integer, not {k!r}")
        q = as_queries(queries, self.vocab)
        if self.segments:  # the bound of all segments' documents, before any is searched
            maxima = np.maximum.reduce([max_scores_host(s.index) for s in self.segments])
            prepare_queries(q, self.vocab, self.quantization, maxima)
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
        out_s, out_p = merge_results(
            torch.cat(scores, dim=1), torch.cat(positions, dim=1), result_width(k, self.n_docs)
        )
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
        gen, segs, _, quantization = load_state(self.path, self._by_name(), self._opts)
        if gen == 0:
            convert_plain(self.path, segs[0])
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
        documents = in_vocabulary(documents, self.vocab)
        # Quantized (and refused) before the lock and the conversion of a plain folder, so a
        # refusal writes nothing; redone below only if the folder was replaced meanwhile.
        segment = build_segment(documents, self.quantization, clip=clip) if len(documents) else None
        with locked(self.path):
            gen, segs, quantization = self._latest()
            if segment is not None and quantization != self.quantization:
                segment = build_segment(documents, quantization, clip=clip)
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
            entries = [entry_of(s) for s in segs]
            write_bitmaps(self.path, segs, changed, entries, gen + 1)
            if segment is not None:
                entries.append(write_segment(self.path, segment, gen + 1))
            commit(self.path, gen + 1, entries, self.vocab, quantization)
            self.refresh()
            collect_garbage(self.path)
        return UpdateReport(gen + 1, added=len(documents), deleted=len(clash))

    def delete(self, ids: Iterable[str]) -> UpdateReport:
        """Mark the live documents with these string ids deleted; unknown ids are counted."""
        wanted = list(dict.fromkeys(ids))
        with locked(self.path):
            gen, segs, quantization = self._latest()
            live = _live_positions(segs)
            found = [live[i] for i in wanted if i in live]
            changed = _mark_deleted(segs, found)
            entries = [entry_of(s) for s in segs]
            write_bitmaps(self.path, segs, changed, entries, gen + 1)
            commit(self.path, gen + 1, entries, self.vocab, quantization)
            self.refresh()
            collect_garbage(self.path)
        unknown = tuple(i for i in wanted if i not in live)
        return UpdateReport(gen + 1, deleted=len(found), unknown=len(unknown), unknown_ids=unknown)

    def compact(self) -> UpdateReport:
        """Merge all segments into one, without the deleted documents (same search results;
        a quantized index keeps its bits and step)."""
        with locked(self.path):
            gen, segs, quantization = self._latest()
            parts = [_live_documents(s) for s in segs]
            parts = [p for p in parts if len(p)]
            entries = []
            if parts:
                merged = SparseCollection.concat(parts) if len(parts) > 1 else parts[0]
                # The weights are already levels times the step: quantizing again keeps them as they are.
                entries.append(write_segment(self.path, build_segment(merged, quantization, clip=True), gen + 1))
            commit(self.path, gen + 1, entries, self.vocab, quantization)
            self.refresh()
            collect_garbage(self.path)
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


# -- writing ------------------------------------------------------------------------------


def in_vocabulary(documents: SparseCollection, vocab: Vocabulary) -> SparseCollection:
    """``documents`` over the index's vocabulary ``vocab`` (anonymous term ids are taken as
    its ids); another vocabulary is refused (:class:`InputError`)."""
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


def build_segment(documents: SparseCollection, quantization: Quantization | None, *, clip: bool) -> Index:
    """A segment's index: ``documents`` quantized with the index's bits and step, if any."""
    if quantization is None:
        return Index.build(documents)
    index = Index.build(quantize_to(documents, quantization, clip=clip)[0])
    index.quantization = quantization
    return index


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
