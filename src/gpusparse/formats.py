"""Readers and writers for the formats users already have.

Sparse vectors:
    * Anserini/Pyserini JsonVectorCollection JSONL: ``{"id", "contents", "vector": {token: w}}``;
    * Seismic JSONL: ``{"id", "content", "vector"}`` (read by the same reader);
    * Seismic binary: u32 count, then per vector u32 length, int32 term ids, float32 weights
      (little-endian; vectors get ids ``"0"``, ``"1"``, ... in file order);
    * GPUSparse ``.npz``: CSR arrays, ids and tokens (:mod:`gpusparse.vectors_npz`).

(the two binary formats are read by :mod:`gpusparse.vectors_binary`; every reader appends to
one :class:`~gpusparse.vector_builder.VectorBuilder`)

Runs and judgments (TREC runs, TREC or BEIR qrels) are :mod:`gpusparse.trec`'s.

Files ending in ``.gz`` are (de)compressed transparently. Readers stream: a JSONL file is
parsed a chunk of lines at a time (:mod:`gpusparse.jsonl_chunks`; in parallel processes
when there are cores), binary files are mapped, straight into growing arrays; a file is
never held in memory as text. Every problem raises :class:`~gpusparse.errors.InputError` naming
the file, the line (or record) and the field.
"""

from __future__ import annotations

import ctypes
import gzip
import itertools
import json
import multiprocessing as mp
import os
import sys
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from tqdm.auto import tqdm

from .collection import SparseCollection
from .errors import InputError
from .jsonl_chunks import (
    VECTOR_RECORD_KEYS,
    ChunkResult,
    TokenIds,
    decode_json_line,
    parse_chunk,
    record_dict,
)
from .vector_builder import ReadStats, VectorBuilder
from .vectors_binary import read_npz_into, read_seismic_bin_into
from .vocab import Vocabulary

Unknown = Literal["error", "skip"]
__all__ = ["VECTOR_RECORD_KEYS", "ReadStats", "decode_json_line", "expand_vector_paths", "read_vectors", "record_dict"]
VECTOR_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".bin", ".npz")


# -- opening files ------------------------------------------------------------------------


@contextmanager
def _open_binary(path: Path, progress: bool, unit_desc: str) -> Iterator[tuple[IO[bytes], tqdm]]:
    try:
        raw = path.open("rb")
    except OSError as exc:
        raise InputError(f"cannot open: {exc.strerror}", path=path) from None
    size = os.fstat(raw.fileno()).st_size
    if size == 0 and path.name.endswith(".gz"):
        # GzipFile reads a 0-byte file as empty data: say what it is instead of reading nothing.
        raw.close()
        raise InputError("empty file (0 bytes), not gzip data", path=path)
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=unit_desc, disable=not progress or None, leave=False)
    try:
        if path.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                yield gz, _RawProgress(raw, bar)
        else:
            yield raw, _RawProgress(raw, bar)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"truncated or corrupt gzip data ({exc})", path=path) from None
    finally:
        bar.close()
        raw.close()


class _RawProgress:
    """Progress in bytes of the underlying (compressed) file, updated cheaply."""

    def __init__(self, raw: IO[bytes], bar: tqdm) -> None:
        self.raw, self.bar = raw, bar

    def update(self) -> None:
        self.bar.update(self.raw.tell() - self.bar.n)


# -- JSONL vectors ------------------------------------------------------------------------

_CHUNK_BYTES = 4 << 20  # a chunk of lines parsed at once (a task of the parallel reader)


def available_cores() -> int:
    """CPU cores this process may run on (the readers' default number of workers)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Commit:
    """Appends chunk results to the builder in file order, with absolute line numbers."""

    def __init__(self, path: str, b: VectorBuilder, stats: ReadStats) -> None:
        self.path, self.b, self.stats, self.base = path, b, stats, 0

    def __call__(self, res: ChunkResult) -> None:
        b, path, base = self.b, self.path, self.base + 1
        n, first = len(res.ids), len(b.ids)
        if n:
            if len(set(res.ids)) == n and b.seen.keys().isdisjoint(res.ids):
                b.seen.update(zip(res.ids, range(first, first + n), strict=True))
                b.ids.extend(res.ids)
                b.rec_file.extend([path] * n)
                b.rec_line.frombytes((res.lines + base).tobytes())
                b.rec_binary.frombytes(bytes(n))
            else:  # a repeated id: add one by one for the strict path's error
                for doc_id, ln in zip(res.ids, res.lines.tolist(), strict=True):
                    b.add_id(doc_id, path, base + ln)
            b.indptr.frombytes((b.indptr[-1] + np.cumsum(res.lengths)).tobytes())
            b.add_postings(first, res.terms, res.weights, res.bad_weights)
        self.stats.unknown_tokens_skipped += res.unknown_skipped
        self.stats.chunks_by_parser[res.parser] = self.stats.chunks_by_parser.get(res.parser, 0) + 1
        if res.error is not None:
            reason, ln, fld = res.error
            raise InputError(reason, path=path, line=base + ln, field=fld)
        self.base += res.newlines


# Set in each worker process by _init_worker: the token ids and the unknown mode.
_WORKER: dict[str, Any] = {}


def _init_worker(ids_of: TokenIds, unknown: Unknown) -> None:
    _WORKER.update(ids_of=ids_of, unknown=unknown)
    _keep_freed_memory()


def _keep_freed_memory() -> None:
    """In a worker process (ours alone): have glibc keep the memory it frees for reuse.

    By default glibc maps each large array afresh and gives freed heap back to the system,
    so every chunk's numpy temporaries (tens of MB) fault their pages in again: a third of
    a worker's CPU time on the dev box (system time). Arrays up to 32 MiB then come from the
    heap, and up to 256 MiB of freed heap is kept. Nothing where glibc is not the C library.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (its maximum on 64-bit glibc)
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _parse_bytes(data: bytes) -> ChunkResult:
    return parse_chunk(data, _WORKER["ids_of"], _WORKER["unknown"])


