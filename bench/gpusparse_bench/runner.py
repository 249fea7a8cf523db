"""The benchmark run: collections, the exact reference, every system timed and checked, one file.

Protocol (``benchmarks.md``): every system runs on the same queries of the same collection
in the same run; latency is the median of up to ``reps`` timed calls after warm-up (CUDA
events on a GPU, fewer calls for slow systems under a time cap, the count recorded); peak
memory is ``torch.cuda.max_memory_allocated`` over a system's calls (the resident index
included); each result's top-k is compared with the exact reference of the independent
verifier (:func:`independent_reference`: float64 scipy products on the host, sharing no code
with the search), computed once per collection for the first ``exact_sample`` queries at the
largest k and sliced, since the exact top-k of a query does not depend on its batch and
top-10 is a prefix of top-1000.
The card's copy bandwidth (DRAM) and an on-chip copy rate (a buffer that fits in L2) are
measured in the same run and give each batch's floor.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fnmatch
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

import gpusparse
from gpusparse.collection import SparseCollection
from gpusparse.index import Index
from gpusparse.search import SearchResults
from gpusparse.synthetic import MSMARCO_TARGETS, SyntheticSpec, format_stats, generate, synthetic_stats
from gpusparse.verify import exact_topk
from gpusparse.vocab import Vocabulary

from .cpu_engines import cpu_engines
from .cpu_job import save_job
from .report import short_table
from .systems import System, SystemUnavailable, Workload, gpu_systems

POSTING_BYTES = 8  # the paper's layout: int32 doc id + float32 weight


@dataclass
class RunConfig:
    sizes: list[int] = field(default_factory=lambda: [100_000, 1_000_000, 8_841_823])
    batches: list[int] = field(default_factory=lambda: [1, 32, 256, 1024])
    ks: list[int] = field(default_factory=lambda: [10, 1000])
    big_batch_max_docs: int = 1_000_000  # batches above 256 only up to this size
    device: str = "cuda"
    reps: int = 10
    warmup: int = 1
    time_cap_s: float = 2.0
    memory_budget: int = 4 << 30
    dense_max_bytes: int = 16 << 30
    exact_sample: int = 256  # queries checked against the reference (the first ones of each batch)
    seed: int = 0
    systems: list[str] | None = None  # fnmatch patterns of system names to run (default all)
    skip_systems: list[str] = field(default_factory=list)
    cpu_engines: bool = True
    cpu_max_docs: int = 1_000_000
    cpu_batches: list[int] = field(default_factory=lambda: [1, 32])
    cpu_time_cap_s: float = 20.0
    # On a GPU run, the CPU engines run in a worker process on the cores the GPU process
    # leaves free (it keeps ``gpu_cores``), concurrently with the GPU systems.
    cpu_parallel: bool = True
    gpu_cores: int = 4
    stat_queries: int = 64
    deadline_s: float | None = None
    out: Path = Path("bench/results")
    name: str = "bench"
    commit: str | None = None
    command: str = ""
    spec: SyntheticSpec = field(default_factory=SyntheticSpec)


# -- environment and ceilings ---------------------------------------------------------------


def environment(cfg: RunConfig) -> dict:
    import importlib.metadata as md

    env: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "git_commit": cfg.commit or _git_commit(),
        "command": cfg.command,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpu_threads": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "device": cfg.device,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    for pkg in ("pyseismic-lsr", "bmp", "pyterrier-pisa", "cupy-cuda13x", "cupy-cuda12x"):
        with contextlib.suppress(md.PackageNotFoundError):
            env[f"pkg_{pkg}"] = md.version(pkg)
    if cfg.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env |= {
            "card": torch.cuda.get_device_name(0),
            "multiprocessors": props.multi_processor_count,
            "memory_bytes": props.total_memory,
            "cuda": torch.version.cuda,
            "driver": _nvidia_smi("driver_version"),
        }
    else:
        env |= {"card": "cpu", "cuda": None, "driver": None}
    return env


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _nvidia_smi(field_name: str) -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field_name}", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"
    except OSError:
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def copy_rate(device: torch.device, n_bytes: int, reps: int, inner: int = 1) -> float:
    """Device-to-device copy rate in bytes/s (bytes read plus bytes written), median of ``reps``.

    Each timed call makes ``inner`` back-to-back copies, so that a small buffer (one that
    stays in L2) is not timed by its launch overhead: a single 16 MB copy on an H200 was
    launch-bound (2.36 TB/s, under the DRAM rate; run of 2026-11-26).
    """
    n = max(1, n_bytes // 4)
    x = torch.rand(n, device=device)
    y = torch.empty_like(x)

    def copies() -> None:
        for _ in range(inner):
            y.copy_(x)

    times = time_call(copies, device, reps=reps, warmup=3, cap_s=5.0)[0]
    return 2 * n * 4 * inner / (statistics.median(times) / 1e3)


# -- timing -------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Milliseconds of one call (CUDA events on a GPU, the host clock elsewhere) and its result."""
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # the stream looked up before the timed span: record()'s own look-up would be timed (a few µs)
        stream = torch.cuda.current_stream(device)
        e0.record(stream)
        out = fn()
        e1.record(stream)
        e1.synchronize()
        return e0.elapsed_time(e1), out
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def time_call(
    fn: Callable[[], object], device: torch.device, *, reps: int, warmup: int, cap_s: float
) -> tuple[list[float], object]:
    """Milliseconds per call (CUDA events on a GPU, the host clock elsewhere) and the last result.

    After ``warmup`` calls, up to ``reps`` timed calls; once ``cap_s`` seconds have passed,
    stops after 3 calls (1 if a call takes more than a third of the cap).
    """
    out = None
    for _ in range(warmup):
        out = fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps:
        ms, out = time_once(fn, device)
        times.append(ms)
        if time.perf_counter() - start > cap_s:
            enough = 1 if statistics.median(times) > cap_s * 1e3 / 3 else 3
            if len(times) >= enough:
                break
    return times, out


