"""Calibrated synthetic documents written as JsonVectorCollection JSONL with BERT tokens.

``write_shards`` generates ``n_docs`` documents with :func:`gpusparse.synthetic.generate`
(MS MARCO-calibrated: ~120 postings a document) and writes them as ``shards`` files
``part-00000.jsonl`` ... (ids ``"0"``, ``"1"``, ... in order), formatting in parallel
processes, a chunk of documents at a time. Weights are written as the shortest decimal of
their float32 value (orjson), so reading the files back gives the generated arrays exactly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import orjson
import torch

from gpusparse.synthetic import generate
from gpusparse.vocab import Vocabulary

_CHUNK_DOCS = 20_000
# Filled before the pool forks, shared copy-on-write by the workers.
_SHARED: dict[str, object] = {}


def _key_bytes() -> list[bytes]:
    return [orjson.dumps(t) + b":" for t in Vocabulary.bert().tokens()]


def _format_docs(lo: int, hi: int) -> bytes:
    """JSONL lines of documents ``lo`` to ``hi`` (from the shared arrays)."""
    indptr, terms, weights = (_SHARED[k] for k in ("indptr", "terms", "weights"))
    keys = _SHARED["keys"]
    a, b = int(indptr[lo]), int(indptr[hi])
    wtext = orjson.dumps(weights[a:b], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",") if b > a else []
    pairs = list(map(bytes.__add__, [keys[t] for t in terms[a:b].tolist()], wtext))
    out = []
    bounds = (indptr[lo : hi + 1] - a).tolist()
    for i in range(hi - lo):
        body = b",".join(pairs[bounds[i] : bounds[i + 1]])
        out.append(b'{"id":"%d","contents":"","vector":{%s}}\n' % (lo + i, body))
    return b"".join(out)


def _write_shard(path: str, lo: int, hi: int) -> int:
    with open(path, "wb") as f:
        for start in range(lo, hi, _CHUNK_DOCS):
            f.write(_format_docs(start, min(hi, start + _CHUNK_DOCS)))
    return os.path.getsize(path)


def write_shards(
    n_docs: int, out_dir: str | Path, *, shards: int = 1, seed: int = 0, device: str = "cpu", workers: int | None = None
) -> list[Path]:
    """Generate ``n_docs`` calibrated documents and write them as ``shards`` JSONL files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (indptr, terms, weights), _ = generate(n_docs, 1, seed=seed, device=torch.device(device))
    _SHARED.update(
        indptr=indptr.cpu().numpy(),
        terms=terms.cpu().numpy(),
        weights=weights.cpu().numpy().astype(np.float32),
        keys=_key_bytes(),
    )
    del indptr, terms, weights
    bounds = np.linspace(0, n_docs, shards + 1).astype(np.int64).tolist()
    paths = [out_dir / f"part-{i:05d}.jsonl" for i in range(shards)]
    workers = workers or os.cpu_count() or 1
    try:
        if workers == 1 or shards == 1:
            for p, lo, hi in zip(paths, bounds, bounds[1:], strict=False):
                _write_shard(str(p), lo, hi)
        else:
            with ProcessPoolExecutor(min(workers, shards), mp_context=mp.get_context("fork")) as pool:
                list(pool.map(_write_shard, map(str, paths), bounds, bounds[1:]))
    finally:
        _SHARED.clear()
    return paths
