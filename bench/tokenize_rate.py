"""The encoder's tokenisation alone, on the CPU: the Rust tokenizer against the word cache
(gpusparse.encode_wordpiece), both in the same run, per core and with all cores.

Passages as in bench/encode.py (nfcorpus, cisi, cranfield cut into <= 60 words). Each
variant is timed on ``token_batches`` (tokenise, sort, pad: the tokenising thread's work)
``--reps`` times, interleaved, best kept. The word cache is timed cold (a fresh tokenizer
copy: every word is new) and warm (the same texts again). "Per core": the Rust tokenizer's
thread pool set to one thread (RAYON_NUM_THREADS=1, before tokenizers is imported); the
word cache is single-threaded either way.

``--device-ms X`` also runs the encoder's pipeline (``prefetched`` token batches into
``sparse_batches``) against a fake device that takes X ms a batch (the host thread sleeps,
without the GIL, and torch runs on one thread), for the settings of bench/encode.py's
variants: tokenisation and model one after the other ("old": 4 batches ahead, one queued) or
side by side (a window ahead), with either tokenizer.

Usage: python bench/tokenize_rate.py [--passages 16384] [--threads 1] [--device-ms 12] [--out DIR]
Prints a table and, with --out, writes <date>-<host>-tokenize-rate.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=16384)
    p.add_argument("--passage-words", type=int, default=60)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="the Rust tokenizer's threads (default: all cores)")
    p.add_argument("--device-ms", type=float, default=None, help="also time the pipeline against a fake device")
    p.add_argument("--tiny-model", type=Path, default=None, help="splade-tiny's folder (default: the shared one)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads is not None:
        if "tokenizers" in sys.modules:
            raise SystemExit("--threads must be set before tokenizers is imported (run this as a script)")
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "bench"))
    from transformers import AutoTokenizer

    import encode as bench_encode  # bench/encode.py: the same passages
    from gpusparse.encode_tokens import Tokenize, token_batches

    model = args.tiny_model or bench_encode._shared("models", "splade-tiny")
    if model is None:
        raise SystemExit("splade-tiny not found under ./shared or ../shared: give --tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    args.data = None
    texts, source = bench_encode.passages(args, tokenizer)

    def timed(tok: Tokenize) -> float:
        t0 = time.perf_counter()
        for _ in token_batches(texts, tok, args.batch_size, window=16384):
            pass
        return time.perf_counter() - t0

    best: dict[str, float] = {}
    for _ in range(args.reps):
        rust = Tokenize(tokenizer, args.max_length, word_cache=False)
        cached = Tokenize(tokenizer, args.max_length)
        for name, seconds in (("rust", timed(rust)), ("cache_cold", timed(cached)), ("cache_warm", timed(cached))):
            best[name] = min(best.get(name, float("inf")), seconds)
    rates = {k: len(texts) / v for k, v in best.items()}
    result = {
        "benchmark": "tokenize-rate",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "command": " ".join(sys.argv),
        "texts": source,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "seconds": best,
        "passages_per_s": rates,
        "speedup_warm": rates["cache_warm"] / rates["rust"],
        "speedup_cold": rates["cache_cold"] / rates["rust"],
    }
    if args.device_ms is not None:
        result["pipeline"] = pipeline(args, tokenizer, texts)
    threads = args.threads or os.cpu_count()
    print(f"tokenise + sort + pad, {len(texts):,} passages, Rust tokenizer threads: {threads}")
    for k, v in rates.items():
        print(f"  {k:<11} {v:>10,.0f} passages/s  ({best[k]:.3f} s)")
    print(f"  word cache / Rust: {result['speedup_warm']:.1f}x warm, {result['speedup_cold']:.1f}x cold")
    for name, r in result.get("pipeline", {}).items():
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items())
        print(f"  pipeline {name:<5} {r['wall_s']:.2f} s against a device of {r['device_s']:.2f} s ({stages})")
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        tail = "" if args.device_ms is None else "-pipeline"
        path = folder / f"{dt.date.today().isoformat()}-cpu-tokenize-rate-{threads}t{tail}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        result["path"] = str(path)
    return result


def pipeline(args: argparse.Namespace, tokenizer, texts: list[str]) -> dict:
    """Wall seconds of the encoder's pipeline against a fake device, best of ``args.reps``."""
    import torch

    from gpusparse import encode_device
    from gpusparse.encode_device import sparse_batches
    from gpusparse.encode_tokens import DEFAULT_SORT_WINDOW, Tokenize, prefetched, token_batches

    torch.set_num_threads(1)  # the fake device's few CPU ops stay off the tokenising thread's core
    seconds = args.device_ms / 1e3

    def forward(ids, mask, shortest):
        time.sleep(seconds)
        out = torch.zeros(ids.shape[0], 64)
        out[:, 3] = 1.0
        return out

    window_ahead = -(-DEFAULT_SORT_WINDOW // args.batch_size) + 4
    settings = {"old": (False, 4, 1), "rust": (False, window_ahead, 2), "new": (True, window_ahead, 2)}
    out: dict = {}
    ahead = encode_device._AHEAD
    try:
        for _ in range(args.reps):
            for name, (word_cache, depth, queued) in settings.items():
                tok = Tokenize(tokenizer, args.max_length, word_cache=word_cache)
                encode_device._AHEAD = queued
                timer: dict[str, float] = {}
                t0 = time.perf_counter()
                batches = prefetched(token_batches(texts, tok, args.batch_size, timer=timer), depth=depth)
                n_batches = sum(1 for _ in sparse_batches(batches, forward, torch.device("cpu"), timer=timer))
                wall = time.perf_counter() - t0
                if name not in out or wall < out[name]["wall_s"]:
                    out[name] = {"wall_s": wall, "device_s": n_batches * seconds, "stages": timer}
    finally:
        encode_device._AHEAD = ahead
    return out


if __name__ == "__main__":
    main()
