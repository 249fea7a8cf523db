"""The shared test collections and the splade-tiny model (``../shared`` beside the repository).

Tests that need them skip cleanly when the folder is absent. ``GPUSPARSE_SHARED`` points
elsewhere. Models are loaded once per test session (``functools.cache``).
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("GPUSPARSE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
SPLADE_TINY = SHARED / "models" / "splade-tiny"
DATA = SHARED / "data"

needs_shared = pytest.mark.skipif(
    not (SPLADE_TINY / "config.json").is_file() or not (DATA / "cranfield").is_dir(),
    reason=f"shared model and data not found under {SHARED}",
)


@cache
def tiny_encoder(**settings: object):  # -> SpladeEncoder
    """A splade-tiny :class:`~gpusparse.encode.SpladeEncoder` on the CPU (cached per settings)."""
    from gpusparse.encode import SpladeEncoder

    return SpladeEncoder(SPLADE_TINY, device="cpu", **settings)


@cache
def tiny_transformers():
    """``(tokenizer, model)`` loaded with plain transformers, independently of the encoder."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(SPLADE_TINY), AutoModelForMaskedLM.from_pretrained(SPLADE_TINY).eval()


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def cranfield_slice(n_docs: int = 60) -> tuple[list[dict], list[dict], list[tuple[str, str, int]]]:
    """The first ``n_docs`` Cranfield documents, the queries judged on them, and those judgments."""
    docs = read_jsonl(DATA / "cranfield" / "corpus.jsonl")[:n_docs]
    keep = {d["_id"] for d in docs}
    qrels = []
    with (DATA / "cranfield" / "qrels" / "test.tsv").open(encoding="utf-8") as f:
        next(f)
        for line in f:
            q, d, g = line.split()
            if d in keep:
                qrels.append((q, d, int(g)))
    judged = {q for q, _, _ in qrels}
    queries = [q for q in read_jsonl(DATA / "cranfield" / "queries.jsonl") if q["_id"] in judged]
    return docs, queries, qrels


def write_beir(folder: Path, docs: list[dict], queries: list[dict], qrels: list[tuple[str, str, int]]) -> Path:
    """Write a BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv)."""
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with (folder / "corpus.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with (folder / "queries.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(q) + "\n" for q in queries)
    with (folder / "qrels" / "test.tsv").open("w", encoding="utf-8") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        f.writelines(f"{q}\t{d}\t{g}\n" for q, d, g in qrels)
    return folder