def _parse_range(path: str, start: int, end: int) -> ChunkResult:
    with open(path, "rb") as f:
        f.seek(start)
        return parse_chunk(f.read(end - start), _WORKER["ids_of"], _WORKER["unknown"])


def _line_ranges(path: Path, size: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``_CHUNK_BYTES`` each, split just after a newline."""
    bounds = [0]
    with path.open("rb") as f:
        while bounds[-1] < size:
            pos = bounds[-1] + _CHUNK_BYTES
            if pos >= size:
                bounds.append(size)
                break
            f.seek(pos)
            rest = f.readline()  # to the end of the line holding pos
            bounds.append(min(size, pos + len(rest)))
    return list(itertools.pairwise(bounds))


def _plain_chunks(f: IO[bytes], prog: _RawProgress) -> Iterator[bytes]:
    """Whole lines of an uncompressed file, about ``_CHUNK_BYTES`` at a time (one read each,
    not a line at a time)."""
    while data := f.read(_CHUNK_BYTES):
        if not data.endswith(b"\n"):
            data += f.readline()
        yield data
        prog.update()


def _gz_chunks(f: IO[bytes], spath: str, prog: _RawProgress, lines_done: list[int]) -> Iterator[bytes]:
    """Whole lines of a decompressing stream, about ``_CHUNK_BYTES`` at a time; a gzip error
    becomes an :class:`InputError` naming the line it was reached on, after the lines before it."""
    buf: list[bytes] = []
    size = lines = 0
    try:
        for line in f:
            buf.append(line)
            size += len(line)
            if size >= _CHUNK_BYTES:
                yield b"".join(buf)
                lines_done[0] += len(buf)
                buf, size = [], 0
                prog.update()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        if buf:
            yield b"".join(buf)
            lines_done[0] += len(buf)
        lines = lines_done[0]
        raise InputError(f"truncated or corrupt gzip data ({exc})", path=spath, line=lines + 1) from None
    if buf:
        yield b"".join(buf)


def _read_jsonl_into(
    path: Path, b: VectorBuilder, ids_of: TokenIds, unknown: Unknown, stats: ReadStats, progress: bool, pool: Any
) -> None:
    spath = str(path)
    commit = _Commit(spath, b, stats)
    with _open_binary(path, progress, path.name) as (f, prog):
        if not path.name.endswith(".gz") and pool is not None:
            ranges = _line_ranges(path, path.stat().st_size)
            for (lo, hi), res in zip(ranges, _in_order(pool, _parse_range, [(spath, *r) for r in ranges]), strict=True):
                commit(res)
                prog.bar.update(hi - lo)
        else:
            chunks = _gz_chunks(f, spath, prog, [0]) if path.name.endswith(".gz") else _plain_chunks(f, prog)
            if pool is None:
                for data in chunks:
                    commit(parse_chunk(data, ids_of, unknown))
            else:
                for res in _in_order(pool, _parse_bytes, ((data,) for data in chunks)):
                    commit(res)
        prog.update()


def _in_order(pool: Any, fn: Any, args: Iterable[tuple[Any, ...]]) -> Iterator[ChunkResult]:
    """Results of ``fn(*a)`` for ``a`` in ``args``, in order, with a bounded number in flight."""
    pending: deque[Any] = deque()
    limit = 2 * pool._max_workers
    for a in args:
        pending.append(pool.submit(fn, *a))
        if len(pending) >= limit:
            yield _result(pending.popleft())
    while pending:
        yield _result(pending.popleft())


def _result(fut: Any) -> ChunkResult:
    res: ChunkResult = fut.result()
    return res


def _start_method() -> str:
    """How worker processes start: ``fork`` (cheap: they share the vocabulary) unless CUDA is
    initialised in this process, where a forked child would inherit a CUDA context it cannot
    use; then ``forkserver`` (or ``spawn``), whose server (workers) import the package afresh.
    The forkserver process then lives as long as this one, as multiprocessing's always does."""
    methods = mp.get_all_start_methods()
    torch = sys.modules.get("torch")  # never imported here: only asked if already loaded
    cuda_live = torch is not None and bool(torch.cuda.is_initialized())
    if "fork" in methods and not cuda_live:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


@contextmanager
def _worker_pool(workers: int, files: list[Path], ids_of: TokenIds, unknown: Unknown) -> Iterator[Any]:
    """A process pool when there are workers and data enough for more than one chunk."""
    total = sum(p.stat().st_size for p in files if not p.name.endswith(".bin"))
    if workers <= 1 or total <= _CHUNK_BYTES:
        yield None
        return
    method = _start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":  # the server imports the package once; its children inherit it
        ctx.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(ids_of, unknown)) as pool:
        try:
            yield pool
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def read_vectors(
    paths: str | Path | Sequence[str | Path],
    vocab: Vocabulary | None = None,
    *,
    unknown: Unknown = "error",
    progress: bool = True,
    stats: ReadStats | None = None,
    workers: int | None = None,
) -> SparseCollection:
    """Read sparse vectors from JSONL(.gz), Seismic ``.bin`` and GPUSparse ``.npz`` files, or folders of them.

    Args:
        paths: one path or several; a folder stands for the vector files inside it
            (``*.jsonl``, ``*.jsonl.gz``, ``*.json``, ``*.json.gz``, ``*.bin``, ``*.npz``), in name order.
        vocab: the vocabulary tokens are looked up in (default: BERT WordPiece).
        unknown: ``"error"`` (default) refuses a token missing from ``vocab``; ``"skip"``
            drops it and counts it in ``stats.unknown_tokens_skipped``.
        progress: show a progress bar on a terminal.
        stats: filled with counts (records, empty vectors, skipped tokens ...).
        workers: processes parsing JSONL in parallel, over chunks of lines of each file
            (default: the cores this process may use; 1 reads in this process). The
            collection and any error are the same whatever the number.

    Returns:
        One collection with the vectors of all files in order. Ids must be unique across
        all files, non-empty, printable and without whitespace (see
        :func:`~gpusparse.collection.id_problem`). Input without any vector is an error.
    """
    if unknown not in ("error", "skip"):
        raise ValueError(f"unknown must be 'error' or 'skip', not {unknown!r}")
    vocab = Vocabulary.bert() if vocab is None else vocab
    stats = ReadStats() if stats is None else stats
    files = expand_vector_paths(paths)
    workers = available_cores() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be ≥ 1, not {workers}")
    b = VectorBuilder()
    ids_of = TokenIds(vocab)
    with _worker_pool(workers, files, ids_of, unknown) as pool:
        for path in files:
            stats.files.append(str(path))
            if path.name.endswith(".bin"):
                read_seismic_bin_into(path, b, vocab, progress)
            elif path.name.endswith(".npz"):
                read_npz_into(path, b, vocab, unknown, stats)
            else:
                _read_jsonl_into(path, b, ids_of, unknown, stats, progress, pool)
    if not b.ids:
        # An empty input is a mistake (a failed export, the wrong file): a 0-document index
        # or an empty run would hide it.
        where = paths if isinstance(paths, str | Path) else paths[0] if len(paths) == 1 else None
        what = "the file" if len(files) == 1 else f"any of its {len(files)} files"
        raise InputError(f"empty collection: no vectors in {what} (empty or only blank lines)", path=where)
    return b.finish(vocab, stats)


