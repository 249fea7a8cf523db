"""Encode a BEIR-layout collection with a SPLADE model into Anserini JsonVectorCollection files.

Each document and query becomes ``vec = max_t log(1 + relu(logits[t, :])) * mask[t]``: the
masked-LM logits of every token, passed through ``log1p(relu(.))``, zeroed at padding positions
and max-pooled over the sequence. Weights are rounded to ``--decimals`` places and those that
round to zero are dropped.

Writes, under ``--output``:

- ``corpus.jsonl.gz`` and ``queries.jsonl.gz``: one ``{"id", "contents", "vector"}`` object
  per line, in input order (``contents`` is left empty for documents to keep the file small);
- ``qrels.tsv``: ``qrels/test.tsv`` copied unchanged;
- ``README.md``: provenance, settings and statistics.

Example::

    python3 scripts/encode_sample.py --beir ../shared/data/cranfield \\
        --model ../shared/models/splade-tiny --output data/sample/cranfield
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import shutil
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForMaskedLM, AutoTokenizer, PreTrainedTokenizerBase


def read_jsonl(path: Path) -> list[dict]:
    """Read a JSON-lines file, skipping blank lines."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def check_unique_ids(ids: Sequence[str], path: Path) -> None:
    """Raise ``ValueError`` if ``ids`` holds a duplicate."""
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate _id values; ids must be unique")


def document_text(doc: dict) -> str:
    """Title and text joined by a space, or the text alone when the title is empty."""
    title = (doc.get("title") or "").strip()
    text = doc.get("text") or ""
    return f"{title} {text}" if title else text


