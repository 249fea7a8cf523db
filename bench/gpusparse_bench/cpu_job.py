"""The folder a GPU run hands to a CPU-engines worker: what :mod:`.runner` writes and :mod:`.cpu_worker` reads.

``job.npz`` holds the collection's forward (document-major) arrays, the queries and the
exact reference; ``meta.json`` the run's settings (``n_terms``, ``ks``, ``cpu_batches``,
``cap_s``, ``systems``, ``floors``, ``base``, ``n_exact``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from gpusparse.collection import SparseCollection
from gpusparse.search import SearchResults
from gpusparse.vocab import Vocabulary


def save_job(folder: Path, forward: tuple, queries: SparseCollection, ref: SearchResults, meta: dict) -> None:
    """Write what the worker needs (host arrays, the reference, the run's settings)."""
    folder.mkdir(parents=True, exist_ok=True)
    indptr, terms, weights = (t.cpu().numpy() for t in forward)
    np.savez(
        folder / "job.npz",
        indptr=indptr,
        terms=terms,
        weights=weights,
        q_indptr=queries.indptr,
        q_terms=queries.indices,
        q_weights=queries.values,
        ref_scores=ref.scores.numpy(),
        ref_ids=ref.ids.numpy(),
    )
    (folder / "meta.json").write_text(json.dumps(meta))


def load_job(folder: Path) -> tuple[dict, tuple[torch.Tensor, ...], SparseCollection, SearchResults]:
    """``(meta, forward arrays, queries, reference)`` as :func:`save_job` wrote them."""
    meta = json.loads((folder / "meta.json").read_text())
    z = np.load(folder / "job.npz")
    forward = (torch.from_numpy(z["indptr"]), torch.from_numpy(z["terms"]), torch.from_numpy(z["weights"]))
    n_terms = int(meta["n_terms"])
    vocab = Vocabulary.bert() if n_terms == 30522 else Vocabulary.integer(n_terms)
    queries = SparseCollection(z["q_indptr"], z["q_terms"], z["q_weights"], vocab=vocab)
    ref = SearchResults(torch.from_numpy(z["ref_scores"]), torch.from_numpy(z["ref_ids"]))
    return meta, forward, queries, ref
