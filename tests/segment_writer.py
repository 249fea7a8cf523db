"""A writer process for the segmented-index crash and concurrency tests.

Documents are generated from their ids (so a test can rebuild any state), and every
operation is logged as one JSON line before it starts (``begin``) and after it commits
(``commit``), flushed at once, so a test that kills the process knows what was committed.
"""

from __future__ import annotations

import json
import zlib

import numpy as np

from gpusparse import SparseCollection, Vocabulary
from gpusparse.segments import SegmentedIndex

VOCAB = Vocabulary.integer(48)


def docs_for(ids: list[str]) -> SparseCollection:
    """Vectors determined by their ids: small integer-valued weights, so scores tie often."""
    indptr, indices, values = [0], [], []
    for i in ids:
        rng = np.random.default_rng(zlib.crc32(i.encode()))
        terms = np.sort(rng.choice(len(VOCAB), size=int(rng.integers(0, 7)), replace=False))
        indices += terms.tolist()
        values += (rng.integers(1, 5, size=terms.size) / 4).tolist()
        indptr.append(len(indices))
    return SparseCollection(
        np.array(indptr, np.int64), np.array(indices, np.int32), np.array(values, np.float32), ids, VOCAB
    )


def _log(fh, record: dict) -> None:
    fh.write(json.dumps(record) + "\n")
    fh.flush()


def run_writer(path: str, log_path: str, seed: int, prefix: str, n_ops: int) -> None:
    """Random add / delete / compact operations on the index at ``path``, logged."""
    rng = np.random.default_rng(seed)
    index = SegmentedIndex.load(path)
    with open(log_path, "a", encoding="utf-8") as log:
        for op in range(n_ops):
            r = rng.random()
            if r < 0.6:
                ids = [f"{prefix}-{op}-{j}" for j in range(int(rng.integers(1, 5)))]
                _log(log, {"begin": "add", "ids": ids})
                index.add(docs_for(ids))
            elif r < 0.9:
                live = index.refresh().ids
                ids = [] if not live else rng.choice(live, size=min(len(live), 3), replace=False).tolist()
                _log(log, {"begin": "delete", "ids": ids})
                index.delete(ids)
            else:
                _log(log, {"begin": "compact"})
                index.compact()
            _log(log, {"commit": index.generation})


def run_batches(path: str, prefix: str, n_ops: int, batch: int) -> None:
    """Adds whole batches of ``batch`` documents, deletes whole batches and compacts now and then."""
    index = SegmentedIndex.load(path)
    for op in range(n_ops):
        if op % 4 == 3:
            index.delete([f"{prefix}{op - 2}-{j}" for j in range(batch)])
        elif op % 7 == 6:
            index.compact()
        else:
            index.add(docs_for([f"{prefix}{op}-{j}" for j in range(batch)]))
