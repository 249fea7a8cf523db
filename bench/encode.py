"""Text in, index out (issue 21, the encoder): time SPLADE encoding against the bare model, and
encode -> index end to end, in one run.

Parts, each timed on the same passages and the same batches (sorted by token length in windows,
padded per batch: what ``SpladeEncoder`` makes):

* ``tiny``: splade-tiny (``--tiny-model``, a real SPLADE): ``encode`` (texts to a
  SparseCollection: tokenisation in a thread, model, pooling, non-zeros, reordering) against
  the bare forward pass (``model(ids, mask).logits`` on batches already on the device);
* ``base``: a BERT-base-size masked LM with random weights (12 layers, hidden 768, splade-tiny's
  tokenizer and vocabulary; nothing downloaded): ``encode`` with ``--base-prune-top`` (random
  weights give dense vectors) against the bare forward pass;
* the tokenisation alone (tokenise, sort, pad into pinned batches, in one thread): the most the
  host can feed;
* ``e2e``: splade-tiny ``encode`` then ``Index.build`` on the device (what ``gpusparse encode
  --index`` runs), and writing/reading the vectors as GPUSparse ``.npz`` and Seismic ``.bin``.

Passages: the texts of the BEIR folders ``--data`` (default: nfcorpus, cisi and cranfield under
./shared/data or ../shared/data), cut into passages of ``--passage-words`` words and repeated up
to ``--passages``; synthetic passages (random vocabulary words) when no folder is found. The JSON
says which. Every part records seconds, passages/s and the peak GPU memory (torch; CuPy is not
used by encoding or index building, and its pool is reported if it was imported).

Where the time goes, in the same run: each of ``--variants`` (``VARIANTS``: by default ``rust``, the
eager forward as before CUDA graphs; ``new``, the defaults: the forward replayed as CUDA graphs,
one per length bucket; ``gwords``, that with the word cache) encodes the same passages; its row
has its passages/s, its GPU memory over every allocator (``bench/gpu_peaks.py``, peak since the
variant started), the CUDA-graph counts (graphs, capture seconds: the first repetition captures,
``encode_s_reps`` shows what that cost), the host seconds by stage (``EncodeStats.stages``: the
tokenising thread's tokenise and pad; the model thread's wait for token batches, launches, waits
for the device, host work, reordering) and the device's (CUDA events around each batch's forward:
busy seconds, gaps between forwards, the wait before the first one). The bare rows time the model
alone (eager, as a user would call it: the issue's reference "bare forward"), the model with the
pooling (eager), and the encoder's graphs on batches padded to its buckets, all on batches already
on the device.

Usage (GPU machine, from the repository root, with splade-tiny at ./shared/models/splade-tiny):
    python bench/encode.py --out $OUT --commit $(git rev-parse --short HEAD)
On a CPU in seconds: ``python bench/encode.py --tiny --out /tmp/x``.
Writes ``<out>/<date>-<card>-encode.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_peaks import gpu_memory  # bench/gpu_peaks.py
from gpusparse import Index, encode_device, read_vectors
from gpusparse.beir import read_beir
from gpusparse.encode import EncodeStats, SpladeEncoder, random_bert_base
from gpusparse.encode_graphs import bucket_length
from gpusparse.encode_tokens import Tokenize, token_batches
from gpusparse.vector_writers import write_seismic_bin
from gpusparse.vectors_npz import write_npz

ROOT = Path(__file__).resolve().parents[1]
# Encoder settings compared in one run (--variants; "ahead": batches queued on the device beyond
# the one the host waits for, encode_device._AHEAD; "cuda_graphs": the forward replayed as CUDA
# graphs per length bucket, encode_graphs). "old": tokenised by the Rust tokenizer, 4 batches ahead
# of the model, one batch queued (the pipeline of c4d8959, but with its first windows small);
# "rust": the Rust tokenizer a window ahead, two batches queued, the eager forward (the defaults of
# c3cf867); "words": that with ASCII texts through the word cache; "new": the defaults (the forward
# as CUDA graphs); "gwords": the defaults with the word cache (with graphs the thread running the
# model holds the GIL far less, which the word cache needs); "ahead1": the defaults with one batch
# queued.
VARIANTS: dict[str, dict] = {
    "old": {"word_cache": False, "prefetch": 4, "ahead": 1, "cuda_graphs": False},
    "rust": {"word_cache": False, "prefetch": None, "ahead": 2, "cuda_graphs": False},
    "words": {"word_cache": True, "prefetch": None, "ahead": 2, "cuda_graphs": False},
    "new": {"word_cache": False, "prefetch": None, "ahead": 2, "cuda_graphs": True},
    "gwords": {"word_cache": True, "prefetch": None, "ahead": 2, "cuda_graphs": True},
    "ahead1": {"word_cache": False, "prefetch": None, "ahead": 1, "cuda_graphs": True},
}
DEFAULT_VARIANTS = ["rust", "new", "gwords"]


def _apply(enc: SpladeEncoder, variant: dict) -> None:
    for key, value in variant.items():
        if key == "ahead":
            encode_device._AHEAD = value
        elif key == "cuda_graphs":
            # One graph set per encoder, kept across variants (captured once). On the CPU the same
            # bucketed forward runs without capture (the dry run exercises the padding).
            graphs = getattr(enc, "_bench_graphs", None) or enc._graphs
            if graphs is None and value:
                graphs = enc._bucketed(capture=enc.device.type == "cuda")
            enc._bench_graphs = graphs  # type: ignore[attr-defined]
            enc._graphs = graphs if value else None
        else:
            setattr(enc, key, value)


TINY_BASE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def _shared(*parts: str) -> Path | None:
    for base in (ROOT / "shared", ROOT.parent / "shared"):
        if (base.joinpath(*parts)).exists():
            return base.joinpath(*parts)
    return None


def passages(args: argparse.Namespace, tokenizer) -> tuple[list[str], str]:
    """``args.passages`` passages and a description of where they come from."""
    folders = [Path(d) for d in args.data] if args.data else [p for n in ("nfcorpus", "cisi", "cranfield")
                                                             if (p := _shared("data", n)) is not None]  # fmt: skip
    words: list[list[str]] = []
    for folder in folders:
        for text in read_beir(folder, require_qrels=False).corpus.texts:
            w = text.split()
            words.extend(w[i : i + args.passage_words] for i in range(0, len(w), args.passage_words))
    if words:
        source = f"{len(words):,} passages of <= {args.passage_words} words from " + ", ".join(f.name for f in folders)
    else:
        vocab = [t for t in tokenizer.get_vocab() if t.isalpha() and t.isascii()]
        rng = np.random.default_rng(0)
        p = 1.0 / np.arange(1, len(vocab) + 1)
        for _ in range(4096):
            words.append(list(rng.choice(vocab, size=int(rng.integers(20, args.passage_words + 1)), p=p / p.sum())))
        source = f"synthetic: 4,096 passages of 20..{args.passage_words} random vocabulary words (Zipf)"
    texts = [" ".join(words[i % len(words)]) for i in range(args.passages)]
    return texts, f"{source}, repeated to {args.passages:,}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device, *, release: bool = False) -> None:
    """Peaks from now on; ``release``: first hand PyTorch's cached, unused blocks back (the graphs'
    pool stays), so that a variant's reserved peak is its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if release:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> dict:
    out: dict = {}
    if device.type == "cuda":
        out["torch_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["torch_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if "cupy" in sys.modules:
        pool = sys.modules["cupy"].get_default_memory_pool()
        out["cupy_pool_total_bytes"] = int(pool.total_bytes())
    return out


def _device_batches(enc: SpladeEncoder, texts: list[str], max_length: int, buckets: bool) -> list[tuple]:
    """The encoder's batches of ``texts`` on its device: ``(ids, mask, shortest)``, each padded to
    its longest text or (``buckets``) to the encoder's length bucket."""
    tok = Tokenize(enc.tokenizer, max_length)
    pad_to = (lambda n: bucket_length(n, max_length)) if buckets else None
    out = []
    for tb in token_batches(texts, tok, enc.batch_size, window=enc.sort_window, pad_to=pad_to):
        ids = tb.input_ids.to(enc.device).long()
        mask = (torch.arange(ids.shape[1], device=enc.device)[None, :] < tb.lengths_t.to(enc.device)[:, None]).long()
        out.append((ids, mask, int(tb.lengths.min())))
    return out


def bare_forward(enc: SpladeEncoder, texts: list[str], max_length: int, reps: int) -> dict:
    """Seconds (best of ``reps``) over the encoder's batches of ``texts``, already on the device:
    ``bare_s``, ``model(ids, mask).logits`` eagerly (the issue's reference: the model's forward as
    a user runs it); ``bare_pool_s``, the encoder's eager forward (model and SPLADE pooling);
    ``bare_graphs_s``, the encoder's CUDA graphs on the same batches padded to its buckets (the
    device's share of ``encode`` but for the extraction of the non-zeros; ``None`` without graphs);
    and the padded tokens of each."""
    batches = _device_batches(enc, texts, max_length, buckets=False)
    graphs = getattr(enc, "_bench_graphs", None) or enc._graphs
    bucketed = _device_batches(enc, texts, max_length, buckets=True) if graphs is not None else []
    best = {"bare_s": float("inf"), "bare_pool_s": float("inf"), "bare_graphs_s": float("inf")}

    def model(ids, mask, shortest):
        with torch.autocast(enc.device.type, dtype=enc.autocast_dtype) if enc.autocast_dtype else nullcontext():
            return enc.model(input_ids=ids, attention_mask=mask).logits

    runs = [("bare_s", model, batches), ("bare_pool_s", enc._eager_forward, batches)]
    if graphs is not None:
        runs.append(("bare_graphs_s", graphs, bucketed))
    with torch.inference_mode():
        if graphs is not None:
            for ids, mask, shortest in bucketed:  # capture every bucket before timing
                graphs(ids, mask, shortest)
        for _ in range(reps):
            for name, forward, data in runs:
                _sync(enc.device)
                t0 = time.perf_counter()
                for ids, mask, shortest in data:
                    forward(ids, mask, shortest)
                _sync(enc.device)
                best[name] = min(best[name], time.perf_counter() - t0)
    return {
        **best,
        "bare_graphs_s": best["bare_graphs_s"] if graphs is not None else None,
        "padded_tokens": sum(int(ids.numel()) for ids, _, _ in batches),
        "bucket_padded_tokens": sum(int(ids.shape[1]) * enc.batch_size for ids, _, _ in bucketed) or None,
    }


def tokenize_only(enc: SpladeEncoder, texts: list[str]) -> float:
    """Seconds to tokenise, sort and pad ``texts`` into (pinned) batches in this thread: the host's ceiling."""
    tok = Tokenize(enc.tokenizer, enc.doc_max_length, word_cache=enc.word_cache)  # made before timing, as in encode
    t0 = time.perf_counter()
    for _ in token_batches(texts, tok, enc.batch_size, window=enc.sort_window, pin=enc.device.type == "cuda"):
        pass
    return time.perf_counter() - t0


class DeviceMarks:
    """CUDA events around each batch's forward (model and pooling) of an encoder, and at the
    start and end of the run: the device's time in the forwards, the gaps between forwards (the
    previous batch's extraction, the next batch's copy, and idleness), the time before the first
    forward and after the last one. Nothing on the CPU."""

    def __init__(self, enc: SpladeEncoder) -> None:
        self.enc, self.marks, self.on = enc, [], enc.device.type == "cuda"

    @staticmethod
    def _event() -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def __enter__(self) -> DeviceMarks:
        if self.on:
            forward = self.enc._forward

            def marked(ids, mask, shortest):
                start = self._event()
                out = forward(ids, mask, shortest)
                self.marks.append((start, self._event()))
                return out

            self.enc._forward = marked  # type: ignore[method-assign]
            self.begin = self._event()
        return self

    def __exit__(self, *exc) -> None:
        if self.on:
            self.end = self._event()
            del self.enc._forward  # the class's method again

    def summary(self) -> dict:
        if not self.on or not self.marks:
            return {}
        torch.cuda.synchronize(self.enc.device)
        spans = [(self.begin.elapsed_time(a) / 1e3, self.begin.elapsed_time(b) / 1e3) for a, b in self.marks]
        gaps = [spans[i][0] - spans[i - 1][1] for i in range(1, len(spans))]
        return {
            "forward_s": sum(b - a for a, b in spans),
            "gaps_s": sum(gaps),
            "max_gap_s": max(gaps, default=0.0),
            "before_first_s": spans[0][0],
            "after_last_s": self.begin.elapsed_time(self.end) / 1e3 - spans[-1][1],
            "batches": len(spans),
        }


def timed_encode(enc: SpladeEncoder, texts: list[str], prune_top: int | None, reps: int) -> dict:
    """The best of ``reps`` encodings: seconds, the collection, host seconds by stage, device marks."""
    best: dict = {"encode_s": float("inf")}
    times = []
    for _ in range(reps):
        stats = EncodeStats()
        _sync(enc.device)
        with DeviceMarks(enc) as marks:
            t0 = time.perf_counter()
            coll = enc.encode_documents(texts, prune_top=prune_top, stats=stats)
            _sync(enc.device)
            seconds = time.perf_counter() - t0
        times.append(seconds)
        if seconds < best["encode_s"]:
            best = {"encode_s": seconds, "coll": coll, "stages": stats.stages, "device": marks.summary()}
    best["encode_s_reps"] = times
    return best


def run_variants(enc: SpladeEncoder, texts: list[str], args, prune_top: int | None, bare_s: float) -> dict:
    """Each of ``args.variants`` (:data:`VARIANTS`) on the same texts: encode and tokenise alone."""
    out: dict = {}
    tokenize_s: dict[bool, float] = {}  # by word_cache: the variants share it
    for name in args.variants:
        _apply(enc, VARIANTS[name])
        _reset_peak(enc.device, release=True)
        r = timed_encode(enc, texts, prune_top, args.reps)
        if enc.word_cache not in tokenize_s:
            tokenize_s[enc.word_cache] = tokenize_only(enc, texts)
        tok_s = tokenize_s[enc.word_cache]
        out[name] = {
            "settings": VARIANTS[name],
            "encode_s": r["encode_s"],
            "encode_s_reps": r["encode_s_reps"],
            "encode_passages_per_s": len(texts) / r["encode_s"],
            "encode_over_bare": r["encode_s"] / bare_s,
            "tokenize_s": tok_s,
            "tokenize_passages_per_s": len(texts) / tok_s,
            "stages": r["stages"],
            "device": r["device"],
            "nnz": r["coll"].nnz,
            "memory": gpu_memory(enc.device),
            "cuda_graphs": enc.cuda_graph_stats,
        }
    _apply(enc, VARIANTS["new"])
    return out


def encode_vs_bare(name: str, enc: SpladeEncoder, texts: list[str], args, prune_top: int | None) -> dict:
    enc.encode_documents(texts[: enc.batch_size * 4], prune_top=prune_top)  # warm up kernels and allocator
    _apply(enc, VARIANTS["new"])
    _reset_peak(enc.device)
    bare = bare_forward(enc, texts, enc.doc_max_length, args.reps)
    bare_s, pool_s, padded_tokens = bare["bare_s"], bare["bare_pool_s"], bare["padded_tokens"]
    bare_peak = _peak(enc.device)
    _reset_peak(enc.device)
    variants = run_variants(enc, texts, args, prune_top, bare_s)
    nnz = [v["nnz"] for v in variants.values()]
    if max(nnz) - min(nnz) > 1e-3 * max(nnz):  # graphs pad to buckets: half-precision rounding may differ
        raise RuntimeError(f"{name}: the variants' vectors differ in their number of non-zeros: {nnz}")
    main = variants["new"] if "new" in variants else next(iter(variants.values()))
    row = {
        "part": name,
        "model": enc.name,
        "passages": len(texts),
        "batch_size": enc.batch_size,
        "max_length": enc.doc_max_length,
        "dtype": str(enc.autocast_dtype or torch.float32).removeprefix("torch."),
        "prune_top": prune_top,
        "padded_tokens": padded_tokens,
        "nnz": main["nnz"],
        "mean_nnz": main["nnz"] / len(texts),
        "bare_s": bare_s,
        "bare_passages_per_s": len(texts) / bare_s,
        "bare_pool_s": pool_s,
        "bare_pool_passages_per_s": len(texts) / pool_s,
        "bare_graphs_s": bare["bare_graphs_s"],
        "bare_graphs_passages_per_s": len(texts) / bare["bare_graphs_s"] if bare["bare_graphs_s"] else None,
        "bucket_padded_tokens": bare["bucket_padded_tokens"],
        "encode_s": main["encode_s"],
        "encode_passages_per_s": main["encode_passages_per_s"],
        "encode_over_bare": main["encode_s"] / bare_s,
        "tokenize_s": main["tokenize_s"],
        "tokenize_passages_per_s": main["tokenize_passages_per_s"],
        "variants": variants,
        "bare_memory": bare_peak,
        "encode_memory": _peak(enc.device),
        "cuda_graphs": enc.cuda_graph_stats,
    }
    print(f"{name}: encode {row['encode_passages_per_s']:,.0f}/s, bare {row['bare_passages_per_s']:,.0f}/s",
          file=sys.stderr, flush=True)  # fmt: skip
    return row


def end_to_end(enc: SpladeEncoder, texts: list[str], work: Path) -> dict:
    _reset_peak(enc.device)
    t0 = time.perf_counter()
    coll = enc.encode_documents(texts)
    t1 = time.perf_counter()
    index = Index.build(coll, device=enc.device)
    _sync(enc.device)
    t2 = time.perf_counter()
    memory = _peak(enc.device)
    n = index.n_docs
    del index
    timings = {}
    for name, write in (("write_npz", write_npz), ("write_bin", write_seismic_bin)):
        path = work / f"corpus.{name[-3:]}"
        s = time.perf_counter()
        write(coll, path)
        timings[f"{name}_s"] = time.perf_counter() - s
        timings[f"{name[-3:]}_bytes"] = path.stat().st_size
    s = time.perf_counter()
    back = read_vectors(work / "corpus.npz", enc.vocab, progress=False)
    timings["read_npz_s"] = time.perf_counter() - s
    if back.nnz != coll.nnz or not np.array_equal(back.values, coll.values):
        raise RuntimeError("the .npz file does not read back the encoded vectors")
    row = {
        "part": "e2e",
        "model": enc.name,
        "passages": len(texts),
        "indexed_docs": n,
        "postings": coll.nnz,
        "encode_s": t1 - t0,
        "index_s": t2 - t1,
        "total_s": t2 - t0,
        "passages_per_s": len(texts) / (t2 - t0),
        **timings,
        "memory": memory,
    }
    print(f"e2e: encode+index {row['passages_per_s']:,.0f}/s", file=sys.stderr, flush=True)
    return row


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    tiny = SpladeEncoder(args.tiny_model, device=device, batch_size=args.batch_size, doc_max_length=args.max_length)
    texts, source = passages(args, tiny.tokenizer)
    rows = [encode_vs_bare("tiny", tiny, texts, args, None)]
    with tempfile.TemporaryDirectory(prefix="gpusparse-encode-") as work:
        rows.append(end_to_end(tiny, texts, Path(work)))
    tiny.model.to("cpu")
    del tiny
    if device.type == "cuda":
        torch.cuda.empty_cache()
    overrides = TINY_BASE if args.tiny else {}
    base = SpladeEncoder(
        "random-bert-base" if not args.tiny else "random-bert-base(tiny sizes)",
        loaded=random_bert_base(args.tiny_model, **overrides),
        device=device,
        batch_size=args.base_batch_size,
        doc_max_length=args.max_length,
    )
    rows.append(encode_vs_bare("base", base, texts[: args.base_passages], args, args.base_prune_top))
    return {
        "benchmark": "encode",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "command": " ".join(sys.argv),
        "commit": args.commit,
        "versions": _versions(),
        "texts": source,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }


def _versions() -> dict:
    import tokenizers
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}  # fmt: skip


