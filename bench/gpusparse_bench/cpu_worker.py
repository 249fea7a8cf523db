"""The CPU engines in a process of their own, on cores the GPU process does not use.

The GPU run (:mod:`gpusparse_bench.runner`) saves a collection, its queries, the exact
reference and the batches' floors into a folder (:mod:`.cpu_job`), starts ``python -m
gpusparse_bench.cpu_worker FOLDER`` pinned to the cores it leaves free, and merges
``FOLDER/records.json`` into its result file at the end. The engines thus run on the same
data in the same run, while the GPU systems are timed, without taking their cores.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from .cpu_engines import cpu_engines, cpu_threads
from .cpu_job import load_job
from .runner import RunConfig, _measure, finish_floor
from .systems import SystemUnavailable, Workload


def main(folder: Path) -> None:
    """Run every CPU engine the job names, saving the records after each measurement."""
    meta, forward, queries, ref = load_job(folder)
    n_terms = int(meta["n_terms"])
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