# -- exactness ----------------------------------------------------------------------------


def independent_reference(
    docs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n_terms: int, queries: SparseCollection, k: int
) -> SearchResults:
    """The exact top-``k`` of ``queries`` by :func:`gpusparse.verify.exact_topk`: float64 scipy
    products of the generator's CSR on the host, ranked by float32 score then document
    number, sharing no code with the search (no index, engine, kernel or top-k of ours).
    ``(scores, ids)`` as :meth:`Index.search` gives them: float32 canonical scores, -1/0 padded."""
    indptr, terms, weights = (t.cpu().numpy() for t in docs)
    matrix = sp.csr_matrix((weights, terms, indptr), shape=(len(indptr) - 1, n_terms))
    top, _ = exact_topk(matrix, queries, k)
    return SearchResults(torch.from_numpy(top.scores.astype(np.float32)), torch.from_numpy(top.ids))


def compare(
    scores: torch.Tensor, ids: torch.Tensor, ref_scores: torch.Tensor, ref_ids: torch.Tensor, *, with_scores: bool
) -> dict[str, object]:
    """``exact`` (ids identical, non-matches as -1), ``recall_vs_exact``, ``max_score_diff``."""
    ids = torch.where(scores > 0, ids, torch.full_like(ids, -1))
    exact = bool(torch.equal(ids, ref_ids))
    hits = total = 0
    for a, e in zip(ids.tolist(), ref_ids.tolist(), strict=True):
        e_set = {d for d in e if d >= 0}
        hits += len(e_set & {d for d in a if d >= 0})
        total += len(e_set)
    valid = ref_ids >= 0
    diff = None
    if with_scores and bool(valid.any()):
        diff = float((scores.to(torch.float64) - ref_scores.to(torch.float64)).abs()[valid].max())
    return {"exact": exact, "recall_vs_exact": hits / total if total else 1.0, "max_score_diff": diff}


# -- the run ------------------------------------------------------------------------------


