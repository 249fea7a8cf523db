"""Abuse load test for ``gpusparse serve``: slow and large uploads beside normal traffic, on loopback.

Starts ``gpusparse serve INDEX`` (the real command) in a child process on 127.0.0.1 and runs,
per server (``--server-src``, repeatable: e.g. an old checkout's ``src`` and this one's):

1. ``baseline``: normal traffic only — open-loop Poisson requests at ``--rate`` per second,
   one query of the sample's queries each (``serve_load.offer``), for ``--baseline`` s;
2. ``large``: the same normal traffic for ``--large`` s beside the large-body clients alone;
3. ``abuse``: the same normal traffic for ``--abuse`` s, beside ``--slow-clients``
   connections that send headers and then trickle their body a byte a second (each
   reconnects when the server closes it), and ``--large-clients`` loops that send a
   ``--large-mb`` MB JSON body again and again;
4. ``shutdown``: SIGTERM while the slow clients are still connected; the time until the
   server process exits (killed after ``--shutdown-wait`` s).

It records, per phase, the normal requests' p50/p99 latency and statuses, and throughout,
the server process's RSS (``/proc/PID/status``, every 0.25 s). The abusers connect from
other loopback source addresses (127.0.0.2, 127.0.0.3): every socket targets 127.0.0.1, and
the server's per-address connection cap sees them as other clients, as it would on a network.

Every loop is bounded in count and time; one server's run takes about
``1 + baseline + large + abuse + shutdown-wait + start-up`` seconds (under 60 s with the defaults).

    python -m gpusparse.cli index data/sample/cranfield/corpus.jsonl.gz -o /tmp/cran-idx
    python bench/serve_abuse.py /tmp/cran-idx --server-src /tmp/old/src --server-src src \\
        --out bench/results/2026-11-26-cpu-serve-abuse.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import serve_load  # bench/serve_load.py: the open-loop client and the machine description

HERE = Path(__file__).resolve().parent
QUERIES = HERE.parent / "data" / "sample" / "cranfield" / "queries.jsonl.gz"
SLOW_SOURCE, LARGE_SOURCE = "127.0.0.2", "127.0.0.3"


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def sample_rss(pid: int, t0: float, out: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        value = rss_mb(pid)
        if value is not None:
            out.append([round(time.perf_counter() - t0, 2), value])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


def head(length: int) -> bytes:
    return (
        "POST /search HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


async def first_status(reader: asyncio.StreamReader, timeout: float) -> str:
    """The status code of the first answer, or what ended the wait."""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    except TimeoutError:
        return "no answer"
    except (ConnectionError, OSError):
        return "reset"
    return line[9:12].decode() if line.startswith(b"HTTP/1.1 ") else "closed"


async def slow_client(port: int, until: float, counts: dict) -> None:
    """Trickle a body a byte a second; reconnect whenever the server closes the connection."""
    while time.perf_counter() < until:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(SLOW_SOURCE, 0))
        except OSError:
            counts["connect_failed"] = counts.get("connect_failed", 0) + 1
            await asyncio.sleep(0.5)
            continue
        counts["connections"] = counts.get("connections", 0) + 1
        answer = asyncio.create_task(first_status(reader, until - time.perf_counter() + 30))
        try:
            writer.write(head(2000) + b'{"query": {"w')
            while not answer.done() and time.perf_counter() < until:
                await asyncio.wait({answer}, timeout=1.0)
                if not answer.done():
                    writer.write(b" ")
        except (ConnectionError, OSError):
            pass
        if answer.done():
            status = answer.result()
            counts[status] = counts.get(status, 0) + 1
            writer.close()
            await asyncio.sleep(1.0)  # a client that retries, not one that hammers
        else:  # the phase is over: stay connected, stalled, for the shutdown measure
            counts["still_stalled"] = counts.get("still_stalled", 0) + 1
            counts.setdefault("_held", []).append((writer, answer))
            return


async def large_client(port: int, body: bytes, until: float, counts: dict) -> None:
    """Send ``body`` (tens of MB of JSON) again and again, one at a time."""
    while time.perf_counter() < until:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(LARGE_SOURCE, 0))
        except OSError:
            counts["connect_failed"] = counts.get("connect_failed", 0) + 1
            await asyncio.sleep(0.5)
            continue
        writer.write(head(len(body)) + body)  # buffered; the answer may come before it is all sent
        status = await first_status(reader, max(1.0, until - time.perf_counter() + 10))
        counts[status] = counts.get(status, 0) + 1
        writer.transport.abort()  # do not keep sending what the server refused
        await asyncio.sleep(0.3)


def start_server(args: argparse.Namespace, src: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": src}
    # Not `python -m gpusparse.cli`: cli.py's __main__ block comes before the serve command is defined.
    launcher = "import sys; from gpusparse.cli import main; sys.argv[0] = 'gpusparse'; main()"
    cmd = [sys.executable, "-c", launcher, "serve", args.index, "--device", "cpu", "--port", str(port)]
    cmd += ["--max-batch-size", str(args.max_batch_size), "--queue-size", str(args.queue_size)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read() if server.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not start in time")


async def run_phases(args: argparse.Namespace, port: int, pid: int, requests: list[bytes], large: bytes) -> dict:
    t0 = time.perf_counter()
    rss: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, t0, rss, stop))
    out: dict = {}
    # Warm-up (first searches allocate and initialise): a second of low-rate traffic, not recorded.
    await serve_load.offer(port, requests, 10, 1.0, 5.0, 4, args.seed + 7)
    normal = await serve_load.offer(port, requests, args.rate, args.baseline, 5.0, args.max_conn, args.seed)
    out["baseline"] = normal | {"ended_s": round(time.perf_counter() - t0, 2)}
    # Large bodies alone first: with slow clients beside them an old server's admission may
    # refuse them (429) before reading them, hiding what reading them costs.
    until = time.perf_counter() + args.large
    large_counts: dict = {}
    started = round(time.perf_counter() - t0, 2)
    results = await asyncio.gather(
        serve_load.offer(port, requests, args.rate, args.large, 5.0, args.max_conn, args.seed + 2),
        *[large_client(port, large, until, large_counts) for _ in range(args.large_clients)],
    )
    out["large"] = results[0] | {
        "started_s": started,
        "ended_s": round(time.perf_counter() - t0, 2),
        "large_clients": large_counts,
    }
    until = time.perf_counter() + args.abuse
    slow_counts: dict = {}
    large_counts: dict = {}
    abusers = [slow_client(port, until, slow_counts) for _ in range(args.slow_clients)]
    abusers += [large_client(port, large, until, large_counts) for _ in range(args.large_clients)]
    started = round(time.perf_counter() - t0, 2)
    results = await asyncio.gather(
        serve_load.offer(port, requests, args.rate, args.abuse, 5.0, args.max_conn, args.seed + 1), *abusers
    )
    held = slow_counts.pop("_held", [])
    out["abuse"] = results[0] | {
        "started_s": started,
        "ended_s": round(time.perf_counter() - t0, 2),
        "slow_clients": slow_counts,
        "large_clients": large_counts,
    }
    stop.set()
    await sampler
    out["rss_mb"] = rss
    out["_held"] = held
    return out


def one_server(args: argparse.Namespace, src: str, requests: list[bytes], large: bytes) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    commit = subprocess.run(
        ["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    t_start = time.monotonic()
    server = start_server(args, src, port)
    try:
        wait_healthy(port, server, 60)
        startup = round(time.monotonic() - t_start, 1)
        loop = asyncio.new_event_loop()
        try:
            out = loop.run_until_complete(run_phases(args, port, server.pid, requests, large))
            held = out.pop("_held")
            # SIGTERM with the slow clients still stalled mid-body.
            t = time.monotonic()
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(args.shutdown_wait)
                shutdown = {"exited_after_s": round(time.monotonic() - t, 2), "returncode": server.returncode}
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
                shutdown = {"exited_after_s": None, "killed_after_s": args.shutdown_wait}
            shutdown["stalled_uploads_at_sigterm"] = len(held)
            # What the stalled uploads were told (read now: this loop was idle while we waited).
            if held:
                loop.run_until_complete(asyncio.wait([a for _, a in held], timeout=2))
            answers: dict = {}
            for writer, answer in held:
                status = answer.result() if answer.done() else "no answer"
                answers[status] = answers.get(status, 0) + 1
                writer.transport.abort()
            loop.run_until_complete(asyncio.sleep(0.1))
            shutdown["their_answers"] = answers
        finally:
            loop.close()
        log = server.stderr.read() if server.stderr else ""
        shutdown["tracebacks_logged"] = log.count("Traceback")
        shutdown["exceptions_in_asgi_logged"] = log.count("Exception in ASGI application")
        out["shutdown"] = shutdown
        peak = max((v for _, v in out["rss_mb"]), default=None)
        return {"server_src": src, "commit": commit, "startup_s": startup, "peak_rss_mb": peak, **out}
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("index", help="an index folder (gpusparse index ...)")
    p.add_argument("--server-src", action="append", help="PYTHONPATH of a server to test (repeatable) [src]")
    p.add_argument("--rate", type=float, default=40.0, help="normal requests per second")
    p.add_argument("--max-conn", type=int, default=32, help="normal traffic's connections at most")
    p.add_argument("--baseline", type=float, default=5.0, help="seconds of normal traffic alone")
    p.add_argument("--large", type=float, default=8.0, help="seconds of normal traffic beside the large bodies")
    p.add_argument("--abuse", type=float, default=12.0, help="seconds of normal traffic beside all the abusers")
    p.add_argument("--slow-clients", type=int, default=200)
    p.add_argument("--large-clients", type=int, default=4)
    p.add_argument("--large-mb", type=float, default=20.0)
    p.add_argument("--shutdown-wait", type=float, default=15.0, help="seconds after SIGTERM before SIGKILL")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--queue-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="serve-abuse.json")
    args = p.parse_args()
    sources = args.server_src or [str(HERE.parent / "src")]
    with gzip.open(QUERIES, "rt") as f:
        pool = [json.loads(line)["vector"] for line in f if line.strip()]
    requests = [serve_load.http_request({"query": q, "k": 10}) for q in pool]
    one = json.dumps(pool[0], separators=(",", ":")).encode()
    n = max(1, int(args.large_mb * 1e6 / (len(one) + 1)))
    large = b'{"queries":[' + b",".join([one] * n) + b'],"k":10}'
    result = {
        "what": "gpusparse serve under abuse on loopback: slow-body and large-body clients beside normal traffic",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": serve_load.machine("cpu"),
        "settings": vars(args) | {"large_body_bytes": len(large)},
        "runs": [],
    }
    for src in sources:
        run = one_server(args, src, requests, large)
        result["runs"].append(run)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        for phase in ("baseline", "large", "abuse"):
            row = {k: run[phase][k] for k in ("p50_ms", "p99_ms", "status")}
            print(json.dumps({"commit": run["commit"][:8], "phase": phase, **row}), flush=True)
        print(json.dumps({"peak_rss_mb": run["peak_rss_mb"], "shutdown": run["shutdown"]}), flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
