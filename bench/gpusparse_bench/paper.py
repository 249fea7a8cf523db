"""``gpusparse bench paper``: the paper's remaining experiments, ours beside the paper's kernel.

Six parts (``--only`` picks some), each written into one result file (the runner's JSON:
``env`` names the card, commit and command; every record carries ``part``):

* ``e2e``: SPLADE query encoding + scoring + top-k at ``e2e_docs`` synthetic documents,
  per batch: encode ms, score ms, ms per query, QPS. Two encoders: a BERT-base-size
  masked LM with random weights (:func:`~gpusparse.encode.random_bert_base`; speed does not
  depend on the weights, but its output is not sparse, so its vectors are cut to the
  ``base_query_terms`` largest weights, MS MARCO's mean query length) and splade-tiny as
  is. Query texts come from a BEIR ``queries.jsonl`` given by option, else are generated;
  the record says which;
* ``batch``: the batch-size sweep at 50K documents, top-10;
* ``sparsity``: 500K documents with 10 … 500 non-zeros per document, batch 64;
* ``vocab``: vocabularies of 10K, 30K, 100K terms at the same postings;
* ``memory``: index bytes and peak device bytes, 50K … 8.8M documents, batch 256;
* ``quality``: the text pipeline (splade-tiny → index → search → ``ir_measures``; the steps
  of ``gpusparse pipeline``, :class:`gpusparse.pipeline.TextPipeline`) on every BEIR folder
  under a data root, each run checked by the independent exact scorer of :mod:`gpusparse.verify`.

"ours" is the kernel ``kernel="auto"`` picks on the device (:func:`gpusparse.engines.choose`);
"paper" is the paper's pipeline (:class:`~gpusparse_bench.systems.PaperScatter`). The
``batch``, ``sparsity`` and ``vocab`` parts are :func:`gpusparse_bench.runner._run_size`
itself (same timing, reference, floors and exactness check as ``gpusparse bench run``);
``e2e`` and ``memory`` time with :func:`~gpusparse_bench.runner.time_call`. A part that
cannot run here (no ``transformers``, no model folder, no data) is recorded as skipped
with the reason; the others still run.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from traceback import format_exc

import torch

from gpusparse import engines
from gpusparse.beir import read_beir, read_queries
from gpusparse.collection import SparseCollection
from gpusparse.encode import SpladeEncoder, check_model_folder, random_bert_base
from gpusparse.errors import InputError
from gpusparse.evaluate import evaluate
from gpusparse.index import Index
from gpusparse.pipeline import TextPipeline
from gpusparse.synthetic import MSMARCO_DOCS, SyntheticSpec, generate
from gpusparse.verify import verify_run
from gpusparse.vocab import Vocabulary

from .paper_report import paper_markdown
from .runner import (
    ResultFile,
    RunConfig,
    _free,
    _run_size,
    _sync,
    compare,
    copy_rate,
    cupy_pool_bytes,
    derived_bytes,
    environment,
    result_path,
    time_call,
)
from .systems import OursKernel, PaperScatter, PaperScatterChunked, System, SystemUnavailable, Workload

PARTS = ("e2e", "batch", "sparsity", "vocab", "memory", "quality")
# Run order: the memory table (the paper's 8.8M figures) before the sweeps, so that a
# deadline cuts a sweep point rather than the largest collection.
RUN_ORDER = ("e2e", "batch", "memory", "sparsity", "vocab", "quality")
QUALITY_MEASURES = ("nDCG@10", "RR@10", "R@100", "R@1000")


@dataclass(frozen=True)
class Scale:
    """Sizes of every part: ``full`` is the paper's (for a GPU), ``tiny`` a CPU dry run."""

    e2e_docs: int
    e2e_batches: tuple[int, ...]
    e2e_k: int
    base_overrides: dict = field(default_factory=dict)  # BertConfig fields changed from BERT-base
    batch_docs: int = 50_000
    batch_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    batch_k: int = 10
    sweep_docs: int = 500_000
    sweep_batch: int = 64
    sweep_k: int = 1000
    nnz_values: tuple[int, ...] = (10, 50, 100, 200, 500)
    vocab_values: tuple[int, ...] = (10_000, 30_522, 100_000)
    memory_sizes: tuple[int, ...] = (50_000, 100_000, 500_000, 1_000_000, MSMARCO_DOCS)
    memory_batch: int = 256
    memory_k: int = 1000
    quality_max_docs: int | None = None  # a dry run keeps the first documents and their judgments
    reps: int = 10
    warmup: int = 1  # untimed calls first (a dry run takes none: Triton's interpreter is slow)
    time_cap_s: float = 1.0
    exact_sample: int = 64
    stat_queries: int = 16


