"""An index folder's ``.npy`` arrays written and read in one pass each, files in parallel.

Writing hashes the bytes as they go out (the SHA-256 needs no second read); reading maps
the file and hashes each slice of it as it goes to its destination: a GPU through two
page-locked buffers (no host copy of the array, so no fresh pages to fault in), or a host
copy. Files are read by a few threads (hashing, file I/O and copies release the GIL), so the
largest arrays are read, hashed and copied side by side. The files are plain ``np.save``
output, byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import IndexFormatError

CHUNK = 1 << 26  # bytes a slice: large enough for full-speed copies and hashing, small to stage
THREADS = 4  # files at a time; the largest arrays of an index are two or three files
# CPython 3.11's compile() (under ast.literal_eval) keeps its recursion depth per interpreter, not
# per thread: two threads parsing at once fail with "AST constructor recursion depth mismatch".
_HEADER_LOCK = threading.Lock()


class _HashingWriter:
    """A file-like object that hashes what it writes (``np.lib.format.write_array`` feeds it)."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.sha = fh, hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        self.sha.update(data)
        return self.fh.write(data)


def write_npy(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write ``array`` as ``np.save`` would, synced; its size and SHA-256 (read from what was written)."""
    with path.open("wb") as fh:
        out = _HashingWriter(fh)
        np.lib.format.write_array(out, np.ascontiguousarray(array), allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": path.stat().st_size, "sha256": out.sha.hexdigest()}


class FileJobError(Exception):
    """The failure of one file's writer: ``name`` is the file, ``error`` what it raised."""

    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(f"{name}: {error}")
        self.name, self.error = name, error


def write_all(jobs: Mapping[str, Callable[[], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Run each file's writer (name → callable returning its description), one after the other:
    writing is bound by the disk, and parallel writers measured slower on the GPU machine's disk
    (bench/NOTES.md).

    Raises:
        FileJobError: naming the first file (in ``jobs``' order) whose writer failed.
    """
    out = {}
    for name, job in jobs.items():
        try:
            out[name] = job()
        except Exception as exc:
            raise FileJobError(name, exc) from exc
    return out


def read_npy(
    path: Path,
    dtype: np.dtype | type,
    *,
    device: torch.device,
    mmap: bool,
    sha256: str | None,
) -> torch.Tensor:
    """A 1-D ``.npy`` array of ``dtype`` as a tensor on ``device``.

    ``sha256``: the digest the file must have (``None``: not checked). On the host with
    ``mmap`` the tensor maps the file (copy-on-write); otherwise the array is copied to
    ``device`` slice by slice, each slice hashed on the way.

    Raises:
        IndexFormatError: not a readable ``.npy``, another dtype or shape, or a checksum
            that does not match.
    """
    try:
        with _HEADER_LOCK:  # np.load parses the header with ast.literal_eval: not thread-safe on 3.11
            mapped = np.load(path, mmap_mode="c", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise IndexFormatError(f"{path.parent}: {path.name} is not a readable .npy array ({exc})") from None
    if mapped.dtype != dtype or mapped.ndim != 1:
        where, shape = f"{path.parent}: {path.name}", f"{mapped.dtype} and {mapped.ndim} dims"
        raise IndexFormatError(f"{where} has dtype {shape}, expected 1-D {np.dtype(dtype)}")
    sha = hashlib.sha256() if sha256 is not None else None
    if sha is not None:  # the header, then the data as it is copied
        with path.open("rb") as fh:
            sha.update(fh.read(mapped.offset))
    raw = mapped.view(np.uint8) if mapped.size else np.empty(0, np.uint8)
    if device.type == "cpu" and mmap:
        if sha is not None:
            for a in range(0, raw.size, CHUNK):
                sha.update(raw[a : a + CHUNK])
        out = torch.from_numpy(mapped)
    elif device.type == "cpu":
        copy = np.empty(mapped.shape, dtype=mapped.dtype)
        dst = copy.view(np.uint8) if copy.size else np.empty(0, np.uint8)
        for a in range(0, raw.size, CHUNK):
            piece = raw[a : a + CHUNK]
            if sha is not None:
                sha.update(piece)
            dst[a : a + piece.size] = piece
        out = torch.from_numpy(copy)
    else:
        out = _to_device(raw, mapped, device, sha)
    if sha is not None and sha.hexdigest() != sha256:
        raise IndexFormatError(f"{path.parent}: {path.name} does not match its checksum (corrupted)")
    return out


def read_all(jobs: Mapping[str, Callable[[], torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Run each file's reader (name → callable returning its tensor) a few at a time."""
    return _parallel(jobs)


def _to_device(raw: np.ndarray, mapped: np.ndarray, device: torch.device, sha: Any) -> torch.Tensor:
    """``mapped``'s bytes (``raw``) to ``device`` through two page-locked buffers on a side stream."""
    out = torch.empty(mapped.size, dtype=torch.from_numpy(mapped[:0]).dtype, device=device)
    dst = out.view(torch.uint8)
    if raw.size == 0:
        return out
    stream = torch.cuda.Stream(device)
    size = min(CHUNK, raw.size)
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done: list[torch.cuda.Event | None] = [None, None]
    for i, a in enumerate(range(0, raw.size, CHUNK)):
        piece = raw[a : a + CHUNK]
        if sha is not None:
            sha.update(piece)
        slot = i % 2
        if done[slot] is not None:
            done[slot].synchronize()  # this buffer's last copy has left it
        staged = buffers[slot][: piece.size]
        staged.numpy()[:] = piece
        with torch.cuda.stream(stream):
            dst[a : a + piece.size].copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        done[slot] = event
    stream.synchronize()
    torch.cuda.current_stream(device).wait_stream(stream)
    return out


def _parallel(jobs: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    if len(jobs) <= 1:
        return {name: job() for name, job in jobs.items()}
    with ThreadPoolExecutor(max_workers=min(THREADS, len(jobs)), thread_name_prefix="gpusparse-files") as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}  # the first failure, in file order
