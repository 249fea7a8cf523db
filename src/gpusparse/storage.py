"""Saving and loading index folders.

An index folder holds plain ``.npy`` arrays (memory-mappable, no pickle), the documents'
string ids (``ids.txt``, one per line), the vocabulary (``vocab.txt``) and a
``manifest.json`` with the format version, the counts and every file's size and SHA-256,
and its own SHA-256 (``manifest_sha256``, over the rest of the manifest: see :func:`seal`),
so an edited count, quantization or file list is refused like a corrupted array. Folders
written before manifests carried it still load, unchecked.
A folder is written under a temporary name (``.NAME.tmp-*``) and moved into place, so a
crash never leaves a half-written index under the real name. Replacing an existing index
(``overwrite``) swaps the two folders in one atomic ``renameat2(RENAME_EXCHANGE)`` where
Linux offers it, so a crash at any point leaves the old or the new index at the path.
Elsewhere it takes two renames (the old folder to ``.NAME.old-*``, the new one into place):
a crash between them leaves no folder at the path, and then a reader loads the complete
``.NAME.old-*`` (the last index written) and the next writer renames it back first.

A writer holds an ``flock`` on its temporary folder while it writes; the next writer to the
same path removes the leftovers of writers that died (unlocked ``.NAME.tmp-*`` and
``.NAME.old-*`` folders), so killed writes do not accumulate.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._version import __version__
from .array_files import FileJobError, read_all, read_npy, write_all, write_npy
from .errors import IndexFormatError
from .layout.postings import PostingLists
from .quantize import Quantization
from .vocab import Vocabulary

FORMAT = "gpusparse-index"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_DTYPES = {
    "doc_ids": np.int32,
    "scores": np.float32,
    "offsets": np.int64,
    "lengths": np.int32,
    "padded_lengths": np.int32,
    "max_scores": np.float32,
}


def save_index(index: PostingLists, path: str | Path, *, overwrite: bool = False) -> None:
    """Write ``index`` to folder ``path`` atomically (see the module docstring)."""
    path = Path(path)
    tmp = new_folder(path, overwrite)
    fname = ""  # the file being written, for a disk-full message
    try:
        try:  # each array reaches the host only when its file is written: one host copy at a time
            files = write_all({
                f"{n}.npy": functools.partial(_write_array, tmp / f"{n}.npy", t, _DTYPES[n])
                for n, t in index.arrays().items()
            })  # fmt: skip
        except FileJobError as err:
            fname = err.name
            raise err.error from None
        fname = "ids.txt"
        with (tmp / fname).open("w", encoding="utf-8", newline="\n") as f:
            if index.ids:  # one write, not one a document
                f.write("\n".join(index.ids) + "\n")
        files[fname] = _describe(tmp / fname)
        fname = "vocab.txt"
        index.vocab.save(tmp / fname)
        files[fname] = _describe(tmp / fname)
        fname = MANIFEST
        st = index.stats()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_by": f"gpusparse {__version__}",
            "n_docs": st.n_docs,
            "n_terms": st.n_terms,
            "n_postings": st.n_postings,
            "n_padded": st.n_padded,
            "n_empty_docs": st.n_empty_docs,
            "vocab_fingerprint": index.vocab.fingerprint,
            "files": files,
        }
        if index.quantization is not None:
            manifest["quantization"] = index.quantization.to_dict()
        _write_synced(tmp / MANIFEST, json.dumps(seal(manifest), indent=2).encode())
        replace_folder(tmp, path, overwrite=overwrite)
    except OSError as exc:
        discard_folder(tmp)
        if isinstance(exc, FileExistsError) or not _is_disk_full(exc):
            raise
        raise OSError(
            errno.ENOSPC,
            f"the disk is full: writing {fname} of the index failed ({exc.strerror or exc}); nothing was changed "
            f"at {path}: free space on its disk (or write the index elsewhere) and run again",
            str(path),
        ) from None
    except BaseException:
        discard_folder(tmp)
        raise


def _is_disk_full(exc: OSError) -> bool:
    # numpy's tofile reports a short write as "N requested and M written", without an errno.
    return exc.errno in (errno.ENOSPC, errno.EDQUOT) or "requested and" in str(exc)


_HELD: dict[Path, int] = {}  # staging folder -> descriptor holding its flock (released when done)


def new_folder(path: Path, overwrite: bool) -> Path:
    """A fresh temporary folder beside ``path`` for :func:`replace_folder` to move into place
    (or :func:`discard_folder` to drop); refuses an existing ``path`` unless ``overwrite``, and
    anything not an index. Cleans what killed writers to ``path`` left first."""
    clean_stale(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists: pass overwrite=True (gpusparse index --overwrite) to replace it")
    if path.exists() and not ((path / MANIFEST).is_file() or (path / "CURRENT").is_file()):
        raise FileExistsError(f"{path} exists and is not a GPUSparse index; refusing to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise FileExistsError(f"cannot create {path}: {_file_above(path)} is a file, not a folder") from None
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    fd = os.open(tmp, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # "a writer is alive": see clean_stale
    _HELD[tmp] = fd
    return tmp


def _file_above(path: Path) -> Path:
    """The first ancestor of ``path`` that exists and is not a folder (for a message)."""
    for p in reversed(path.parents):
        if p.exists() and not p.is_dir():
            return p
    return path.parent


def discard_folder(tmp: Path) -> None:
    """Remove a staging folder of :func:`new_folder` after a failure."""
    shutil.rmtree(tmp, ignore_errors=True)
    _release(tmp)


def _release(tmp: Path) -> None:
    fd = _HELD.pop(tmp, None)
    if fd is not None:
        os.close(fd)


def replace_folder(tmp: Path, path: Path, *, overwrite: bool) -> None:
    """Put the finished folder ``tmp`` at ``path``: with ``overwrite`` an index there is
    replaced whole (see the module docstring for what a crash leaves); without, one that
    appeared since :func:`new_folder` looked is refused, not replaced."""
    try:
        _fsync_dir(tmp)
        if overwrite and path.exists():
            if _exchange(tmp, path):  # atomic: ``tmp`` now holds the old index
                _fsync_dir(path.parent)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
                fd = os.open(path, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)  # so another writer's clean_stale leaves it while we move
                    path.rename(old)
                    tmp.rename(path)
                    _fsync_dir(path.parent)
                    shutil.rmtree(old, ignore_errors=True)
                finally:
                    os.close(fd)
        else:
            try:
                tmp.rename(path)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
                # Created by another process since new_folder looked: name the user's path, not ours.
                raise FileExistsError(
                    f"{path} already exists (another process wrote it meanwhile): pass overwrite=True "
                    "(gpusparse index --overwrite) to replace it"
                ) from None
        _fsync_dir(path.parent)
    finally:
        _release(tmp)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap folders ``a`` and ``b`` atomically (Linux ``renameat2``); False where the system
    or the file system cannot, for the caller to fall back to two renames."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    res = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if res == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _leftovers(path: Path) -> list[Path]:
    """Staging (``.NAME.tmp-*``) and replaced (``.NAME.old-*``) folders beside ``path``."""
    prefixes = (f".{path.name}.tmp-", f".{path.name}.old-")
    try:
        return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefixes))
    except OSError:
        return []


def _writer_alive(folder: Path) -> bool:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return True  # gone or unreadable: not ours to remove
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def interrupted_overwrite(path: Path) -> Path | None:
    """The complete index an overwrite killed between its two renames left in ``.NAME.old-*``
    while nothing is at ``path``; None otherwise."""
    if path.exists():
        return None
    old = [p for p in _leftovers(path) if ".old-" in p.name and (p / MANIFEST).is_file()]
    return max(old, key=lambda p: p.stat().st_mtime) if old else None


def readable_folder(path: Path) -> Path:
    """``path``, or the last complete index an interrupted overwrite left beside it (module
    docstring; the next writer restores it): the folder a reader of ``path`` reads."""
    old = interrupted_overwrite(path)
    return path if old is None else old


def clean_stale(path: Path) -> None:
    """Remove what writers to ``path`` that died left beside it, restoring first an old index
    whose replacement never arrived (see the module docstring)."""
    restore = interrupted_overwrite(path)
    if restore is not None and not _writer_alive(restore):
        restore.rename(path)
        _fsync_dir(path.parent)
    for p in _leftovers(path):
        if p.is_dir() and not _writer_alive(p):
            shutil.rmtree(p, ignore_errors=True)


def load_index(path: str | Path, *, device: str | torch.device, mmap: bool, verify: bool) -> PostingLists:
    """Read an index folder's posting lists; see :meth:`gpusparse.Index.load`."""
    path = readable_folder(Path(path))
    manifest = _read_manifest(path)
    files = manifest["files"]  # plain names with sizes and checksums (checked by _read_manifest)
    for fname, meta in files.items():
        f = path / fname
        if not f.is_file():
            raise IndexFormatError(f"{path}: {fname} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise IndexFormatError(f"{path}: {fname} has {size} bytes, the manifest says {meta['bytes']} (truncated?)")
    arrays_read = {f"{name}.npy" for name in _DTYPES}
    for fname in files:
        if fname in arrays_read or not verify:
            continue  # the arrays are checked as they are read
        if _sha256(path / fname) != files[fname]["sha256"]:
            raise IndexFormatError(f"{path}: {fname} does not match its checksum (corrupted)")
    device = torch.device(device)
    for name in _DTYPES:
        if f"{name}.npy" not in files:
            raise IndexFormatError(f"{path}: the manifest lists no {name}.npy")
    arrays = read_all({
        name: functools.partial(
            read_npy, path / f"{name}.npy", dtype, device=device, mmap=mmap,
            sha256=files[f"{name}.npy"]["sha256"] if verify else None,
        )
        for name, dtype in _DTYPES.items()
    })  # fmt: skip
    n_docs, n_terms, n_padded = manifest["n_docs"], manifest["n_terms"], manifest["n_padded"]
    for name in ("offsets", "lengths", "padded_lengths", "max_scores"):
        if arrays[name].numel() != n_terms:
            raise IndexFormatError(f"{path}: {name} has {arrays[name].numel()} entries, expected {n_terms}")
    for name in ("doc_ids", "scores"):
        if arrays[name].numel() != n_padded:
            raise IndexFormatError(f"{path}: {name} has {arrays[name].numel()} entries, expected {n_padded}")
    ids = (path / "ids.txt").read_text(encoding="utf-8").split("\n")[:-1]
    if len(ids) != n_docs:
        raise IndexFormatError(f"{path}: ids.txt has {len(ids)} ids, expected {n_docs}")
    vocab = Vocabulary.load(path / "vocab.txt")
    if vocab.fingerprint != manifest["vocab_fingerprint"]:
        raise IndexFormatError(f"{path}: vocab.txt does not match the manifest's fingerprint")
    quantization = _quantization(manifest, path)
    return PostingLists(
        arrays, ids=ids, vocab=vocab, n_empty_docs=manifest.get("n_empty_docs"), quantization=quantization
    )


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of an index folder, checked for format and version."""
    return _read_manifest(Path(path))


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise IndexFormatError(f"{path}: no such index folder")
    mpath = path / MANIFEST
    if not mpath.is_file():
        if (path / "CURRENT").is_file():  # gpusparse.segments: updated with add/delete/compact
            raise IndexFormatError(
                f"{path}: a segmented index (updated by gpusparse add/delete/compact); "
                "open it with gpusparse.segments.SegmentedIndex.load"
            )
        raise IndexFormatError(missing_current(path) or f"{path}: not a GPUSparse index (no {MANIFEST})")
    manifest = parse_json(mpath.read_bytes(), mpath)
    if isinstance(manifest, dict) and manifest.get("format") == "gpusparse-sharded-index":
        raise IndexFormatError(
            f"{path}: a sharded index (gpusparse index --shards); Index.load reads it whole, "
            "gpusparse.shards.load_sharded shard by shard"
        )
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IndexFormatError(f"{mpath}: not a GPUSparse index manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise IndexFormatError(f"{mpath}: no format_version")
    if version > FORMAT_VERSION:
        raise IndexFormatError(
            f"{path}: index format {version} was written by a newer GPUSparse "
            f"({manifest.get('created_by', '?')}); "
            f"this version reads format {FORMAT_VERSION} at most: upgrade gpusparse"
        )
    for key in ("n_docs", "n_terms", "n_postings", "n_padded", "vocab_fingerprint", "files"):
        if key not in manifest:
            raise IndexFormatError(f"{mpath}: manifest lacks {key!r}")
    for key in ("n_docs", "n_terms", "n_postings", "n_padded"):
        check_count(manifest[key], mpath, key)
    if manifest.get("n_empty_docs") is not None:
        check_count(manifest["n_empty_docs"], mpath, "n_empty_docs")
    if not isinstance(manifest["vocab_fingerprint"], str):
        raise IndexFormatError(f"{mpath}: 'vocab_fingerprint' is not a string")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise IndexFormatError(
            f"{mpath}: 'files' is a {type(files).__name__}, expected an object of file name -> "
            '{"bytes": size, "sha256": checksum}'
        )
    for fname, meta in files.items():
        plain_name(fname, mpath, "'files' entry")
        if not (isinstance(meta, dict) and check_count(meta.get("bytes"), mpath, f"{fname}'s bytes") >= 0):
            raise IndexFormatError(f'{mpath}: the entry of {fname} is not {{"bytes": size, "sha256": checksum}}')
        if not isinstance(meta.get("sha256"), str):
            raise IndexFormatError(f'{mpath}: the entry of {fname} has no "sha256" string')
    for fname in ("ids.txt", "vocab.txt"):  # read whether listed or not: they must be checked
        if fname not in files:
            raise IndexFormatError(f"{mpath}: the manifest lists no {fname}")
    _quantization(manifest, path)
    check_seal(manifest, mpath)  # last: a readable but edited manifest says what is wrong first
    return manifest


def _quantization(manifest: dict[str, Any], path: Path) -> Quantization | None:
    if manifest.get("quantization") is None:
        return None
    try:
        return Quantization.from_dict(manifest["quantization"])
    except (KeyError, TypeError, ValueError) as exc:
        raise IndexFormatError(f"{path}: bad quantization in the manifest ({exc})") from None


SEAL = "manifest_sha256"


def _seal_digest(manifest: dict[str, Any]) -> str:
    # Canonical JSON (sorted keys, no spaces; floats by repr, which round-trips), so the
    # digest does not depend on how the file was indented.
    rest = {k: v for k, v in manifest.items() if k != SEAL}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its own checksum added under ``manifest_sha256``."""
    return {**manifest, SEAL: _seal_digest(manifest)}


def check_seal(manifest: dict[str, Any], mpath: Path) -> None:
    """Refuse a manifest that does not match its own checksum. One without a checksum was
    written before manifests carried one and is accepted as it is (as FAISS reads the files
    of older versions); rewriting the index (gpusparse index --overwrite, or compact) adds it."""
    if SEAL not in manifest:
        return
    if manifest[SEAL] != _seal_digest(manifest):
        raise IndexFormatError(
            f"{mpath}: the manifest does not match its own checksum ({SEAL}): it was edited or corrupted; "
            "rebuild the index (gpusparse index --overwrite) or restore the folder from a backup"
        )


def missing_current(path: Path) -> str | None:
    """The message for a segmented folder (gpusparse.segments) whose ``CURRENT`` file is gone,
    or None when ``path`` does not look like one."""
    manifests = sorted(p.name for p in path.glob("MANIFEST-*.json"))
    if not manifests and not (path / "segments").is_dir():
        return None
    hint = (
        f'; if {manifests[-1]} is the last commit: echo "{manifests[-1]} $(sha256sum < {path / manifests[-1]} '
        f"| cut -d' ' -f1)\" > {path / 'CURRENT'}"
        if manifests
        else ""
    )
    return (
        f"{path}: a segmented index (updated by gpusparse add/delete/compact) whose CURRENT file, which names "
        f"its live manifest, is missing: restore it from a backup{hint}"
    )


def parse_json(data: bytes, where: Path) -> Any:
    """A manifest's JSON, any parse failure (nesting too deep included) as IndexFormatError."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise IndexFormatError(f"{where}: unreadable manifest ({reason})") from None


def plain_name(name: object, where: Path, what: str) -> str:
    """``name`` if it is a plain file name, inside the folder of the manifest ``where``.

    A manifest names files that are read, hashed, linked and deleted; a name with a folder
    part (``../victim.txt``, ``/etc/passwd``, ``a/b``) could reach outside the index, so it
    is refused whatever its size and checksum say.
    """
    ok = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
        and not os.path.isabs(name)
    )
    if not ok:
        raise IndexFormatError(
            f"{where}: {what} {name!r} is not a plain file name inside the index folder "
            "(a damaged or crafted manifest); refusing to use it"
        )
    return name  # type: ignore[return-value]


def check_count(value: object, where: Path, what: str) -> int:
    """``value`` if it is a non-negative integer (not a bool), else IndexFormatError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise IndexFormatError(f"{where}: {what} is {value!r}, expected a non-negative integer")
    return value


def _write_array(f: Path, tensor: torch.Tensor, dtype: type) -> dict[str, Any]:
    return write_npy(f, tensor.detach().cpu().numpy().astype(dtype, copy=False))


def _describe(f: Path) -> dict[str, Any]:
    with f.open("rb+") as fh:
        os.fsync(fh.fileno())
    return {"bytes": f.stat().st_size, "sha256": _sha256(f)}


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with f.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _write_synced(f: Path, data: bytes) -> None:
    with f.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