SCALES = {
    "full": Scale(e2e_docs=1_000_000, e2e_batches=(1, 8, 32, 64, 128), e2e_k=1000),
    "tiny": Scale(
        e2e_docs=600,
        e2e_batches=(1, 4),
        e2e_k=100,
        base_overrides={"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128},
        batch_docs=600,
        batch_batches=(1, 4),
        sweep_docs=600,
        sweep_batch=4,
        sweep_k=100,
        nnz_values=(10, 100),
        vocab_values=(10_000, 100_000),
        memory_sizes=(300, 600),
        memory_batch=8,
        memory_k=100,
        quality_max_docs=60,
        reps=2,
        warmup=0,
        time_cap_s=0.2,
        exact_sample=16,
        stat_queries=4,
    ),
}


@dataclass
class PaperConfig:
    device: str = "cuda"
    scale: str = "full"
    only: tuple[str, ...] = PARTS
    tiny_model: Path | None = None  # splade-tiny: its model, and the tokenizer of the base model
    query_texts: Path | None = None  # a BEIR queries.jsonl for the e2e part (else generated text)
    data_root: Path | None = None  # BEIR folders for the quality part
    base_query_terms: int = 45  # the random base model's vectors are cut to this many terms
    quality_k: int = 1000
    split: str = "test"
    memory_budget: int = 4 << 30
    seed: int = 0
    deadline_s: float | None = None
    out: Path = Path("bench/results")
    name: str = "paper"
    commit: str | None = None
    command: str = ""

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {', '.join(SCALES)}, not {self.scale!r}")
        unknown = [p for p in self.only if p not in PARTS]
        if unknown:
            raise ValueError(f"unknown part(s) {', '.join(unknown)}; parts are {', '.join(PARTS)}")


@dataclass
class _Ctx:
    cfg: PaperConfig
    scale: Scale
    device: torch.device
    env: dict
    out: ResultFile
    log: Callable[[str], None]
    t_start: float

    def over_deadline(self) -> bool:
        d = self.cfg.deadline_s
        return d is not None and time.perf_counter() - self.t_start > d

    def run_config(self, **changes: object) -> RunConfig:
        """The runner's configuration for a sweep part (ours and the paper's kernel only)."""
        sc = self.scale
        base = RunConfig(
            device=self.cfg.device,
            reps=sc.reps,
            warmup=sc.warmup,
            time_cap_s=sc.time_cap_s,
            memory_budget=self.cfg.memory_budget,
            exact_sample=sc.exact_sample,
            stat_queries=sc.stat_queries,
            seed=self.cfg.seed,
            systems=[ours_name(self.device), "paper-scatter"],
            cpu_engines=False,
            cpu_batches=[],
            out=self.cfg.out,
            name=self.cfg.name,
        )
        return replace(base, **changes)


def ours_name(device: torch.device) -> str:
    """The benchmark name of the kernel ``kernel="auto"`` runs on ``device``."""
    return f"ours-{engines.choose('auto', device).name}"


def run_paper(cfg: PaperConfig, *, log: Callable[[str], None] = print) -> Path:
    """Run the selected parts; returns the result file's path.

    A part that fails is recorded with its error and traceback, and the others still run;
    the CLI then exits with status 1.
    """
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpusparse bench paper: no CUDA device here (use --device cpu for a dry run)")
    rc = RunConfig(device=cfg.device, out=cfg.out, name=cfg.name, commit=cfg.commit, command=cfg.command)
    env = environment(rc)
    big = device.type == "cuda"
    env["copy_bandwidth_bytes_per_s"] = copy_rate(device, (1 << 30) if big else (1 << 26), 20)
    env["onchip_copy_bytes_per_s"] = copy_rate(device, (16 << 20) if big else (1 << 20), 20, inner=100 if big else 4)
    env["posting_bytes"] = 8
    env["ours_kernel"] = engines.choose("auto", device).name
    out = ResultFile(result_path(rc, env), env, rc)
    out.data["config"] = _paper_config_dict(cfg)
    out.data["parts"] = {}
    ctx = _Ctx(cfg, SCALES[cfg.scale], device, env, out, log, t_start)
    log(f"{env['card']}: ours = {ours_name(device)}, scale {cfg.scale}, parts {', '.join(cfg.only)}")
    runners = {
        "e2e": _part_e2e,
        "batch": _part_batch,
        "sparsity": _part_sparsity,
        "vocab": _part_vocab,
        "memory": _part_memory,
        "quality": _part_quality,
    }
    for part in RUN_ORDER:
        if part not in cfg.only:
            continue
        t0 = time.perf_counter()
        if ctx.over_deadline():
            status = {"status": "skipped", "reason": "deadline"}
        else:
            log(f"\n== {part}")
            try:
                status = runners[part](ctx) or {"status": "ok"}
            except _Skip as e:
                status = {"status": "skipped", "reason": str(e)}
            except Exception as e:  # one part failing must not lose the others: recorded, exit status 1
                status = {"status": "error", "reason": f"{type(e).__name__}: {e}", "traceback": format_exc()[-3000:]}
                log(status["traceback"])
        status["seconds"] = time.perf_counter() - t0
        out.data["parts"][part] = status
        out.flush()
        if status["status"] != "ok":
            log(f"  {part}: {status['status']} ({status.get('reason')})")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out.data["env"]["wall_s"] = time.perf_counter() - t_start
    out.flush()
    log(f"\nwrote {out.path}")
    log(paper_markdown([out.data | {"_path": str(out.path)}], require_gpu=False))
    return out.path


class _Skip(Exception):
    """A part cannot run here; the message is recorded."""


def _paper_config_dict(cfg: PaperConfig) -> dict:
    d = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()}
    d["only"] = list(cfg.only)
    d["scale_sizes"] = vars(SCALES[cfg.scale])
    return d


