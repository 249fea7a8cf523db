"""The files of an updatable index (:class:`~gpusparse.segments.SegmentedIndex`) and how they
change: reading ``CURRENT`` and the manifest it names into a snapshot, writing segments,
deletion bitmaps and manifests, the atomic commit, the writer's lock, converting a plain
folder in place and collecting what dead writers left. The folder's layout and its
crash-safety argument are in :mod:`gpusparse.segments`' docstring.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .errors import IndexFormatError
from .index import Index
from .quantize import Quantization
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
from .vocab import Vocabulary

FORMAT = "gpusparse-segmented-index"


FORMAT_VERSION = 1


CURRENT = "CURRENT"


LOCK = "LOCK"


SEGMENTS = "segments"


DELETIONS = "deletions"


LOAD_RETRIES = 20


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


def is_segmented(path: str | Path) -> bool:
    """Whether ``path`` is a segmented index folder (it has a ``CURRENT`` file)."""
    return (Path(path) / CURRENT).is_file()


def read_current(path: Path) -> tuple[str, str]:
    try:
        text = (path / CURRENT).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise IndexFormatError(f"{path}: no {CURRENT} file") from None
    parts = text.split()
    if len(parts) != 2 or not parts[0].startswith("MANIFEST-"):
        raise IndexFormatError(f"{path}/{CURRENT}: unreadable ({text[:60]!r})")
    return plain_name(parts[0], path / CURRENT, "manifest"), parts[1]


State = tuple[int, list[Segment], Vocabulary, Quantization | None]


def load_state(path: Path, reuse: dict[str, Index], opts: dict[str, Any]) -> State:
    """``(generation, segments, vocabulary, quantization)`` of the committed state, retried if
    a writer's clean-up removes files while we read them."""
    if not path.is_dir():
        raise IndexFormatError(f"{path}: no such index folder")
    for attempt in range(LOAD_RETRIES):
        current = read_current(path) if is_segmented(path) else None
        try:
            if current is not None:
                return load_manifest(path, current, reuse, opts)
            if (path / MANIFEST).is_file():
                return load_plain(path, reuse, opts)
            missing = missing_current(path)
            raise IndexFormatError(missing or f"{path}: not a GPUSparse index (no {CURRENT} or {MANIFEST})")
        except (IndexFormatError, OSError):
            now = read_current(path) if is_segmented(path) else None
            if attempt + 1 == LOAD_RETRIES or now == current:
                raise  # nothing moved under us: the files really are bad
    raise AssertionError("unreachable")


def load_plain(path: Path, reuse: dict[str, Index], opts: dict[str, Any]) -> State:
    index = reuse.get("") or Index.load(path, **opts)
    return 0, [Segment("", index, 0, np.zeros(index.n_docs, dtype=bool))], index.vocab, index.quantization


def load_manifest(path: Path, current: tuple[str, str], reuse: dict[str, Index], opts: dict[str, Any]) -> State:
    name, digest = current
    mpath = path / name
    try:
        data = mpath.read_bytes()
    except FileNotFoundError:
        raise IndexFormatError(f"{path}: {name}, named by {CURRENT}, is missing") from None
    if sha(data) != digest:
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
        check_entry(mpath, e)
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
            deleted = read_bitmap(path, e["deleted"], index.n_docs)
        vocab = vocab or index.vocab
        segs.append(Segment(e["name"], index, base, deleted, e))
        base += index.n_docs
    if vocab is None:
        vocab = Vocabulary.load(path / m["vocab"]) if m.get("vocab") else Vocabulary.bert()
    if vocab.fingerprint != m["vocab_fingerprint"]:
        raise IndexFormatError(f"{mpath}: the segments' vocabulary does not match the manifest's")
    return int(m["generation"]), segs, vocab, quantization_of(mpath, m, segs)


def quantization_of(mpath: Path, m: dict[str, Any], segs: list[Segment]) -> Quantization | None:
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


def check_entry(mpath: Path, e: object) -> None:
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


def read_bitmap(path: Path, meta: dict[str, Any], n: int) -> np.ndarray:
    f = path / DELETIONS / meta["file"]
    if not f.is_file():
        raise IndexFormatError(f"{path}: deletion file {meta['file']} is missing")
    data = f.read_bytes()
    if sha(data) != meta["sha256"]:
        raise IndexFormatError(f"{f}: does not match its checksum (corrupted)")
    bits = np.load(io.BytesIO(data), allow_pickle=False)
    deleted = np.unpackbits(bits, count=n).astype(bool)
    if int(deleted.sum()) != meta["count"]:
        raise IndexFormatError(f"{f}: {int(deleted.sum())} deletions, the manifest says {meta['count']}")
    return deleted


def sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One writer at a time (an advisory ``flock``, released if the process dies)."""
    if not path.is_dir():
        raise IndexFormatError(f"{path}: no such index folder")
    with (path / LOCK).open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def entry_of(s: Segment) -> dict[str, Any]:
    """A segment's manifest entry as committed (``write_bitmaps`` replaces ``deleted``)."""
    return {
        "name": s.name,
        "n_docs": s.index.n_docs,
        "manifest_sha256": s.meta.get("manifest_sha256"),
        "deleted": s.meta.get("deleted"),
    }


def write_bitmaps(path: Path, segs: list[Segment], changed: set[int], entries: list[dict], gen: int) -> None:
    for si in sorted(changed):
        s = segs[si]
        buf = io.BytesIO()
        np.save(buf, np.packbits(s.deleted))
        fname = f"{s.name}-{gen:06d}-{uuid.uuid4().hex[:8]}.npy"
        _write_synced(path / DELETIONS / fname, buf.getvalue())
        entries[si]["deleted"] = {"file": fname, "sha256": sha(buf.getvalue()), "count": s.n_deleted}
    if changed:
        _fsync_dir(path / DELETIONS)


def write_segment(path: Path, index: Index, gen: int) -> dict[str, Any]:
    name = f"seg-{gen:06d}-{uuid.uuid4().hex[:8]}"
    sdir = path / SEGMENTS / name
    index.save(sdir)  # atomic: temporary folder, then rename
    share_vocabulary(path, sdir)
    return {"name": name, "n_docs": index.n_docs, "manifest_sha256": _sha256(sdir / MANIFEST), "deleted": None}


def share_vocabulary(path: Path, sdir: Path) -> None:
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


def commit(
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
    _write_synced(tmp, f"{name} {sha(data)}\n".encode())
    _fsync_dir(path)
    os.replace(tmp, path / CURRENT)  # the commit
    _fsync_dir(path)


def convert_plain(path: Path, seg: Segment) -> None:
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


def collect_garbage(path: Path) -> None:
    """Remove what no committed state needs: old manifests, unreferenced segments and
    bitmaps, temporary files of crashed writers, and a converted plain index's files.
    Called by writers, under the lock, after a commit."""
    name, _ = read_current(path)
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
