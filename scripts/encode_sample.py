"""Make the shipped sample: a BEIR collection encoded with GPUSparse's SPLADE encoder.

A thin wrapper over ``gpusparse.encode.SpladeEncoder`` (the same code as ``gpusparse
encode``) that writes small files and a README describing them. Under ``--output``:

- ``corpus.jsonl.gz`` and ``queries.jsonl.gz``: JsonVectorCollection records
  ``{"id", "contents", "vector"}`` in input order, weights rounded to ``--decimals``
  places (those that round to zero left out), ``contents`` empty for documents;
  gzipped without a timestamp, so the same vectors give the same bytes;
- ``qrels.tsv``: ``qrels/test.tsv`` copied unchanged;
- ``README.md``: provenance, settings and statistics.

Example (from the repository root)::

    python3 scripts/encode_sample.py --beir ../shared/data/cranfield \\
        --model ../shared/models/splade-tiny --output data/sample/cranfield

``gpusparse encode BEIR_DIR --model M -o DIR --decimals 4 --contents queries`` writes the
same vector files (plus ``encoding.json``).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from gpusparse import read_vectors
from gpusparse.beir import read_beir
from gpusparse.encode import EncodeStats, SpladeEncoder
from gpusparse.vector_writers import write_jsonl


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


def readme(args: argparse.Namespace, rows: list[tuple[str, int, float, int]], truncated: dict[str, int]) -> str:
    table = "\n".join(f"| `{name}` | {n} | {mean:.1f} | {peak} |" for name, n, mean, peak in rows)
    command = shlex.join(["python3", *sys.argv])
    return f"""# {args.beir.name}: SPLADE vectors (sample data)

Anserini `JsonVectorCollection` files: one `{{"id", "contents", "vector"}}` object per line,
gzipped, in the input order of the source files.

- Source collection: `{args.beir.name}` (BEIR layout: `corpus.jsonl`, `queries.jsonl`,
  `qrels/test.tsv`); document text is `title + " " + text` (text alone if no title).
- Encoder: GPUSparse's `SpladeEncoder` (`gpusparse.encode`, the code behind `gpusparse encode`)
  with the model `{args.model.name}` (`AutoModelForMaskedLM`, float32 on CPU).
- Formula: `vec = max_t log(1 + relu(logits[t, :])) * attention_mask[t]` (SPLADE max pooling).
- Max lengths (tokens, including [CLS]/[SEP]; longer texts are truncated):
  documents {args.doc_max_length} ({truncated["corpus"]} truncated), queries {args.query_max_length}
  ({truncated["queries"]} truncated).
- Weights rounded to {args.decimals} decimals; weights that round to 0 are dropped.
  Keys are token strings from the model's vocabulary.
- `contents` is empty for documents (to keep the file small) and holds the text for queries.
- `qrels.tsv`: `qrels/test.tsv` copied unchanged.

| file | vectors | mean non-zeros | max non-zeros |
|---|---:|---:|---:|
{table}

Made with (from the repository root):

```
{command}
```
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    beir = read_beir(args.beir)
    encoder = SpladeEncoder(
        args.model,
        query_max_length=args.query_max_length,
        doc_max_length=args.doc_max_length,
        batch_size=args.batch_size,
        device="cpu",
        dtype="float32",
    )
    args.output.mkdir(parents=True, exist_ok=True)
    rows, truncated = [], {}
    for name, texts, kind, keep_text in (
        ("corpus", beir.corpus, "document", False),
        ("queries", beir.queries, "query", True),
    ):
        stats = EncodeStats()
        coll = encoder.encode(texts.texts, texts.ids, kind=kind, progress=True, stats=stats)
        print(stats.summary(), file=sys.stderr)
        path = args.output / f"{name}.jsonl.gz"
        write_jsonl(coll, path, contents=texts.texts if keep_text else None, decimals=args.decimals)
        # Statistics of what was written (after rounding), as a reader will see it.
        written = read_vectors(path, encoder.vocab, progress=False).stats()
        rows.append((path.name, written.n_vectors, written.mean_nnz, written.max_nnz))
        truncated[name] = stats.truncated
        print(f"  {path}: {written.n_vectors} vectors, {path.stat().st_size / 1e6:.2f} MB", file=sys.stderr)
    shutil.copyfile(beir.qrels_path, args.output / "qrels.tsv")
    (args.output / "README.md").write_text(readme(args, rows, truncated), encoding="utf-8")
    print(f"wrote {args.output}/ (corpus.jsonl.gz, queries.jsonl.gz, qrels.tsv, README.md)", file=sys.stderr)


if __name__ == "__main__":
    main()