# -- sweeps: the runner's own loop ----------------------------------------------------------


def _sweep(ctx: _Ctx, part: str, n_docs: int, rc: RunConfig, tag: dict) -> None:
    _run_size(rc, n_docs, ctx.device, ctx.env, ctx.out, ctx.log, ctx.over_deadline, tag={"part": part} | tag)
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def _part_batch(ctx: _Ctx) -> None:
    sc = ctx.scale
    rc = ctx.run_config(batches=list(sc.batch_batches), ks=[sc.batch_k])
    _sweep(ctx, "batch", sc.batch_docs, rc, {})


def _part_sparsity(ctx: _Ctx) -> None:
    sc = ctx.scale
    for nnz in sc.nnz_values:
        if ctx.over_deadline():
            ctx.out.add({"part": "sparsity", "doc_nnz": nnz, "status": "skipped", "reason": "deadline"})
            continue
        rc = ctx.run_config(batches=[sc.sweep_batch], ks=[sc.sweep_k], spec=SyntheticSpec().with_doc_nnz(nnz))
        _sweep(ctx, "sparsity", sc.sweep_docs, rc, {"doc_nnz": nnz})


def _part_vocab(ctx: _Ctx) -> None:
    sc = ctx.scale
    for v in sc.vocab_values:
        if ctx.over_deadline():
            ctx.out.add({"part": "vocab", "n_terms": v, "status": "skipped", "reason": "deadline"})
            continue
        rc = ctx.run_config(batches=[sc.sweep_batch], ks=[sc.sweep_k], spec=SyntheticSpec().with_vocabulary(v))
        _sweep(ctx, "vocab", sc.sweep_docs, rc, {"n_terms": v})


