"""The encoder's tokenisation alone, on the CPU: the Rust tokenizer against the word cache
(gpusparse.encode_wordpiece), both in the same run, per core and with all cores.

Passages as in bench/encode.py (nfcorpus, cisi, cranfield cut into <= 60 words). Each
variant is timed on ``token_batches`` (tokenise, sort, pad: the tokenising thread's work)
``--reps`` times, interleaved, best kept. The word cache is timed cold (a fresh tokenizer
copy: every word is new) and warm (the same texts again). "Per core": the Rust tokenizer's
thread pool set to one thread (RAYON_NUM_THREADS=1, before tokenizers is imported); the
word cache is single-threaded either way.

Usage: python bench/tokenize_rate.py [--passages 16384] [--threads 1] [--out DIR]
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
    threads = args.threads or os.cpu_count()
    print(f"tokenise + sort + pad, {len(texts):,} passages, Rust tokenizer threads: {threads}")
    for k, v in rates.items():
        print(f"  {k:<11} {v:>10,.0f} passages/s  ({best[k]:.3f} s)")
    print(f"  word cache / Rust: {result['speedup_warm']:.1f}x warm, {result['speedup_cold']:.1f}x cold")
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{dt.date.today().isoformat()}-cpu-tokenize-rate-{threads}t.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        result["path"] = str(path)
    return result


if __name__ == "__main__":
    main()
