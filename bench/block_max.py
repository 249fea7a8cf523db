"""Does tile-level block-max pruning pay? (issue #23) — a CPU measurement, one command.

For every query ``q`` and document tile ``T`` (``2**bits`` consecutive documents of an
order), the block-max bound is ``UB(q, T) = Σ_t w_q[t] · max_{d ∈ T} w_d[t]`` (one maximum
per (tile, term)); it is ≥ every score in ``T``. A tile is *prunable* for ``q`` when
``UB(q, T) < θ`` (strictly: a document equal to θ may still enter by the id tie-break):

* final θ (best case): θ = the exact k-th score of ``q`` (float64, all documents);
* running θ: tiles visited in descending ``UB``; θ = the k-th best score of the tiles
  visited so far (``-inf`` until k documents were seen); once one tile prunes, every later
  one does (its bound is no higher, θ no lower);
* batch view: ``G`` queries share each tile pass (the batch-shared engine of #23); a tile is
  skipped only when *every* query of the group prunes it (groups of ``G`` consecutive
  queries of a shuffled query list; with a running θ, tiles are visited in descending
  maximum bound over the group).

Work is counted in tiles and in the postings a query reads in a tile (the postings of its
terms there); a skipped (group, tile) saves the postings of all its queries.

Collections: wordnet (`../shared/data/wordnet`, encoded with splade-tiny on the CPU by
:mod:`gpusparse.encode`; ``--held-out`` passages left out of the index, their gloss text is
one query set, the 626 shipped IR queries the other) under four orders — the original,
a random shuffle (unclustered), :func:`block_max_order.top_term_order` and
:func:`block_max_order.bp_order` — and the calibrated synthetic generator at the same size.

    python bench/block_max.py --out bench/results/NAME.json [--cache out/block_max]

The encoded vectors are cached (``--cache``); the JSON holds the environment, the command
and one record per (collection, query set, order, tile bits, k); a table is printed last.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import scipy
import scipy.sparse as sp

from block_max_order import bp_order, top_term_order

KS = (10, 1000)
GROUPS = (1, 8, 32, 256)


# -- bounds and thresholds (pure numpy; tested in tests/test_bench_block_max.py) ----------


def tile_maxima(docs: sp.csr_matrix, perm: np.ndarray, bits: int) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """``(bmax, count)``, both ``[n_tiles, V]``: per (tile, term) the largest weight and the
    number of postings, for documents laid out in the order ``perm``."""
    n, v = docs.shape
    pos = np.empty(n, dtype=np.int64)
    pos[perm] = np.arange(n)
    coo = docs.tocoo()
    tile = pos[coo.row] >> bits
    n_tiles = (n + (1 << bits) - 1) >> bits
    key = tile * v + coo.col.astype(np.int64)
    order = np.argsort(key, kind="stable")
    key_s = key[order]
    starts = np.flatnonzero(np.concatenate([[True], key_s[1:] != key_s[:-1]]))
    maxima = np.maximum.reduceat(coo.data[order].astype(np.float64), starts)
    counts = np.diff(np.concatenate([starts, [len(key_s)]])).astype(np.float64)
    uk = key_s[starts]
    shape = (n_tiles, v)
    bmax = sp.csr_matrix((maxima, (uk // v, uk % v)), shape=shape)
    count = sp.csr_matrix((counts, (uk // v, uk % v)), shape=shape)
    return bmax, count


def tile_bounds(queries: sp.csr_matrix, bmax: sp.csr_matrix) -> np.ndarray:
    """``UB[q, tile] = Σ_t w_q[t] · bmax[tile, t]`` in float64, ``[n_queries, n_tiles]``."""
    return np.asarray((queries.astype(np.float64) @ bmax.T).todense())


def tile_work(queries: sp.csr_matrix, count: sp.csr_matrix) -> np.ndarray:
    """Postings each query reads in each tile (its terms' postings there), ``[n_queries, n_tiles]``."""
    q = queries.copy()
    q.data = np.ones_like(q.data, dtype=np.float64)
    return np.asarray((q @ count.T).todense())


def per_tile_top(scores: np.ndarray, tile_of_doc: np.ndarray, n_tiles: int, k: int) -> list[np.ndarray]:
    """Each tile's ``k`` best positive scores, descending (``scores``: one query, all documents)."""
    nz = np.flatnonzero(scores > 0)
    s = scores[nz]
    t = tile_of_doc[nz]
    order = np.lexsort((-s, t))
    s, t = s[order], t[order]
    bounds = np.searchsorted(t, np.arange(n_tiles + 1))
    return [s[bounds[i] : min(bounds[i + 1], bounds[i] + k)] for i in range(n_tiles)]


def running_thresholds(tops: list[np.ndarray], visit: np.ndarray, ks: tuple[int, ...]) -> np.ndarray:
    """θ before each visit: ``out[j, i]`` = the ``ks[i]``-th best score of tiles ``visit[:j]``
    (``-inf`` while fewer were seen). Zero scores never count (a tile's zeros cannot raise θ
    above 0, and a bound is never below 0)."""
    kmax = max(ks)
    out = np.full((len(visit), len(ks)), -np.inf)
    best = np.zeros(0)
    for j, tile in enumerate(visit):
        for i, k in enumerate(ks):
            if len(best) >= k:
                out[j, i] = best[k - 1]
        if len(tops[tile]):
            best = np.sort(np.concatenate([best, tops[tile]]))[::-1][:kmax]
    return out


def kth_score(scores: np.ndarray, k: int) -> float:
    """The exact k-th best score (0 when fewer than k documents match; -inf when N < k)."""
    if len(scores) < k:
        return -np.inf
    return float(np.partition(scores, len(scores) - k)[len(scores) - k])


# -- data ------------------------------------------------------------------------------


def _save(path: Path, m: sp.csr_matrix) -> None:
    np.savez(path, indptr=m.indptr, indices=m.indices, data=m.data, shape=np.asarray(m.shape))


def _load(path: Path) -> sp.csr_matrix:
    z = np.load(path)
    return sp.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))