# -- memory -------------------------------------------------------------------------------


def _synthetic_index(ctx: _Ctx, n_docs: int, n_queries: int, spec: SyntheticSpec | None = None):
    """``(index, docs CSR, queries)`` of a synthetic collection generated on the device."""
    spec = spec or SyntheticSpec()
    vocab = Vocabulary.bert() if spec.n_terms == 30522 else Vocabulary.integer(spec.n_terms)
    docs, q = generate(n_docs, n_queries, spec=spec, seed=ctx.cfg.seed, device=ctx.device, doc_chunk=spec.doc_chunk())
    index = Index.from_csr(*docs, vocab, device=ctx.device)
    queries = SparseCollection(q[0].cpu().numpy(), q[1].cpu().numpy(), q[2].cpu().numpy(), vocab=vocab)
    _sync(ctx.device)
    return index, docs, queries


def _part_memory(ctx: _Ctx) -> None:
    sc, dev = ctx.scale, ctx.device
    cuda = dev.type == "cuda"
    for n in sc.memory_sizes:
        if ctx.over_deadline():
            ctx.out.add({"part": "memory", "n_docs": n, "status": "skipped", "reason": "deadline"})
            continue
        index, docs, queries = _synthetic_index(ctx, n, sc.memory_batch)
        del docs  # the paper's footprint is the index and the score buffer: no document CSR resident
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        st = index.stats()
        w = Workload(
            index, (torch.zeros(n + 1, dtype=torch.int64, device=dev),) * 3, memory_budget=ctx.cfg.memory_budget
        )
        resident = torch.cuda.memory_allocated(dev) if cuda else None
        for system in (OursKernel(engines.choose("auto", dev).name), PaperScatter(), PaperScatterChunked()):
            base = {
                "part": "memory",
                "system": system.name,
                "family": system.family,
                "n_docs": n,
                "n_postings": st.n_postings,
                "n_padded": st.n_padded,
                "paper_layout_bytes": st.bytes,
                "resident_before_bytes": resident,
                "batch_size": sc.memory_batch,
                "k": sc.memory_k,
            }
            rec = base | _measure_once(ctx, system, w, queries, sc.memory_k)
            if rec.get("status") == "ok":
                rec["derived_bytes"] = derived_bytes(index)
                rec["index_bytes"] = st.bytes + rec["derived_bytes"]
            ctx.out.add(rec)
            ctx.log(_memory_line(rec))
            _free(system, dev)
        del w, index
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _measure_once(ctx: _Ctx, system: System, w: Workload, queries: SparseCollection, k: int) -> dict:
    """Prepare, then time a few searches; peak device memory over them (the index included)."""
    dev = ctx.device
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    pool0 = cupy_pool_bytes() if cuda else None
    try:
        system.prepare(w)
        times, _ = time_call(
            lambda: system.search(queries, k), dev, reps=3, warmup=ctx.scale.warmup, cap_s=ctx.scale.time_cap_s
        )
    except SystemUnavailable as e:
        return {"status": "skipped", "reason": str(e)}
    except torch.cuda.OutOfMemoryError as e:
        return {"status": "oom", "reason": str(e).splitlines()[0][:200]}
    except Exception as e:  # a baseline failing must not stop the run
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
    ms = statistics.median(times)
    pool1 = cupy_pool_bytes() if cuda else None
    return {
        "status": "ok",
        "description": system.description,
        "ms_per_batch": ms,
        "reps": len(times),
        "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "cupy_pool_bytes": None if pool0 is None or pool1 is None else pool1,
        "extra_bytes": system.extra_bytes,
    }


