"""The CPU engines in a process of their own, on cores the GPU process does not use.

The GPU run (:mod:`gpusparse.bench.runner`) saves a collection, its queries, the exact
reference and the batches' floors into a folder, starts ``python -m
gpusparse.bench.cpu_worker FOLDER`` pinned to the cores it leaves free, and merges
``FOLDER/records.json`` into its result file at the end. The engines thus run on the same
data in the same run, while the GPU systems are timed, without taking their cores.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..collection import SparseCollection
from ..search import SearchResults
from ..vocab import Vocabulary
from .systems import SystemUnavailable, Workload


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


def main(folder: Path) -> None:
    from .cpu_engines import cpu_engines, cpu_threads
    from .runner import RunConfig, _measure, finish_floor

    meta = json.loads((folder / "meta.json").read_text())
    z = np.load(folder / "job.npz")
    forward = (torch.from_numpy(z["indptr"]), torch.from_numpy(z["terms"]), torch.from_numpy(z["weights"]))
    n_terms = int(meta["n_terms"])
    vocab = Vocabulary.bert() if n_terms == 30522 else Vocabulary.integer(n_terms)
    queries = SparseCollection(z["q_indptr"], z["q_terms"], z["q_weights"], vocab=vocab)
    ref = SearchResults(torch.from_numpy(z["ref_scores"]), torch.from_numpy(z["ref_ids"]))
    cfg = RunConfig(device="cpu", ks=meta["ks"], cpu_batches=meta["cpu_batches"], cpu_time_cap_s=meta["cap_s"])
    w = Workload(None, forward, n_terms_hint=n_terms)
    records = []
    threads = cpu_threads()
    names = meta.get("systems")
    for system in cpu_engines(threads):
        if names is not None and system.name not in names:
            continue
        base = dict(meta["base"]) | {"system": system.name, "family": "cpu", "cpu_threads": threads}
        try:
            system.prepare(w)
        except SystemUnavailable as e:
            records.append(base | {"status": "skipped", "reason": str(e)})
            _save(folder, records)
            continue
        except Exception as e:
            records.append(base | {"status": "error", "reason": f"prepare: {type(e).__name__}: {e}"})
            _save(folder, records)
            system.close()
            continue
        base |= {"description": system.description, "prepare_s": system.prepare_s, "extra_bytes": 0}
        for b in cfg.cpu_batches:
            for k in cfg.ks:
                rec = base | {"batch_size": b, "k": k} | meta["floors"][str(b)]
                rec |= _measure(system, queries[:b], k, ref, meta["n_exact"], torch.device("cpu"), cfg, True)
                finish_floor(rec)
                records.append(rec)
                _save(folder, records)
                print(f"{system.name} B={b} k={k}: {rec.get('ms_per_batch')} ms {rec.get('status')}", flush=True)
        system.close()
    _save(folder, records, done=True)


def _save(folder: Path, records: list[dict], done: bool = False) -> None:
    tmp = folder / "records.tmp"
    tmp.write_text(json.dumps({"done": done, "records": records, "time": time.time()}))
    tmp.replace(folder / "records.json")


if __name__ == "__main__":  # pragma: no cover
    main(Path(sys.argv[1]))