class ResultFile:
    """The result JSON, rewritten after every record so an interrupted run keeps what it measured."""

    def __init__(self, path: Path, env: dict, cfg: RunConfig) -> None:
        self.path = path
        self.data: dict = {
            "env": env,
            "config": _config_dict(cfg),
            "targets": MSMARCO_TARGETS,
            "collections": [],
            "results": [],
        }

    def add(self, record: dict) -> None:
        self.data["results"].append(record)
        self.flush()

    def flush(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        tmp.replace(self.path)


def _json_default(x: object) -> object:
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, np.integer | np.floating):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _config_dict(cfg: RunConfig) -> dict:
    d = asdict(cfg)
    d["out"] = str(cfg.out)
    return d


def result_path(cfg: RunConfig, env: dict) -> Path:
    card = str(env.get("card", "cpu")).replace("NVIDIA ", "").replace(" ", "-")
    return cfg.out / f"{dt.date.today().isoformat()}-{card}-{cfg.name}.json"


def selected(cfg: RunConfig, name: str) -> bool:
    if any(fnmatch.fnmatch(name, p) for p in cfg.skip_systems):
        return False
    return cfg.systems is None or any(fnmatch.fnmatch(name, p) for p in cfg.systems)


def run(cfg: RunConfig, *, log: Callable[[str], None] = print) -> Path:
    """Run the benchmark; returns the result file's path."""
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpusparse bench: no CUDA device here (use --device cpu for a dry run)")
    env = environment(cfg)
    big = device.type == "cuda"
    env["copy_bandwidth_bytes_per_s"] = copy_rate(device, (1 << 30) if big else (1 << 26), 20)
    env["onchip_copy_bytes_per_s"] = copy_rate(device, (16 << 20) if big else (1 << 20), 20, inner=100 if big else 4)
    env["posting_bytes"] = POSTING_BYTES
    path = result_path(cfg, env)
    out = ResultFile(path, env, cfg)
    workers: list[tuple[object, Path, dict]] = []
    cpu_set: set[int] | None = None
    if device.type == "cuda" and cfg.cpu_engines and cfg.cpu_parallel and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > cfg.gpu_cores + 1:
            os.sched_setaffinity(0, set(cores[: cfg.gpu_cores]))
            torch.set_num_threads(cfg.gpu_cores)
            cpu_set = set(cores[cfg.gpu_cores :])
            env["gpu_process_cores"] = cfg.gpu_cores
            env["cpu_engine_cores"] = len(cpu_set)
    log(
        f"{env['card']}: copy bandwidth {env['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"on-chip copy {env['onchip_copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)"
    )

    def over_deadline() -> bool:
        return cfg.deadline_s is not None and time.perf_counter() - t_start > cfg.deadline_s

    for n_docs in cfg.sizes:
        if over_deadline():
            log(f"deadline reached: N={n_docs:,} not run")
            out.add({"system": "*", "n_docs": n_docs, "status": "skipped", "reason": "deadline"})
            continue
        _run_size(cfg, n_docs, device, env, out, log, over_deadline, cpu_set, workers)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _collect_workers(workers, cfg, t_start, out, log)
    out.data["env"]["wall_s"] = time.perf_counter() - t_start
    out.flush()
    log(f"\nwrote {path}\n")
    log(short_table(out.data))
    return path


def _run_size(
    cfg: RunConfig,
    n_docs: int,
    device: torch.device,
    env: dict,
    out: ResultFile,
    log: Callable[[str], None],
    over_deadline: Callable[[], bool],
    cpu_set: set[int] | None = None,
    workers: list | None = None,
    tag: dict | None = None,
) -> None:
    """One collection: generate, index, reference, floors, then every selected system.

    ``tag`` is merged into the collection's entry and every record (``gpusparse bench
    paper`` marks its parts with it).
    """
    tag = tag or {}
    batches = [b for b in cfg.batches if b <= 256 or n_docs <= cfg.big_batch_max_docs]
    n_pool = max(cfg.batches + cfg.cpu_batches)
    vocab = Vocabulary.bert() if cfg.spec.n_terms == 30522 else Vocabulary.integer(cfg.spec.n_terms)
    t0 = time.perf_counter()
    docs, qcsr = generate(n_docs, n_pool, spec=cfg.spec, seed=cfg.seed, device=device, doc_chunk=cfg.spec.doc_chunk())
    _sync(device)
    t_gen = time.perf_counter() - t0
    stats = synthetic_stats(docs, qcsr, n_terms=cfg.spec.n_terms, max_queries=cfg.stat_queries)
    t0 = time.perf_counter()
    index = Index.from_csr(*docs, vocab, device=device)
    _sync(device)
    t_index = time.perf_counter() - t0
    index.derived.forward = docs  # the doc-parallel kernel's CSR: the generator's output
    ist = index.stats()
    queries = SparseCollection(qcsr[0].cpu().numpy(), qcsr[1].cpu().numpy(), qcsr[2].cpu().numpy(), vocab=vocab)
    del qcsr
    n_exact = min(cfg.exact_sample, n_pool)
    kmax = max(cfg.ks)
    t0 = time.perf_counter()
    ref = independent_reference(docs, len(vocab), queries[:n_exact], kmax)
    t_ref = time.perf_counter() - t0
    coll = tag | {
        "n_docs": n_docs,
        "generate_s": t_gen,
        "index_s": t_index,
        "index_bytes": ist.bytes,
        "forward_bytes": sum(t.numel() * t.element_size() for t in docs),
        "n_postings": ist.n_postings,
        "reference_s": t_ref,
        "reference_queries": n_exact,
        "reference_k": kmax,
        "reference": "gpusparse.verify.exact_topk: float64 scipy products on the host, independent of the search code",
        "stats": stats,
    }
    out.data["collections"].append(coll)
    out.flush()
    log(
        f"\nN={n_docs:,}: {ist.n_postings:,} postings, index {ist.bytes / 2**20:,.0f} MiB; generated in "
        f"{t_gen:.1f} s, indexed in {t_index:.1f} s, exact reference ({n_exact} queries, k={kmax}) in {t_ref:.1f} s"
    )
    log(format_stats(stats))

    # Floors per batch: postings the batch must read.
    lengths = index.lengths.to(torch.int64).cpu()
    floors = {}
    bw, onchip = env["copy_bandwidth_bytes_per_s"], env["onchip_copy_bytes_per_s"]
    for b in sorted(set(batches + cfg.cpu_batches)):
        t = torch.from_numpy(queries[:b].indices).to(torch.int64)
        read = int(lengths[t].sum())
        distinct = int(lengths[torch.unique(t)].sum())
        f_bw = distinct * POSTING_BYTES / bw * 1e3
        f_chip = read * POSTING_BYTES / onchip * 1e3
        floors[b] = {
            "postings_read": read,
            "postings_distinct": distinct,
            "floor_bandwidth_ms": f_bw,
            "floor_onchip_ms": f_chip,
            "floor_ms": max(f_bw, f_chip),
        }

    w = Workload(index, docs, memory_budget=cfg.memory_budget, dense_max_bytes=cfg.dense_max_bytes)
    systems: list[System] = [s for s in gpu_systems() if selected(cfg, s.name)]
    resident = ist.bytes + coll["forward_bytes"]
    if cfg.cpu_engines and n_docs <= cfg.cpu_max_docs:
        engines = [s for s in cpu_engines() if selected(cfg, s.name)]
        if cpu_set is not None and workers is not None and engines:
            meta = {
                "base": {"n_docs": n_docs, "index_bytes": ist.bytes, "resident_bytes": resident},
                "floors": {str(b): f for b, f in floors.items()},
                "ks": cfg.ks,
                "cpu_batches": cfg.cpu_batches,
                "cap_s": cfg.cpu_time_cap_s,
                "n_exact": n_exact,
                "n_terms": cfg.spec.n_terms,
                "systems": [s.name for s in engines],
            }
            workers.append(_start_worker(docs, queries, ref, meta, cpu_set, n_docs))
            log(f"  CPU engines ({', '.join(meta['systems'])}) started on {len(cpu_set)} other cores")
        else:
            systems += engines
    for system in systems:
        base = tag | {
            "system": system.name,
            "family": system.family,
            "n_docs": n_docs,
            "index_bytes": ist.bytes,
            "resident_bytes": resident,
        }
        if over_deadline():
            out.add(base | {"status": "skipped", "reason": "deadline"})
            log(f"  {system.name}: skipped (deadline)")
            continue
        try:
            system.prepare(w)
        except SystemUnavailable as e:
            out.add(base | {"status": "skipped", "reason": str(e)})
            log(f"  {system.name}: skipped ({e})")
            continue
        except Exception as e:  # a baseline failing must not stop the run
            out.add(base | {"status": "error", "reason": f"prepare: {type(e).__name__}: {e}"})
            log(f"  {system.name}: prepare failed: {type(e).__name__}: {e}")
            _free(system, device)
            continue
        base |= {"description": system.description, "prepare_s": system.prepare_s, "extra_bytes": system.extra_bytes}
        cpu = system.family == "cpu"
        for b in cfg.cpu_batches if cpu else batches:
            oom = False
            for k in cfg.ks:
                if over_deadline():
                    out.add(base | {"batch_size": b, "k": k, "status": "skipped", "reason": "deadline"})
                    continue
                rec = base | {"batch_size": b, "k": k} | floors[b]
                rec |= _measure(system, queries[:b], k, ref, n_exact, device, cfg, cpu)
                if not cpu:
                    rec["derived_bytes"] = derived_bytes(index)
                finish_floor(rec)
                out.add(rec)
                log(_line(rec))
                oom = rec.get("status") == "oom"
                if oom:
                    break
            if oom:
                break  # larger batches will not fit either
        _free(system, device)
    del w, index, docs
    gc.collect()


def _start_worker(docs, queries, ref, meta: dict, cpu_set: set[int], n_docs: int) -> tuple[object, Path, dict]:
    folder = Path(tempfile.mkdtemp(prefix=f"gpusparse-cpu-{n_docs}-"))
    save_job(folder, docs, queries, ref, meta)
    # The worker imports this harness and the gpusparse this process runs, wherever they are.
    paths = [str(Path(__file__).resolve().parents[1]), str(Path(gpusparse.__file__).resolve().parents[1])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the worker never touches the GPU
    with open(folder / "log", "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpusparse_bench.cpu_worker", str(folder)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, cpu_set),
        )
    return proc, folder, meta


def _collect_workers(
    workers: list, cfg: RunConfig, t_start: float, out: ResultFile, log: Callable[[str], None]
) -> None:
    """Wait for the CPU engines' workers (until the deadline) and merge their records."""
    for proc, folder, meta in workers:
        timeout = None if cfg.deadline_s is None else max(1.0, cfg.deadline_s + 30 - (time.perf_counter() - t_start))
        try:
            proc.wait(timeout=timeout)
        except Exception:
            proc.kill()
            proc.wait()
        done, records = False, []
        if (folder / "records.json").exists():
            data = json.loads((folder / "records.json").read_text())
            done, records = data["done"], data["records"]
        seen = {(r["system"], r.get("batch_size"), r.get("k")) for r in records}
        for rec in records:
            out.add(rec)
            if rec.get("status") == "ok":
                log(_line(rec))
        if not done:
            tail = (folder / "log").read_text()[-500:] if (folder / "log").exists() else ""
            for name in meta["systems"]:
                for b in meta["cpu_batches"]:
                    for k in meta["ks"]:
                        if (name, b, k) not in seen:
                            out.add(
                                meta["base"]
                                | {"system": name, "family": "cpu", "batch_size": b, "k": k, "status": "skipped"}
                                | {"reason": f"CPU worker did not finish (exit {proc.returncode}): {tail[-200:]}"}
                            )
        log(f"  CPU engines worker for N={meta['base']['n_docs']:,}: exit {proc.returncode}, {len(records)} records")


def derived_bytes(index: Index) -> int:
    """Device bytes of what searches built from the index and keep in ``index.derived`` (our
    tiled layout, ...), the benchmark's document CSR (the forward copy) left out."""
    return index.derived.device_bytes(forward=False)


def _free(system: System, device: torch.device) -> None:
    try:
        system.close()
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _measure(
    system: System,
    q: SparseCollection,
    k: int,
    ref,
    n_exact: int,
    device: torch.device,
    cfg: RunConfig,
    cpu: bool,
) -> dict:
    b = len(q)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cap = cfg.cpu_time_cap_s if cpu else cfg.time_cap_s
    try:
        # CPU engines are slow: their first batch (B = 1) warms them up, larger ones run once or twice.
        warm = cfg.warmup if not cpu or b == 1 else 0
        times, res = time_call(
            lambda: system.search(q, k), device, reps=cfg.reps if not cpu else 3, warmup=warm, cap_s=cap
        )
    except torch.cuda.OutOfMemoryError as e:
        gc.collect()
        torch.cuda.empty_cache()
        return {"status": "oom", "reason": str(e).splitlines()[0][:200]}
    except Exception as e:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
    ms = statistics.median(times)
    scores, ids = res
    m = min(b, n_exact)
    cmp = compare(
        scores[:m, :k], ids[:m, :k], ref.scores[:m, :k], ref.ids[:m, :k], with_scores=not cpu
    )  # CPU engines score quantised impacts: only ids compare
    own = system.own_reference(q[:m], k) if m else None
    if own is not None:  # exact for its own (quantized) vectors; recall says what they change
        mine = compare(scores[:m, :k], ids[:m, :k], own[0][:, :k], own[1][:, :k], with_scores=True)
        cmp = {
            "exact": mine["exact"],
            "exact_against": "the exact search of its own quantized index",
            "max_score_diff": mine["max_score_diff"],
            "recall_vs_exact": cmp["recall_vs_exact"],
            "recall_against": "the float32 exact top-k",
        }
    rec = {
        "status": "ok",
        "ms_per_batch": ms,
        "ms_per_query": ms / b,
        "qps": b / ms * 1e3,
        "ms_min": min(times),
        "ms_max": max(times),
        "reps": len(times),
        "timing": "host clock, host to host" if cpu or device.type != "cuda" else "CUDA events, host to host",
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "cupy_pool_bytes": cupy_pool_bytes() if device.type == "cuda" else None,
        "exact_queries_checked": m,
        **cmp,
    }
    return rec


def cupy_pool_bytes() -> int | None:
    """Bytes CuPy's default memory pool holds (it keeps what it has allocated: a peak unless
    freed), ``None`` without CuPy; beside PyTorch's peak it covers every allocator a search uses."""
    try:
        import cupy
    except ImportError:
        return None
    return int(cupy.get_default_memory_pool().total_bytes())


def finish_floor(rec: dict) -> None:
    """Add ``frac_of_floor`` (floor / measured) to a record in place."""
    if rec.get("status") == "ok" and rec.get("floor_ms"):
        rec["frac_of_floor"] = rec["floor_ms"] / rec["ms_per_batch"]


def _line(rec: dict) -> str:
    head = f"  {rec['system']:<24} N={rec['n_docs']:>9,} B={rec['batch_size']:>4} k={rec['k']:>4}"
    if rec.get("status") != "ok":
        return f"{head}  {rec.get('status')}: {rec.get('reason', '')[:120]}"
    return (
        f"{head}  {rec['ms_per_batch']:9.3f} ms  {rec['qps']:10,.0f} q/s  floor {rec['frac_of_floor']:6.1%}"
        f"  exact={rec['exact']!s:<5} recall={rec['recall_vs_exact']:.4f} reps={rec['reps']}"
    )


def spec_from_overrides(overrides: list[str]) -> SyntheticSpec:
    """``["zipf=1.2", "n_topics=32"]`` → a :class:`SyntheticSpec` with those fields changed."""
    spec = SyntheticSpec()
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if not hasattr(spec, key) or not value:
            raise ValueError(f"bad --spec {item!r}: fields are {', '.join(asdict(spec))}")
        changes[key] = type(getattr(spec, key))(value)
    return replace(spec, **changes)


def main_argv() -> str:
    return " ".join(["gpusparse", *sys.argv[1:]]) if sys.argv else "gpusparse bench run"