def _memory_line(rec: dict) -> str:
    head = f"  {rec['system']:<24} N={rec['n_docs']:>9,} B={rec['batch_size']:>4}"
    if rec.get("status") != "ok":
        return f"{head}  {rec.get('status')}: {rec.get('reason', '')[:120]}"
    peak = rec.get("peak_mem_bytes")
    return (
        f"{head}  index {rec['index_bytes'] / 2**20:10,.1f} MiB  peak "
        f"{'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}  {rec['ms_per_batch']:9.3f} ms"
    )


# -- end to end: text in, top-k out --------------------------------------------------------


def query_texts(path: Path | None, n: int, seed: int = 0) -> tuple[list[str], str]:
    """``n`` query texts (repeated in order if the file has fewer) and where they came from.

    From a BEIR ``queries.jsonl`` when ``path`` is given; else generated: 4 to 12 words
    drawn from a fixed list of English words (seeded).
    """
    if path is not None:
        texts = [t for t in read_queries(path).texts if t.strip()]
        if not texts:
            raise _Skip(f"{path}: no non-empty query text")
        return [texts[i % len(texts)] for i in range(n)], f"real query texts from {path} (first {min(n, len(texts))})"
    rng = random.Random(seed)
    words = _WORDS.split()
    out = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n)]
    return out, "generated text: 4-12 words drawn (seeded) from a list of 96 common English words"


_WORDS = (
    "what how why when where which who is are does do can the a of in on for to with from by about "
    "capital city country population history war music film book author science disease symptoms "
    "treatment vaccine immune system cell protein gene energy water climate temperature ocean river "
    "mountain price cost tax law court president election company market bank money interest rate "
    "computer software program language network internet data security phone battery car engine fuel "
    "food diet vitamin sugar blood heart brain sleep exercise pain child school university student job"
)


def _encoders(ctx: _Ctx) -> list[tuple[str, object, int | None, dict]]:
    """``(name, SpladeEncoder, prune_top, description)`` for the base and the tiny model."""
    cfg, sc = ctx.cfg, ctx.scale
    if cfg.tiny_model is None:
        raise _Skip("no --tiny-model given (splade-tiny's folder: its model, and the tokenizer of the base model)")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise _Skip(f"transformers is not installed ({e})") from None
    try:
        check_model_folder(Path(cfg.tiny_model))
    except InputError as e:
        raise _Skip(str(e)) from None
    bmax = max(sc.e2e_batches)
    tok, mlm = random_bert_base(cfg.tiny_model, seed=cfg.seed, **sc.base_overrides)
    c = mlm.config
    base_desc = {
        "model": "BertForMaskedLM from transformers.BertConfig() (BERT-base sizes), random weights, no checkpoint",
        "config": {
            "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads,
            "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size,
        },
        "parameters": sum(p.numel() for p in mlm.parameters()),
        "tokenizer": str(cfg.tiny_model),
        "pruned_to": cfg.base_query_terms,
        "note": "random weights give dense outputs; vectors are cut to the largest weights (encode's prune_top)",
    }
    name = "bert-base-random" if not sc.base_overrides else "bert-shrunk-random (dry run)"
    out = []
    enc = SpladeEncoder(name, loaded=(tok, mlm), device=ctx.device, batch_size=bmax)
    out.append((name, enc, cfg.base_query_terms, base_desc | {"precision": _precision(enc)}))
    tiny = SpladeEncoder(cfg.tiny_model, device=ctx.device, batch_size=bmax)
    c = tiny.model.config
    out.append(
        (
            "splade-tiny",
            tiny,
            None,
            {
                "model": str(cfg.tiny_model),
                "config": {"num_hidden_layers": c.num_hidden_layers, "hidden_size": c.hidden_size},
                "parameters": sum(p.numel() for p in tiny.model.parameters()),
                "precision": _precision(tiny),
            },
        )
    )
    return out


