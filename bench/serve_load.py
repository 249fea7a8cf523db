"""Load generator for ``gpusparse serve``: latency and throughput against offered load.

Starts the server in a child process on this machine (a seeded synthetic SPLADE-like
collection, ``gpusparse.synthetic``, indexed on ``--device``), then offers open-loop
Poisson traffic at each rate of ``--rates`` (one query per request, ``--k`` results) for
``--duration`` seconds and records, per rate: p50/p90/p99 latency of the answered
requests, throughput (answered per second), 429s, errors, and the mean batch size the
server formed (from ``/metrics``). Results go to a JSON file with the machine, versions
and settings.

    python bench/serve_load.py --docs 1000000 --device cuda --rates 100,300,1000,3000,10000 \\
        --duration 10 --out bench/results/DATE-GPU-serve-load.json

A quick CPU check: ``python bench/serve_load.py --docs 20000 --rates 20,50 --duration 3``.
The client is one asyncio process (httpx); at rates it cannot offer, ``offered_qps``
(measured) falls short of ``target_qps`` and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from pathlib import Path


def serve_synthetic(args: argparse.Namespace) -> None:
    """Child: build the synthetic index, write the query pool, serve until terminated."""
    import torch

    from gpusparse import Index, Vocabulary
    from gpusparse.serve import create_app, serve
    from gpusparse.synthetic import generate

    t0 = time.perf_counter()
    vocab = Vocabulary.bert()
    (dp, dt, dw), (qp, qt, qw) = generate(args.docs, args.queries, seed=args.seed, device=args.device)
    index = Index.from_csr(dp, dt, dw, vocab, device=args.device)
    del dp, dt, dw
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    qp, qt, qw = qp.cpu().numpy(), qt.cpu().numpy(), qw.cpu().numpy()
    pool = [
        {vocab.token(int(t)): float(w) for t, w in zip(qt[qp[i] : qp[i + 1]], qw[qp[i] : qp[i + 1]], strict=True)}
        for i in range(len(qp) - 1)
    ]
    Path(args.query_file).write_text(json.dumps(pool))
    print(f"built {args.docs:,} documents on {args.device} in {time.perf_counter() - t0:.1f} s", flush=True)
    app = create_app(
        index,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        queue_size=args.queue_size,
        request_timeout_s=args.request_timeout,
        search_kwargs={"kernel": args.kernel},
    )
    serve(app, host="127.0.0.1", port=args.port, log_level="warning")


async def offer(url: str, pool: list[dict], rate: float, duration: float, k: int, max_conn: int, seed: int) -> dict:
    """Open-loop Poisson arrivals at ``rate`` per second for ``duration`` seconds."""
    import httpx

    rng = random.Random(seed)
    latencies: list[float] = []
    codes: dict[str, int] = {}
    finished: list[float] = []
    limits = httpx.Limits(max_connections=max_conn, max_keepalive_connections=max_conn)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one(query: dict) -> None:
            t = time.perf_counter()
            try:
                r = await client.post("/search", json={"query": query, "k": k})
                code = str(r.status_code)
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            done = time.perf_counter()
            codes[code] = codes.get(code, 0) + 1
            if code == "200":
                latencies.append(done - t)
                finished.append(done)

        tasks = []
        start = time.perf_counter()
        next_at = start
        while next_at < start + duration:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(pool[rng.randrange(len(pool))])))
            next_at += rng.expovariate(rate)
        sent_for = time.perf_counter() - start
        await asyncio.gather(*tasks)
    lat = sorted(latencies)

    def pct(p: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1000, 3) if lat else None

    span = (max(finished) - start) if finished else 0.0
    return {
        "target_qps": rate,
        "offered_qps": round(len(tasks) / sent_for, 1),
        "requests": len(tasks),
        "answered": len(lat),
        "throughput_qps": round(len(lat) / span, 1) if span > 0 else 0.0,
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "max_ms": round(lat[-1] * 1000, 3) if lat else None,
        "status": codes,
    }


def scrape(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def machine(device: str) -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=2000, help="size of the query pool")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--rates", default="100,300,1000,3000,10000", help="offered loads, requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    p.add_argument("--max-conn", type=int, default=256, help="client connections at most")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--queue-size", type=int, default=1024)
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="serve-load.json")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--query-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_only:
        serve_synthetic(args)
        return

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    query_file = Path(args.out).with_suffix(".queries.tmp.json")
    child_args = [*sys.argv[1:], "--serve-only", "--port", str(port), "--query-file", str(query_file)]
    server = subprocess.Popen([sys.executable, __file__, *child_args])
    try:
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if server.poll() is not None:
                sys.exit(f"the server exited with status {server.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit("the server did not start in time")
            time.sleep(0.5)
        pool = json.loads(query_file.read_text())
        asyncio.run(offer(url, pool, 20, 2.0, args.k, 8, args.seed + 1))  # warm-up
        rows = []
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            before = scrape(url)
            row = asyncio.run(offer(url, pool, rate, args.duration, args.k, args.max_conn, args.seed + 2 + i))
            after = scrape(url)
            n_batches = after["gpusparse_batch_size_count"] - before["gpusparse_batch_size_count"]
            n_queries = after["gpusparse_batch_size_sum"] - before["gpusparse_batch_size_sum"]
            n_lat = after["gpusparse_request_latency_seconds_count"] - before["gpusparse_request_latency_seconds_count"]
            t_lat = after["gpusparse_request_latency_seconds_sum"] - before["gpusparse_request_latency_seconds_sum"]
            # Inside the server (validation, queue, batch, answer): what the client adds is the rest.
            row["server_mean_ms"] = round(t_lat / n_lat * 1000, 3) if n_lat else None
            row["batches"] = int(n_batches)
            row["mean_batch_size"] = round(n_queries / n_batches, 2) if n_batches else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.terminate()
        server.wait(60)
        query_file.unlink(missing_ok=True)
    result = {
        "what": "gpusparse serve: latency and throughput against offered load (open-loop Poisson, 1 query/request)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(args.device),
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("serve_only", "port", "query_file", "startup_timeout")
        },
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
