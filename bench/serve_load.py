"""Load generator for ``gpusparse serve``: latency and throughput against offered load.

Starts the server in a child process on this machine (a seeded synthetic SPLADE-like
collection, ``gpusparse.synthetic``, indexed on ``--device``), then offers open-loop
Poisson traffic at each rate of ``--rates`` (one query per request, ``--k`` results) for
``--duration`` seconds, and records per rate: p50/p90/p99 latency of the answered (200)
requests, measured from each request's scheduled arrival; achieved throughput (200s per
second); 429s and other statuses; requests still unanswered when the step's time ran out;
how late the client sent (its own lag, so a generator that cannot keep up shows it); and,
from the server's ``/metrics``, the batches formed (count, mean size, size histogram) and
the server's own mean latency.

Time is bounded: each step gets ``--duration`` plus ``--drain`` seconds, after which
unanswered requests are abandoned and counted as ``unfinished``; the whole run (server
start included) stops starting steps once ``--time-budget`` would be exceeded, and says
so. The JSON file is rewritten after every step, so a run cut off keeps what it measured.
A table is printed last.

    python bench/serve_load.py --docs 1000000 --device cuda --rates 100,300,1000,3000 \\
        --out bench/results/DATE-GPU-serve-load.json

A CPU dry run (20,000 documents, low rates, a small queue so that 429s show):
``python bench/serve_load.py --dry-run --out /tmp/serve-load.json``.

The client is one asyncio process with a minimal HTTP/1.1 keep-alive client over a fixed
pool of ``--max-conn`` connections (requests wait for a free connection in FIFO order; that
wait is part of their latency). It is not httpx: httpx's connection pool scans every waiting
request on each change (quadratic), which at ~500 waiting requests costs more CPU per
request than the server spends, so an earlier run measured the client's collapse.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib.metadata
import json
import os
import platform
import random
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

DRY_RUN = {
    "docs": 20_000,
    "queries": 500,
    "device": "cpu",
    "rates": "20,200,1500",
    "duration": 4.0,
    "drain": 6.0,
    "queue_size": 64,
    "max_batch_size": 32,
    "max_conn": 256,
    "time_budget": 120.0,
}


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


# -- the client -----------------------------------------------------------------------------


def http_request(body: dict) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = "POST /search HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(data)}\r\n\r\n".encode() + data


async def exchange(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes) -> tuple[int, bool]:
    """Send one request, read its whole response: ``(status, keep the connection)``."""
    reader, writer = conn
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length, keep = 0, True
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection" and value.strip().lower() == b"close":
            keep = False
    await reader.readexactly(length)
    return status, keep


class Connections:
    """Up to ``size`` keep-alive connections, opened on demand, reused last-in first-out.

    Requests that find none free wait in FIFO order. LIFO reuse keeps the busy connections
    warm and lets the others idle out (uvicorn closes a connection idle for 5 s).
    """

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size, self.opened = port, size, 0
        self.idle: list = []
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def get(self):
        if self.idle:
            return self.idle.pop()
        if self.opened >= self.size:
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            conn = await fut
            if conn is not None:
                return conn
        self.opened += 1  # a free slot, or one handed over by drop()
        try:
            return await asyncio.open_connection("127.0.0.1", self.port)
        except BaseException:
            self.opened -= 1
            raise

    def put(self, conn) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        self.idle.append(conn)

    def drop(self, conn) -> None:
        conn[1].close()
        self.opened -= 1
        while self.waiters:  # the first waiter may open a new one in its place
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def offer(port: int, requests: list[bytes], rate: float, duration: float, drain: float, max_conn: int, seed: int):
    """Open-loop Poisson arrivals at ``rate`` per second for ``duration`` s; stop waiting ``drain`` s later."""
    rng = random.Random(seed)
    conns = Connections(port, max_conn)
    latencies: list[float] = []  # of 200s, from the scheduled arrival
    lags: list[float] = []  # from the scheduled arrival to the request's bytes being written
    codes: dict[str, int] = {}
    last_done = [0.0]

    async def one(request: bytes, scheduled: float) -> None:
        conn = await conns.get()
        lags.append(time.perf_counter() - scheduled)
        for attempt in (1, 2):
            try:
                status, keep = await exchange(conn, request)
                code = str(status)
                break
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                code, keep = type(exc).__name__, False
                if attempt == 1 and isinstance(exc, (ConnectionError, asyncio.IncompleteReadError)):
                    # A reused connection the server had closed as idle: once more on a new one.
                    conns.drop(conn)
                    conn = await conns.get()
                    continue
                break
            except asyncio.CancelledError:
                conns.drop(conn)
                raise
        done = time.perf_counter()
        codes[code] = codes.get(code, 0) + 1
        if code == "200":
            latencies.append(done - scheduled)
            last_done[0] = done
        if keep:
            conns.put(conn)
        else:
            conns.drop(conn)

    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    next_at = start
    while next_at < start + duration:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(requests[rng.randrange(len(requests))], next_at)))
        next_at += rng.expovariate(rate)
    sent_for = time.perf_counter() - start
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, start + duration + drain - time.perf_counter()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    conns.close()

    def pct(values: list[float], p: float) -> float | None:
        values = sorted(values)
        return round(values[min(len(values) - 1, int(p / 100 * len(values)))] * 1000, 3) if values else None

    span = last_done[0] - start
    return {
        "target_qps": rate,
        "offered_qps": round(len(tasks) / sent_for, 1),
        "requests": len(tasks),
        "answered_200": len(latencies),
        "throughput_qps": round(len(latencies) / span, 1) if span > 0 else 0.0,
        "p50_ms": pct(latencies, 50),
        "p90_ms": pct(latencies, 90),
        "p99_ms": pct(latencies, 99),
        "max_ms": pct(latencies, 100),
        "status": codes,
        "n_429": codes.get("429", 0),
        "unfinished": len(pending),
        "client_lag_p50_ms": pct(lags, 50),
        "client_lag_p99_ms": pct(lags, 99),
    }


# -- the server's side ----------------------------------------------------------------------


def scrape(url: str) -> dict[str, float] | None:
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def server_side(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """What the server saw during a step, from two scrapes of ``/metrics``."""
    if before is None or after is None:
        return {"server": None}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    n_batches = delta("gpusparse_batch_size_count")
    n_lat = delta("gpusparse_request_latency_seconds_count")
    prefix = 'gpusparse_batch_size_bucket{le="'
    cumulative = [(k[len(prefix) : -2], delta(k)) for k in after if k.startswith(prefix)]
    histogram, below = {}, 0.0
    for le, c in cumulative:  # Prometheus buckets are cumulative: per-bucket counts
        if c - below:
            histogram[le] = int(c - below)
        below = c
    statuses = {k.split('"')[1]: int(delta(k)) for k in after if k.startswith("gpusparse_requests_total{") and delta(k)}
    return {
        "server_requests": statuses,
        "server_mean_ms": round(delta("gpusparse_request_latency_seconds_sum") / n_lat * 1000, 3) if n_lat else None,
        "batches": int(n_batches),
        "mean_batch_size": round(delta("gpusparse_batch_size_sum") / n_batches, 2) if n_batches else None,
        "batch_size_histogram": histogram,  # upper bound of the bucket -> batches
    }


def machine(device: str) -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
    }
    packages = ("fastapi", "uvicorn", "starlette", "pydantic", "httptools", "uvloop", "cupy-cuda12x", "cupy-cuda13x")
    for package in packages:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[package] = importlib.metadata.version(package)
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    return info


def table(rows: list[dict]) -> str:
    cols = [
        ("target/s", "target_qps"),
        ("offered/s", "offered_qps"),
        ("200/s", "throughput_qps"),
        ("p50 ms", "p50_ms"),
        ("p99 ms", "p99_ms"),
        ("429", "n_429"),
        ("unfinished", "unfinished"),
        ("other", "other"),
        ("lag p99 ms", "client_lag_p99_ms"),
        ("batch mean", "mean_batch_size"),
        ("server ms", "server_mean_ms"),
    ]
    lines = ["  ".join(f"{h:>10}" for h, _ in cols)]
    for r in rows:
        r = {**r, "other": sum(n for c, n in r["status"].items() if c not in ("200", "429"))}
        lines.append("  ".join(f"{'-' if r.get(k) is None else r[k]:>10}" for _, k in cols))
    return "\n".join(lines)


def main() -> None:
    t_start = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=2000, help="size of the query pool")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--rates", default="100,300,1000,3000", help="offered loads, requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate")
    p.add_argument("--drain", type=float, default=10.0, help="seconds a step waits for answers after its arrivals")
    p.add_argument("--time-budget", type=float, default=225.0, help="seconds for the whole run, server start included")
    p.add_argument(
        "--max-conn",
        type=int,
        default=2048,
        help="client connections at most; above the server's queue + batch, so that overload reaches it",
    )
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--queue-size", type=int, default=1024)
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="serve-load.json")
    p.add_argument("--commit", help="the git commit run (default: git rev-parse HEAD, if the checkout has history)")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--dry-run", action="store_true", help="a quick CPU check: " + json.dumps(DRY_RUN))
    p.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--query-file", help=argparse.SUPPRESS)
    if p.parse_known_args()[0].dry_run:
        p.set_defaults(**DRY_RUN)  # defaults only: options given on the command line still win
    args = p.parse_args()
    if args.serve_only:
        serve_synthetic(args)
        return

    import httpx

    # Thousands of connections: raise this process's (and the server child's) open-file limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * args.max_conn + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    out = Path(args.out)
    query_file = out.with_suffix(".queries.tmp.json")
    child = [__file__, "--serve-only", "--port", str(port), "--query-file", str(query_file)]
    for key in ("docs", "queries", "device", "kernel", "max_batch_size", "max_wait_ms", "queue_size", "seed"):
        child += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    child += ["--request-timeout", str(args.request_timeout)]
    result = {
        "what": "gpusparse serve: latency and throughput against offered load (open-loop Poisson, 1 query/request)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(args.device) | ({"commit": args.commit} if args.commit else {}),
        "settings": {k: v for k, v in vars(args).items() if k not in ("serve_only", "port", "query_file")},
        "complete": False,
        "rows": [],
    }

    def save(**extra) -> None:
        result.update(extra)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)

    def left() -> float:
        return args.time_budget - (time.monotonic() - t_start)

    server = subprocess.Popen([sys.executable, *child])
    try:
        deadline = time.monotonic() + min(args.startup_timeout, left())
        while True:
            if server.poll() is not None:
                sys.exit(f"the server exited with status {server.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200 and query_file.exists():
                    break
            if time.monotonic() > deadline:
                save(stopped="the server did not start in time")
                sys.exit("the server did not start in time")
            time.sleep(0.5)
        result["startup_s"] = round(time.monotonic() - t_start, 1)
        pool = json.loads(query_file.read_text())
        requests = [http_request({"query": q, "k": args.k}) for q in pool]
        # The first search may compile kernels: wait for it, then a short warm-up at a low rate.
        httpx.post(f"{url}/search", json={"query": pool[0], "k": args.k}, timeout=max(5.0, left() - 30))
        asyncio.run(offer(port, requests, 20, 2.0, 5.0, 8, args.seed + 1))
        save()
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            if left() < args.duration + args.drain + 5:
                save(stopped=f"time budget: no time left for the {rate:g}/s step and those after it")
                print(result["stopped"], flush=True)
                break
            before = scrape(url)
            row = asyncio.run(offer(port, requests, rate, args.duration, args.drain, args.max_conn, args.seed + 2 + i))
            time.sleep(0.5)  # let the server settle its metrics for abandoned requests
            row.update(server_side(before, scrape(url)))
            result["rows"].append(row)
            save()
            print(json.dumps(row), flush=True)
        else:
            result["complete"] = True
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        query_file.unlink(missing_ok=True)
    save(total_s=round(time.monotonic() - t_start, 1))
    print(f"wrote {out}")
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