def _precision(enc: object) -> str:
    dt = enc.autocast_dtype
    return "float32" if dt is None else f"{str(dt).removeprefix('torch.')} autocast"


def _part_e2e(ctx: _Ctx) -> None:
    sc, dev = ctx.scale, ctx.device
    encoders = _encoders(ctx)
    texts, source = query_texts(ctx.cfg.query_texts, max(sc.e2e_batches), ctx.cfg.seed)
    ctx.out.data["parts_info"] = ctx.out.data.get("parts_info", {}) | {"e2e_query_texts": source}
    ctx.log(f"  queries: {source}")
    index, docs, _ = _synthetic_index(ctx, sc.e2e_docs, 0)
    st = index.stats()
    w = Workload(index, docs, memory_budget=ctx.cfg.memory_budget)
    systems: list[System] = []
    for system in (OursKernel(engines.choose("auto", dev).name), PaperScatter()):
        try:
            system.prepare(w)
            systems.append(system)
        except SystemUnavailable as e:
            ctx.out.add({"part": "e2e", "system": system.name, "status": "skipped", "reason": str(e)})
            ctx.log(f"  {system.name}: skipped ({e})")
    k = sc.e2e_k
    for name, enc, prune_top, desc in encoders:
        for b in sc.e2e_batches:
            if ctx.over_deadline():
                ctx.out.add({"part": "e2e", "model": name, "batch_size": b, "status": "skipped", "reason": "deadline"})
                continue
            batch = texts[:b]
            enc_times, q = time_call(
                lambda batch=batch, enc=enc, top=prune_top: enc.encode(batch, kind="query", prune_top=top),
                dev,
                reps=sc.reps,
                warmup=sc.warmup,
                cap_s=sc.time_cap_s,
            )
            encode_ms = statistics.median(enc_times)
            ref = index.search(q, k, kernel="reference", memory_budget=ctx.cfg.memory_budget)
            for system in systems:
                base = {
                    "part": "e2e",
                    "model": name,
                    "model_info": desc,
                    "system": system.name,
                    "family": system.family,
                    "n_docs": sc.e2e_docs,
                    "n_postings": st.n_postings,
                    "batch_size": b,
                    "k": k,
                    "query_nnz_mean": q.nnz / max(len(q), 1),
                    "encode_ms": encode_ms,
                    "encode_reps": len(enc_times),
                }
                try:
                    times, (scores, ids) = time_call(
                        lambda q=q, system=system: system.search(q, k),
                        dev,
                        reps=sc.reps,
                        warmup=sc.warmup,
                        cap_s=sc.time_cap_s,
                    )
                except torch.cuda.OutOfMemoryError as e:
                    ctx.out.add(base | {"status": "oom", "reason": str(e).splitlines()[0][:200]})
                    continue
                score_ms = statistics.median(times)
                total = encode_ms + score_ms
                rec = base | {
                    "status": "ok",
                    "score_ms": score_ms,
                    "score_reps": len(times),
                    "ms_per_batch": total,
                    "ms_per_query": total / b,
                    "qps": b / total * 1e3,
                    "timing": "CUDA events, host to host" if dev.type == "cuda" else "host clock",
                    **compare(scores, ids, ref.scores, ref.ids, with_scores=True),
                }
                ctx.out.add(rec)
                ctx.log(
                    f"  {name:<28} {system.name:<14} B={b:>4}  encode {encode_ms:8.2f} ms  score {score_ms:8.2f} ms  "
                    f"{rec['ms_per_query']:8.3f} ms/q  {rec['qps']:9,.0f} q/s  exact={rec['exact']}"
                )
        enc.model.to("cpu")  # free the device for the next encoder
        gc.collect()
    for system in systems:
        _free(system, dev)