def expand_vector_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Files named by ``paths``, folders expanded to the vector files inside them."""
    if isinstance(paths, str | Path):
        paths = [paths]
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            _refuse_other_folders(p)
            found = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(VECTOR_SUFFIXES))
            if not found:
                raise InputError(f"no vector files ({', '.join(VECTOR_SUFFIXES)}) in this folder", path=p)
            out.extend(found)
        elif p.is_file():
            if not p.name.endswith(VECTOR_SUFFIXES):
                raise InputError(f"unknown file type: expected one of {', '.join(VECTOR_SUFFIXES)}", path=p)
            out.append(p)
        else:
            raise InputError("no such file or folder", path=p)
    if not out:
        raise InputError("no input files given")
    return out


def _refuse_other_folders(folder: Path) -> None:
    """Refuse folders that hold something other than vectors, which their ``.json``/``.jsonl``
    files would otherwise be mistaken for (an index's ``manifest.json``: "malformed JSON")."""
    manifest = folder / "manifest.json"
    if manifest.is_file():
        try:
            fmt = json.loads(manifest.read_bytes()).get("format", "")
        except (OSError, ValueError, RecursionError, AttributeError):
            fmt = ""
        if isinstance(fmt, str) and fmt.startswith("gpusparse-"):
            raise InputError("this is a GPUSparse index folder, not vectors (JSONL or .bin files)", path=folder)
    names = {q.name for q in folder.iterdir()}
    corpus = {"corpus.jsonl", "corpus.jsonl.gz", "corpus.npz", "corpus.bin"}
    if names & corpus and names & {"queries.jsonl", "queries.jsonl.gz"}:
        raise InputError(
            "this folder holds both a corpus and queries (a BEIR or encoded folder): name the file to read",
            path=folder,
        )
