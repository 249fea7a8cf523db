"""The host's share of a small search on a GPU, part by part (issue 23: batch 1, host to host).

Usage (GPU machine): python bench/host_parts.py [--n-docs 1000000] [--batch 1] [--k 10] [--quantize 8] [--out F]

Each step of ``Index.search``'s host path is called on its own in a loop (median host µs, no
profiler in the way), then the whole search host to host; the steps are the ones the tiled
engine's graphed path takes, in order. The JSON holds the card, the index and the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.config import engine_config
from gpusparse.engines import choose
from gpusparse.engines.base import SearchPlan
from gpusparse.engines.tiled.engine import graphed_batch_search, layout_for_search
from gpusparse.engines.tiled.fixed_point import choose_acc, fixed_point_host, integer_weights_host
from gpusparse.engines.tiled.graphs import query_width
from gpusparse.layout.statistics import max_scores_host
from gpusparse.queries import padded_host, prepare_queries
from gpusparse.search import check_search_args, complete_later, plan_chunks
from gpusparse.synthetic import generate
from host_primitives import host_us


def _us(fn, reps: int = 500, sync: bool = False) -> float:
    return host_us(fn, reps, sync)


def parts(index: Index, queries: SparseCollection, k: int) -> dict:
    dev = index.device
    idx = index.resident_on(dev)
    ms = max_scores_host(idx)
    q = prepare_queries(queries, idx.vocab, idx.quantization, ms)
    acc = choose_acc(None)
    layout = layout_for_search(idx, acc=acc)
    terms, weights, lengths = padded_host(q, query_width)
    params = fixed_point_host(idx, terms, weights, lengths, acc, layout.weight_bits)
    eng = choose("auto", dev)
    plan = SearchPlan(doc_chunk=idx.n_docs, to_host=True)
    out = {
        "engine_config": _us(engine_config),
        "check_search_args": _us(lambda: check_search_args(k, None, None)),
        "choose_auto": _us(lambda: choose("auto", dev)),
        "resident_on": _us(lambda: index.resident_on(dev)),
        "max_scores_host": _us(lambda: max_scores_host(idx)),
        "prepare_queries": _us(lambda: prepare_queries(queries, idx.vocab, idx.quantization, ms)),
        "plan_chunks": _us(lambda: plan_chunks(len(q), idx.n_docs, 1 << 30, None)),
        "padded_host": _us(lambda: padded_host(q, query_width)),
        "layout_for_search": _us(lambda: layout_for_search(idx, acc=acc)),
        "fixed_point_host": _us(lambda: fixed_point_host(idx, terms, weights, lengths, acc, layout.weight_bits)),
        "integer_weights_host": _us(lambda: integer_weights_host(layout, weights, params["scale"], acc)),
        "get_device_properties": _us(lambda: torch.cuda.get_device_properties(dev)),
        "graphed_batch_search_launch": _us(lambda: graphed_batch_search(idx, q, k, to_host=True).host.take()),
        "engine_search_batch_and_take": _us(lambda: complete_later(eng.search_batch(idx, q, k, plan))(), sync=True),
        "Index.search": _us(lambda: index.search(queries, k), sync=True),
    }
    out.update(graph_parts(idx, q, k, terms, weights, params))
    return out


def graph_parts(idx, q, k: int, terms, weights, params) -> dict:
    """The graphed path's own steps: a slot, filling its staging buffer, the replay, the event."""
    from gpusparse.engines.tiled import graphs

    graphed_batch_search(idx, q, k, to_host=True).host.take()
    entry = next(e for e in reversed(idx.derived.graphs.values()) if e)
    slot = entry.slots[0]
    dev_index = entry.device_index
    out = {
        "graph.slot": _us(entry.slot),
        "graph.fill": _us(lambda: graphs._fill(slot.views, terms, weights)),
        "graph.replay": _us(slot.graph.replay),
        "graph.raw_stream": _us(lambda: graphs.raw_stream(dev_index)),
        "graph.event_record": _us(lambda: slot.done.record(graphs.raw_stream(dev_index))),
        "graph.event_query": _us(slot.done.query),
    }
    slot.pending = None
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n-docs", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--quantize", type=int, nargs="+", default=[0, 8])
    p.add_argument("--out", default=None)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args()
    vocab = Vocabulary.bert()
    (di, dt_, dw), (qi, qt, qw) = generate(args.n_docs, args.batch, seed=0, device="cuda")
    queries = SparseCollection(qi.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy(), vocab=vocab)
    res = {"card": torch.cuda.get_device_name(0), "commit": args.commit, "command": " ".join(sys.argv),
           "n_docs": args.n_docs, "batch": args.batch, "k": args.k, "rows": {}}  # fmt: skip
    for qbits in args.quantize:
        index = Index.from_csr(di, dt_, dw, vocab, device="cuda", quantize=qbits or None)
        name = "8-bit" if qbits else "float32"
        res["rows"][name] = parts(index, queries, args.k)
        del index
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    names = list(next(iter(res["rows"].values())))
    print(f"{'µs':32}" + "".join(f"{n:>10}" for n in res["rows"]))
    for n in names:
        print(f"{n:32}" + "".join(f"{r[n]:10.1f}" for r in res["rows"].values()))


if __name__ == "__main__":
    main()