# -- quality: the text pipeline on real collections ----------------------------------------


def beir_folders(root: Path) -> list[Path]:
    """Sub-folders of ``root`` that hold a BEIR ``corpus.jsonl`` (or ``.jsonl.gz``), sorted."""
    return sorted(
        p for p in root.iterdir() if p.is_dir() and any((p / f).is_file() for f in ("corpus.jsonl", "corpus.jsonl.gz"))
    )


def _part_quality(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    if cfg.data_root is None:
        raise _Skip("no --data-root given (a folder of BEIR collections)")
    if cfg.tiny_model is None:
        raise _Skip("no --tiny-model given (the quality part encodes with splade-tiny)")
    try:
        import ir_measures  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise _Skip(f"{e.name} is not installed (the quality part needs transformers and ir_measures)") from None
    folders = beir_folders(Path(cfg.data_root))
    if not folders:
        raise _Skip(f"no BEIR folder (with corpus.jsonl) under {cfg.data_root}")
    enc = SpladeEncoder(cfg.tiny_model, device=ctx.device)
    for folder in folders:
        if ctx.over_deadline():
            ctx.out.add({"part": "quality", "collection": folder.name, "status": "skipped", "reason": "deadline"})
            continue
        rec = _quality_one(ctx, enc, folder)
        ctx.out.add(rec)
        m = rec.get("measures", {})
        ctx.log(
            f"  {folder.name:<12} {rec.get('documents', 0):>7,} docs {rec.get('queries', 0):>5} queries  "
            + "  ".join(f"{k} {v:.4f}" for k, v in m.items())
            + f"  exact={rec.get('verify', {}).get('exact')}"
        )


def _quality_one(ctx: _Ctx, enc: SpladeEncoder, folder: Path) -> dict:
    """The ``gpusparse pipeline`` steps on one collection, the run checked by the exact scorer."""
    cfg, sc = ctx.cfg, ctx.scale
    t0 = time.perf_counter()
    beir = read_beir(folder, cfg.split)
    corpus, qrels, subset = beir.corpus, beir.qrels, False
    if sc.quality_max_docs is not None and len(corpus) > sc.quality_max_docs:
        corpus = corpus.select(set(corpus.ids[: sc.quality_max_docs]))
        keep = set(corpus.ids)
        qrels = {q: {d: g for d, g in docs.items() if d in keep} for q, docs in qrels.items()}
        qrels = {q: docs for q, docs in qrels.items() if any(g > 0 for g in docs.values())}
        subset = True
    judged = beir.queries.select(set(qrels))
    pipe = TextPipeline(corpus, judged, enc)
    docs, queries = pipe.encode()
    t_enc = time.perf_counter() - t0
    kernel = engines.choose("auto", ctx.device).name
    pipe.build_index(ctx.device)
    pipe.search(cfg.quality_k, kernel=kernel, memory_budget=cfg.memory_budget)
    _sync(ctx.device)
    run = pipe.run()
    ev = evaluate({q: dict(r) for q, r in run.items()}, qrels, list(QUALITY_MEASURES))
    report = verify_run(run, queries, docs, docs.ids, ks=(10, 100, 1000))  # float64 scipy, the original vectors
    return {
        "part": "quality",
        "status": "ok",
        "collection": folder.name,
        "split": cfg.split,
        "subset": subset,
        "documents": len(corpus),
        "queries": len(judged),
        "model": str(cfg.tiny_model),
        "encode_device": str(enc.device),
        "system": f"ours-{kernel}",
        "k": cfg.quality_k,
        "measures": ev.values,
        "evaluation": ev.as_dict(),
        "verify": report.as_dict(),
        "encode": pipe.summary()["encode"],
        "encode_s": t_enc,
        "index_search_s": pipe.index_seconds + pipe.search_seconds,
        "seconds": time.perf_counter() - t0,
    }