def _csr(coll) -> sp.csr_matrix:  # a SparseCollection
    return coll.to_scipy().astype(np.float32).tocsr()


def encode_wordnet(args: argparse.Namespace, cache: Path) -> dict:
    """Encode (or load from ``cache``) the wordnet documents and the two query sets."""
    meta_path = cache / "wordnet-encoding.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    from gpusparse.encode import EncodeStats, SpladeEncoder

    with gzip.open(Path(args.data) / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        corpus = [json.loads(line) for line in f]
    if args.docs:
        corpus = corpus[: args.docs]
    with open(Path(args.data) / "queries.jsonl", encoding="utf-8") as f:
        ir = [json.loads(line) for line in f]
    rng = np.random.default_rng(args.seed)
    held = np.sort(rng.choice(len(corpus), size=args.held_out, replace=False))
    keep = np.setdiff1d(np.arange(len(corpus)), held)
    enc = SpladeEncoder(args.model, device="cpu", batch_size=64)
    cache.mkdir(parents=True, exist_ok=True)
    meta: dict = {"model": str(args.model), "data": str(args.data), "held_out_seed": args.seed}
    texts = [r["title"] + " " + r["text"] for r in corpus]
    stats = EncodeStats()
    docs = []
    step = 10_000
    for a in range(0, len(keep), step):
        part = keep[a : a + step]
        docs.append(_csr(enc.encode_documents([texts[i] for i in part], stats=stats)))
        print(f"encoded {a + len(part)}/{len(keep)} documents, {stats.seconds:.0f} s", file=sys.stderr, flush=True)
    _save(cache / "wordnet-docs.npz", sp.vstack(docs, format="csr"))
    meta["docs"] = {"n": len(keep), **stats.as_dict(), "docs_per_s": len(keep) / stats.seconds}
    qsets = {
        "glosses": [corpus[i]["text"] for i in held],
        "ir": [r["text"] for r in ir],
    }
    meta["query_sets"] = {}
    for name, qtexts in qsets.items():
        qstats = EncodeStats()
        _save(cache / f"wordnet-q-{name}.npz", _csr(enc.encode_queries(qtexts, stats=qstats)))
        meta["query_sets"][name] = {"n": len(qtexts), **qstats.as_dict()}
    meta["held_out_ids"] = [corpus[i]["_id"] for i in held]
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def synthetic_collection(n_docs: int, n_queries: int, seed: int) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """The calibrated generator's documents and queries (:mod:`gpusparse.synthetic`) as CSR."""
    from gpusparse.synthetic import SyntheticSpec, generate

    spec = SyntheticSpec()
    out = []
    for indptr, terms, weights in generate(n_docs, n_queries, spec=spec, seed=seed):
        n = len(indptr) - 1
        out.append(sp.csr_matrix((weights.numpy(), terms.numpy(), indptr.numpy()), shape=(n, spec.n_terms)))
    return out[0], out[1]


def synthetic_cached(cache: Path, n_docs: int, n_queries: int, seed: int) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """:func:`synthetic_collection`, kept in ``cache`` under its size and seed."""
    paths = [cache / f"synthetic-{n_docs}-{n_queries}-{seed}-{part}.npz" for part in ("docs", "queries")]
    if not all(p.exists() for p in paths):
        cache.mkdir(parents=True, exist_ok=True)
        for path, m in zip(paths, synthetic_collection(n_docs, n_queries, seed), strict=True):
            _save(path, m)
    return _load(paths[0]), _load(paths[1])


# -- the measurement ---------------------------------------------------------------------


def _groups(n_queries: int, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Full groups of ``size`` queries of a shuffled list (``size`` 1: every query alone)."""
    if size == 1:
        return [np.array([q]) for q in range(n_queries)]
    shuffled = rng.permutation(n_queries)
    return [shuffled[a : a + size] for a in range(0, n_queries - size + 1, size)]


def measure(
    docs: sp.csr_matrix,
    queries: sp.csr_matrix,
    orders: dict[str, np.ndarray],
    bits_list: tuple[int, ...],
    *,
    ks: tuple[int, ...] = KS,
    groups: tuple[int, ...] = GROUPS,
    seed: int = 0,
    chunk: int = 64,
) -> tuple[list[dict], np.ndarray]:
    """One record per (order, tile bits, k) (see the module docstring), and the exact k-th
    scores ``theta[query, i]`` for ``ks[i]``."""
    n, nq = docs.shape[0], queries.shape[0]
    kmax = max(ks)
    layouts = {}
    for name, perm in orders.items():
        pos = np.empty(n, dtype=np.int64)
        pos[perm] = np.arange(n)
        for bits in bits_list:
            bmax, count = tile_maxima(docs, perm, bits)
            ub = tile_bounds(queries, bmax)
            work = tile_work(queries, count)
            visits = {}
            for g in groups:
                members = _groups(nq, g, np.random.default_rng(seed))
                visits[g] = [(m, np.argsort(-ub[m].max(axis=0), kind="stable")) for m in members]
            layouts[name, bits] = {
                "tile": pos >> bits,
                "n_tiles": bmax.shape[0],
                "ub": ub,
                "work": work,
                "tile_postings": np.asarray(count.sum(axis=1)).ravel(),
                "bmax_nnz": bmax.nnz,
                "visits": visits,
                "run": {g: np.zeros((len(ks), nq, bmax.shape[0]), dtype=bool) for g in groups},
            }
    theta = np.zeros((nq, len(ks)))
    d64 = docs.astype(np.float64).tocsr()
    q64 = queries.astype(np.float64).tocsr()
    # Which group (and position in it) each query belongs to, per group size.
    member_of = {g: {} for g in groups}
    for lay in layouts.values():
        for g in groups:
            for gi, (m, _) in enumerate(lay["visits"][g]):
                for q in m:
                    member_of[g][int(q)] = gi
        break
    worst_slack = np.inf
    for a in range(0, nq, chunk):
        scores = np.asarray(d64 @ q64[a : a + chunk].T.toarray())  # [N, c] float64
        for j in range(scores.shape[1]):
            q, s = a + j, scores[:, j]
            for i, k in enumerate(ks):
                theta[q, i] = kth_score(s, k)
            for lay in layouts.values():
                tops = per_tile_top(s, lay["tile"], lay["n_tiles"], kmax)
                tile_max = np.array([t[0] if len(t) else 0.0 for t in tops])
                worst_slack = min(worst_slack, float(np.min(lay["ub"][q] - tile_max)))
                for g in groups:
                    gi = member_of[g].get(q)
                    if gi is None:
                        continue
                    visit = lay["visits"][g][gi][1]
                    th = running_thresholds(tops, visit, ks)
                    for i in range(len(ks)):
                        lay["run"][g][i, q, visit] = lay["ub"][q, visit] < th[:, i]
    if worst_slack < -1e-9:
        raise AssertionError(f"a tile bound is below a score in its tile by {-worst_slack}")
    records = []
    for (name, bits), lay in layouts.items():
        ub, work = lay["ub"], lay["work"]
        for i, k in enumerate(ks):
            th = theta[:, i]
            final = ub < th[:, None]
            rec = {
                "order": name,
                "tile_bits": bits,
                "n_tiles": lay["n_tiles"],
                "k": k,
                "theta_median": float(np.median(th)),
                "bound_over_theta": _ratio_quantiles(ub, th),
                "tiles_untouched": float(np.mean(work == 0)),
                "bounds_nonzero": lay["bmax_nnz"],
                "groups": {},
            }
            for g in groups:
                rec["groups"][str(g)] = {
                    "final": _skip_shares(final, work, lay["visits"][g]),
                    "running": _skip_shares(lay["run"][g][i], work, lay["visits"][g]),
                    "n_groups": len(lay["visits"][g]),
                }
            records.append(rec)
    return records, theta


def measure_blocks(
    queries: sp.csr_matrix,
    docs: sp.csr_matrix,
    orders: dict[str, np.ndarray],
    bits_list: tuple[int, ...],
    theta: np.ndarray,
    *,
    ks: tuple[int, ...] = KS,
    groups: tuple[int, ...] = GROUPS,
    seed: int = 0,
) -> list[dict]:
    """Blocks finer than a tile (BMP's grain): the final-θ shares only (``theta`` from
    :func:`measure`), per query and per group, visiting no tiles."""
    records = []
    nq = queries.shape[0]
    for name, perm in orders.items():
        for bits in bits_list:
            bmax, count = tile_maxima(docs, perm, bits)
            ub = tile_bounds(queries, bmax)
            work = tile_work(queries, count)
            for i, k in enumerate(ks):
                final = ub < theta[:, i][:, None]
                rec = {
                    "order": name,
                    "block_bits": bits,
                    "n_blocks": bmax.shape[0],
                    "k": k,
                    "bound_over_theta": _ratio_quantiles(ub, theta[:, i]),
                    "blocks_untouched": float(np.mean(work == 0)),
                    "bounds_nonzero": bmax.nnz,
                    "groups": {
                        str(g): {"final": _skip_shares(final, work, [(m, None) for m in _groups(nq, g, _rng(seed))])}
                        for g in groups
                    },
                }
                records.append(rec)
    return records


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _ratio_quantiles(ub: np.ndarray, th: np.ndarray) -> dict[str, float]:
    """Quantiles over (query, touched tile) of UB / θ (queries with θ > 0)."""
    ok = th > 0
    r = ub[ok] / th[ok, None]
    r = r[ub[ok] > 0]
    if not len(r):
        return {}
    return {f"p{p}": float(np.percentile(r, p)) for p in (1, 10, 50, 90)}


def _skip_shares(pruned: np.ndarray, work: np.ndarray, groups: list) -> dict[str, float]:
    """Share of (group, tile) passes skipped (every member prunes the tile) and of the
    (query, posting) work they hold, touched tiles only (a tile without the group's terms
    costs nothing either way)."""
    skipped = touched = 0
    saved = total = 0.0
    for m, _ in groups:
        skip = pruned[m].all(axis=0)
        w = work[m].sum(axis=0)
        live = w > 0
        skipped += int(np.count_nonzero(skip & live))
        touched += int(np.count_nonzero(live))
        saved += float(w[skip].sum())
        total += float(w.sum())
    return {
        "tiles": skipped / touched if touched else 0.0,
        "postings": saved / total if total else 0.0,
    }


# -- the command -------------------------------------------------------------------------


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _env() -> dict:
    import torch

    return {
        "commit": _git_head(),
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cores (shared), CPU only",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "torch": torch.__version__,
    }


def _orders(docs: sp.csr_matrix, names: list[str], seed: int, leaf: int, iters: int, timing: dict) -> dict:
    out = {}
    for name in names:
        t0 = time.perf_counter()
        if name == "original":
            out[name] = np.arange(docs.shape[0])
        elif name == "random":
            out[name] = np.random.default_rng(seed).permutation(docs.shape[0])
        elif name == "top_term":
            out[name] = top_term_order(docs.indptr, docs.indices, docs.data)
        elif name == "bp":
            out[name] = bp_order(docs.indptr, docs.indices, docs.shape[1], leaf=leaf, iters=iters)
        else:
            raise ValueError(f"unknown order {name!r}")
        timing[name] = round(time.perf_counter() - t0, 2)
        print(f"order {name}: {timing[name]} s", file=sys.stderr, flush=True)
    return out


def _collection_stats(docs: sp.csr_matrix, queries: sp.csr_matrix) -> dict:
    return {
        "docs": docs.shape[0],
        "postings": int(docs.nnz),
        "doc_nnz_mean": docs.nnz / docs.shape[0],
        "queries": queries.shape[0],
        "query_nnz_mean": queries.nnz / queries.shape[0],
    }


def table(results: list[dict]) -> str:
    """The short table: skipped share of touched tiles / of postings, per query and per group."""
    head = "| collection | queries | order | tile | k | UB/θ p50 | per query final | per query running | "
    head += "8 running | 32 running | 256 final | 256 running |"
    lines = [head, "|" + "---|" * 12]
    for run in results:
        for r in run["records"]:
            g = r["groups"]

            def cell(size: str, kind: str, g=g) -> str:
                s = g[size][kind]
                return f"{100 * s['tiles']:.0f}% / {100 * s['postings']:.0f}%"

            lines.append(
                f"| {run['collection']} | {run['query_set']} | {r['order']} | 2^{r['tile_bits']} | {r['k']} | "
                f"{r['bound_over_theta'].get('p50', float('nan')):.2f} | {cell('1', 'final')} | "
                f"{cell('1', 'running')} | {cell('8', 'running')} | {cell('32', 'running')} | "
                f"{cell('256', 'final')} | {cell('256', 'running')} |"
            )
    lines += ["", "| collection | queries | order | block | k | UB/θ p50 | per query final | 8 final | 256 final |"]
    lines.append("|" + "---|" * 9)
    for run in results:
        for r in run.get("blocks", []):
            g = r["groups"]
            cells = " | ".join(
                f"{100 * g[size]['final']['tiles']:.0f}% / {100 * g[size]['final']['postings']:.0f}%"
                for size in ("1", "8", "256")
            )
            lines.append(
                f"| {run['collection']} | {run['query_set']} | {r['order']} | 2^{r['block_bits']} | {r['k']} | "
                f"{r['bound_over_theta'].get('p50', float('nan')):.2f} | {cells} |"
            )
    return "\n".join(lines)


def _part(
    args: argparse.Namespace,
    cache: Path,
    collection: str,
    qname: str,
    docs: sp.csr_matrix,
    queries: sp.csr_matrix,
    order_names: list[str],
    report: dict,
) -> dict:
    """The records of one (collection, query set), kept in ``cache`` under the settings that
    make them (a rerun with the same settings reuses them; delete the cache to redo)."""
    settings = {
        k: getattr(args, k)
        for k in ("docs", "held_out", "tile_bits", "block_bits", "bp_iters", "synthetic_queries", "seed")
    }
    settings.update(collection=collection, query_set=qname, orders=list(order_names))
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = cache / f"part-{collection}-{qname}-{key}.json"
    if path.exists():
        part = json.loads(path.read_text())
        report["order_seconds"].setdefault(collection, part["order_seconds"])
        return part
    bits = tuple(args.tile_bits)
    leaf = 1 << min(bits + tuple(args.block_bits))
    timing = report["order_seconds"].setdefault(collection, {})
    orders = _ORDERS_MEMO.get(collection) or _orders(docs, order_names, args.seed, leaf, args.bp_iters, timing)
    _ORDERS_MEMO[collection] = orders
    t0 = time.perf_counter()
    records, theta = measure(docs, queries, orders, bits, seed=args.seed)
    blocks = measure_blocks(queries, docs, orders, tuple(args.block_bits), theta, seed=args.seed)
    part = {
        "collection": collection,
        "query_set": qname,
        "stats": _collection_stats(docs, queries),
        "seconds": round(time.perf_counter() - t0, 1),
        "order_seconds": timing,
        "commit": _git_head(),
        "records": records,
        "blocks": blocks,
    }
    print(f"{collection}/{qname}: {part['seconds']} s", file=sys.stderr, flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(part))
    return part


_ORDERS_MEMO: dict[str, dict[str, np.ndarray]] = {}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--cache", default="out/block_max", help="folder for the encoded vectors and finished parts")
    p.add_argument("--data", default="../shared/data/wordnet")
    p.add_argument("--model", default="../shared/models/splade-tiny")
    p.add_argument("--docs", type=int, default=0, help="encode only this prefix of the corpus (0 = all)")
    p.add_argument("--held-out", type=int, default=512, help="passages left out, their glosses the queries")
    p.add_argument("--tile-bits", type=int, nargs="+", default=[11, 12, 13])
    p.add_argument("--block-bits", type=int, nargs="*", default=[6, 8], help="finer blocks: final θ only")
    p.add_argument("--orders", nargs="+", default=["original", "random", "top_term", "bp"])
    p.add_argument("--bp-iters", type=int, default=20)
    p.add_argument("--synthetic-queries", type=int, default=512, help="0: no synthetic collection")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    cache = Path(args.cache)
    report: dict = {"env": _env(), "args": vars(args), "order_seconds": {}}
    results = []
    if args.synthetic_queries:
        with gzip.open(Path(args.data) / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
            n_docs = sum(1 for _ in f)
        n_docs = (min(n_docs, args.docs) if args.docs else n_docs) - args.held_out
        t0 = time.perf_counter()
        sdocs, squeries = synthetic_cached(cache, n_docs, args.synthetic_queries, args.seed)
        report["synthetic_generate_seconds"] = round(time.perf_counter() - t0, 1)
        results.append(_part(args, cache, "synthetic", "synthetic", sdocs, squeries, ["original", "bp"], report))
    meta = encode_wordnet(args, cache)
    report["encoding"] = {k: v for k, v in meta.items() if k != "held_out_ids"}
    docs = _load(cache / "wordnet-docs.npz")
    for qname in ("glosses", "ir"):
        queries = _load(cache / f"wordnet-q-{qname}.npz")
        results.insert(-1 if args.synthetic_queries else len(results),
                       _part(args, cache, "wordnet", qname, docs, queries, args.orders, report))  # fmt: skip
    report["results"] = results
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