@torch.inference_mode()
def splade_vectors(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """SPLADE max pooling: ``max_t log(1 + relu(logits[t])) * mask[t]``, shape (batch, vocab)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    weights = torch.log1p(torch.relu(logits)) * attention_mask.unsqueeze(-1).to(logits.dtype)
    return weights.amax(dim=1)


def encode(
    texts: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    model: torch.nn.Module,
    max_length: int,
    batch_size: int,
    decimals: int,
    desc: str,
) -> list[dict[str, float]]:
    """Encode ``texts`` into sparse ``{token: weight}`` dicts, returned in input order.

    Texts are sorted by tokenized length into batches so that little padding is computed.
    """
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    lengths = [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    vectors: list[dict[str, float] | None] = [None] * len(texts)
    with tqdm(total=len(texts), desc=desc, unit="text") as bar:
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            enc = tokenizer(
                [texts[i] for i in batch],
                truncation=True,
                max_length=max_length,
                padding=True,
                return_tensors="pt",
            )
            reps = splade_vectors(model, enc["input_ids"], enc["attention_mask"])
            for i, rep in zip(batch, reps, strict=True):
                (nonzero,) = torch.nonzero(rep, as_tuple=True)
                vector = {}
                for token_id, weight in zip(nonzero.tolist(), rep[nonzero].tolist(), strict=True):
                    rounded = round(weight, decimals)
                    if rounded != 0:
                        vector[vocab[token_id]] = rounded
                vectors[i] = vector
            bar.update(len(batch))
    return vectors  # type: ignore[return-value]


def write_jsonl_gz(path: Path, rows: Sequence[dict]) -> None:
    """Write ``rows`` as gzipped JSON lines; ``mtime=0`` makes the bytes reproducible."""
    with (
        path.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
    ):
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def nnz_stats(vectors: Sequence[dict[str, float]]) -> tuple[float, int]:
    """Mean and max number of non-zero weights per vector."""
    counts = [len(v) for v in vectors]
    return statistics.fmean(counts), max(counts)


def write_readme(
    path: Path,
    args: argparse.Namespace,
    stats: dict[str, tuple[float, int]],
    counts: dict[str, int],
    command: str,
) -> None:
    """Describe where the files came from and how they were made."""
    doc_mean, doc_max = stats["corpus"]
    query_mean, query_max = stats["queries"]
    path.write_text(
        f"""# {args.beir.name}: SPLADE vectors (sample data)

Anserini `JsonVectorCollection` files: one `{{"id", "contents", "vector"}}` object per line,
gzipped, in the input order of the source files.

- Source collection: `{args.beir.name}` (BEIR layout: `corpus.jsonl`, `queries.jsonl`,
  `qrels/test.tsv`); document text is `title + " " + text` (text alone if no title).
- Model: `{args.model.name}` (`AutoModelForMaskedLM`, float32 on CPU).
- Formula: `vec = max_t log(1 + relu(logits[t, :])) * attention_mask[t]` (SPLADE max pooling).
- Max lengths (tokens, including [CLS]/[SEP]; longer texts are truncated):
  documents {args.doc_max_length}, queries {args.query_max_length}.
- Weights rounded to {args.decimals} decimals; weights that round to 0 are dropped.
  Keys are token strings from the model's vocabulary.
- `contents` is empty for documents (to keep the file small) and holds the text for queries.
- `qrels.tsv`: `qrels/test.tsv` copied unchanged.

| file | vectors | mean non-zeros | max non-zeros |
|---|---:|---:|---:|
| `corpus.jsonl.gz` | {counts["corpus"]} | {doc_mean:.1f} | {doc_max} |
| `queries.jsonl.gz` | {counts["queries"]} | {query_mean:.1f} | {query_max} |

Made with (from the repository root):

```
{command}
```
""",
        encoding="utf-8",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beir", type=Path, required=True, help="BEIR collection folder")
    parser.add_argument("--model", type=Path, required=True, help="local HF SPLADE model folder")
    parser.add_argument("--output", type=Path, required=True, help="folder to write into")
    parser.add_argument("--doc-max-length", type=int, default=256)
    parser.add_argument("--query-max-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--decimals", type=int, default=4)
    args = parser.parse_args(argv)
    for name in ("doc_max_length", "query_max_length", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.decimals < 0:
        parser.error("--decimals must be non-negative")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    corpus_path = args.beir / "corpus.jsonl"
    queries_path = args.beir / "queries.jsonl"
    qrels_path = args.beir / "qrels" / "test.tsv"
    for path in (corpus_path, queries_path, qrels_path):
        if not path.is_file():
            sys.exit(f"error: {path} not found")

    docs = read_jsonl(corpus_path)
    queries = read_jsonl(queries_path)
    doc_ids = [str(d["_id"]) for d in docs]
    query_ids = [str(q["_id"]) for q in queries]
    check_unique_ids(doc_ids, corpus_path)
    check_unique_ids(query_ids, queries_path)
    doc_texts = [document_text(d) for d in docs]
    query_texts = [q["text"] for q in queries]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForMaskedLM.from_pretrained(args.model, dtype=torch.float32).eval()

    doc_vectors = encode(
        doc_texts,
        tokenizer,
        model,
        args.doc_max_length,
        args.batch_size,
        args.decimals,
        "documents",
    )
    query_vectors = encode(
        query_texts,
        tokenizer,
        model,
        args.query_max_length,
        args.batch_size,
        args.decimals,
        "queries",
    )

    args.output.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(
        args.output / "corpus.jsonl.gz",
        [{"id": i, "contents": "", "vector": v} for i, v in zip(doc_ids, doc_vectors, strict=True)],
    )
    write_jsonl_gz(
        args.output / "queries.jsonl.gz",
        [{"id": i, "contents": t, "vector": v} for i, t, v in zip(query_ids, query_texts, query_vectors, strict=True)],
    )
    shutil.copyfile(qrels_path, args.output / "qrels.tsv")

    stats = {"corpus": nnz_stats(doc_vectors), "queries": nnz_stats(query_vectors)}
    counts = {"corpus": len(doc_vectors), "queries": len(query_vectors)}
    command = shlex.join(["python3", *sys.argv])
    write_readme(args.output / "README.md", args, stats, counts, command)

    print(f"wrote {args.output}/")
    for name in ("corpus", "queries"):
        mean, peak = stats[name]
        size = (args.output / f"{name}.jsonl.gz").stat().st_size
        print(f"  {name}.jsonl.gz: {counts[name]} vectors, non-zeros mean {mean:.1f} max {peak}, {size / 1e6:.2f} MB")
    print("  qrels.tsv, README.md")


if __name__ == "__main__":
    main()
