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

from gpusparse import Index, read_vectors
from gpusparse.beir import read_beir
from gpusparse.collection import SparseCollection
from gpusparse.encode import SpladeEncoder, random_bert_base
from gpusparse.encode_tokens import Tokenize, token_batches
from gpusparse.vector_writers import write_seismic_bin
from gpusparse.vectors_npz import write_npz

ROOT = Path(__file__).resolve().parents[1]
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


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
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


def bare_forward(enc: SpladeEncoder, texts: list[str], max_length: int, reps: int) -> tuple[float, int]:
    """Seconds of ``model(ids, mask).logits`` over the encoder's batches of ``texts``, already on the device."""
    tok = Tokenize(enc.tokenizer, max_length)
    batches = []
    tokens = 0
    for tb in token_batches(texts, tok, enc.batch_size, window=enc.sort_window):
        ids = tb.input_ids.to(enc.device).long()
        mask = (torch.arange(ids.shape[1], device=enc.device)[None, :] < tb.lengths_t.to(enc.device)[:, None]).long()
        batches.append((ids, mask))
        tokens += int(ids.numel())
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            _sync(enc.device)
            t0 = time.perf_counter()
            for ids, mask in batches:
                with torch.autocast(enc.device.type, dtype=enc.autocast_dtype) if enc.autocast_dtype else nullcontext():
                    enc.model(input_ids=ids, attention_mask=mask).logits  # noqa: B018 (the forward pass is the point)
            _sync(enc.device)
            best = min(best, time.perf_counter() - t0)
    return best, tokens


def tokenize_only(enc: SpladeEncoder, texts: list[str]) -> float:
    """Seconds to tokenise, sort and pad ``texts`` into (pinned) batches in this thread: the host's ceiling."""
    tok = Tokenize(enc.tokenizer, enc.doc_max_length)  # its tokenizer copy is made before timing, as in encode
    t0 = time.perf_counter()
    for _ in token_batches(texts, tok, enc.batch_size, window=enc.sort_window, pin=enc.device.type == "cuda"):
        pass
    return time.perf_counter() - t0


def timed_encode(
    enc: SpladeEncoder, texts: list[str], prune_top: int | None, reps: int
) -> tuple[float, SparseCollection]:
    best, coll = float("inf"), None
    for _ in range(reps):
        _sync(enc.device)
        t0 = time.perf_counter()
        coll = enc.encode_documents(texts, prune_top=prune_top)
        _sync(enc.device)
        best = min(best, time.perf_counter() - t0)
    return best, coll  # type: ignore[return-value]


def encode_vs_bare(name: str, enc: SpladeEncoder, texts: list[str], args, prune_top: int | None) -> dict:
    enc.encode_documents(texts[: enc.batch_size * 4], prune_top=prune_top)  # warm up kernels and allocator
    _reset_peak(enc.device)
    bare_s, padded_tokens = bare_forward(enc, texts, enc.doc_max_length, args.reps)
    bare_peak = _peak(enc.device)
    _reset_peak(enc.device)
    enc_s, coll = timed_encode(enc, texts, prune_top, args.reps)
    tok_s = tokenize_only(enc, texts)
    row = {
        "part": name,
        "model": enc.name,
        "passages": len(texts),
        "batch_size": enc.batch_size,
        "max_length": enc.doc_max_length,
        "dtype": str(enc.autocast_dtype or torch.float32).removeprefix("torch."),
        "prune_top": prune_top,
        "padded_tokens": padded_tokens,
        "nnz": coll.nnz,
        "mean_nnz": coll.nnz / len(texts),
        "bare_s": bare_s,
        "bare_passages_per_s": len(texts) / bare_s,
        "encode_s": enc_s,
        "encode_passages_per_s": len(texts) / enc_s,
        "encode_over_bare": enc_s / bare_s,
        "tokenize_s": tok_s,
        "tokenize_passages_per_s": len(texts) / tok_s,
        "bare_memory": bare_peak,
        "encode_memory": _peak(enc.device),
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
    return "\n".join(lines)


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