STAGES = ("tokenize", "pad", "wait_tokens", "launch", "wait_device", "host", "assemble")
DEVICE = ("forward_s", "gaps_s", "max_gap_s", "before_first_s", "after_last_s")


def table(result: dict) -> str:
    head = f"{'part':<5} {'passages':>9} {'encode/s':>10} {'bare/s':>10} {'enc/bare':>8} {'tok/s':>10}"
    lines = [f"{head} {'peak GB':>8}  model"]
    for r in result["rows"]:
        mem = r.get("encode_memory", r.get("memory", {})).get("torch_peak_allocated_bytes", 0) / 1e9
        if r["part"] == "e2e":
            lines.append(
                f"{'e2e':<5} {r['passages']:>9,} {r['passages_per_s']:>10,.0f} {'':>10} {'':>8} {'':>10} {mem:>8.2f}  "
                f"encode {r['encode_s']:.1f} s + index {r['index_s']:.2f} s; npz write {r['write_npz_s']:.2f} s, "
                f"read {r['read_npz_s']:.2f} s"
            )
        else:
            lines.append(
                f"{r['part']:<5} {r['passages']:>9,} {r['encode_passages_per_s']:>10,.0f} "
                f"{r['bare_passages_per_s']:>10,.0f} {r['encode_over_bare']:>8.2f} "
                f"{r['tokenize_passages_per_s']:>10,.0f} {mem:>8.2f}  {r['model']}"
            )
    lines.append(f"{result['card']}; {result['texts']}")
    lines.append("")
    lines.append(
        "where the time goes (s; host: the thread running the model, but tokenize/pad: the tokenising thread; "
        "device: CUDA events around each forward = model + pooling)"
    )
    host = " ".join(f"{s[:8]:>8}" for s in STAGES)
    device = " ".join(f"{d.removesuffix('_s')[:9]:>9}" for d in DEVICE)
    head = f"{'part':<5} {'variant':<7} {'encode/s':>9} {'enc/bare':>8} {'tok/s':>9} {'encode':>7}"
    lines.append(f"{head} | {host} | {device}")
    for r in result["rows"]:
        for name, v in r.get("variants", {}).items():
            st, dv = v["stages"], v["device"]
            host = " ".join(f"{st.get(s, 0.0):>8.3f}" for s in STAGES)
            device = " ".join(f"{dv[d]:>9.3f}" if d in dv else f"{'-':>9}" for d in DEVICE)
            lines.append(
                f"{r['part']:<5} {name:<7} {v['encode_passages_per_s']:>9,.0f} {v['encode_over_bare']:>8.2f} "
                f"{v['tokenize_passages_per_s']:>9,.0f} {v['encode_s']:>7.3f} | {host} | {device}"
            )
        if "bare_pool_s" in r:
            graphs = (
                f", graphs on bucket-padded batches {r['bare_graphs_s']:.3f} s "
                f"({r['bare_graphs_passages_per_s']:,.0f}/s)"
                if r.get("bare_graphs_s")
                else ""
            )
            lines.append(
                f"{r['part']:<5} {'bare':<7} model {r['bare_s']:.3f} s, model + pooling {r['bare_pool_s']:.3f} s "
                f"({r['bare_pool_passages_per_s']:,.0f}/s){graphs}"
            )
            for name, v in r.get("variants", {}).items():
                if v.get("memory") or v.get("cuda_graphs"):
                    mem = (v.get("memory") or {}).get("all_allocators", 0) / 1e9
                    g = v.get("cuda_graphs") or {}
                    lines.append(
                        f"{r['part']:<5} {name:<7} GPU peak {mem:.2f} GB (all allocators); "
                        f"graphs {g.get('graphs', '-')}, "
                        f"capture {g.get('capture_s', 0):.2f} s, eager batches {g.get('eager_batches', '-')}, "
                        f"failed: {g.get('failed')}; reps {', '.join(f'{x:.2f}' for x in v['encode_s_reps'])} s"
                    )
    return "\n".join(lines)


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"variants are {', '.join(VARIANTS)} (comma-separated), not {text!r}")
    return names


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny-model", type=Path, default=_shared("models", "splade-tiny"), help="splade-tiny's folder")
    p.add_argument("--data", nargs="*", help="BEIR folders for the passages (default: the shared ones)")
    p.add_argument("--passages", type=int, default=200_000)
    p.add_argument("--passage-words", type=int, default=60)
    p.add_argument("--base-passages", type=int, default=50_000)
    p.add_argument("--batch-size", type=int, default=512, help="splade-tiny's batch")
    p.add_argument("--base-batch-size", type=int, default=128)
    p.add_argument("--base-prune-top", type=int, default=256, help="random weights: keep this many per vector")
    p.add_argument("--max-length", type=int, default=256, help="tokens per passage")
    p.add_argument("--reps", type=int, default=2, help="timed repetitions (best of)")
    p.add_argument("--variants", type=_variants, default=DEFAULT_VARIANTS, help="encoder settings to compare: "
                   + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a seconds-long CPU run (tests)")
    p.add_argument("--out", default=None, help="folder for the result JSON (default: $OUT when set)")
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)
    if args.tiny_model is None:
        p.error("splade-tiny not found under ./shared or ../shared: give --tiny-model")
    if args.tiny:
        args.passages, args.base_passages, args.batch_size, args.base_batch_size = 40, 16, 8, 8
        args.max_length, args.reps = 32, 1
        if not args.data and (cranfield := _shared("data", "cranfield")) is not None:
            args.data = [str(cranfield)]
    result = run(args)
    out = args.out or os.environ.get("OUT")
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        card = result["card"].split(" (")[0].replace(" ", "-").lower()
        path = folder / f"{dt.date.today().isoformat()}-{card}-encode.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        result["path"] = str(path)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
