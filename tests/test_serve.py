"""The search server: exact answers under concurrent load, batching, backpressure, errors, shutdown.

Real-socket tests run uvicorn on 127.0.0.1 (a free port) in a background thread; the
quick validation tests use Starlette's TestClient. Every wait is bounded.
"""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from gpusparse import Index, SparseCollection, Vocabulary, read_vectors  # noqa: E402
from gpusparse.errors import InputError  # noqa: E402
from gpusparse.serve import DynamicBatcher, PendingRequest, canonical_vector, create_app, search_requests  # noqa: E402
from gpusparse.serve.run import build_server  # noqa: E402

from .shared_data import SPLADE_TINY, needs_shared, tiny_encoder  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"
JSON_TYPE = {"content-type": "application/json"}
LOCAL = "http://localhost"  # TestClient's base URL: a Host the server allows by default


@cache
def cranfield() -> tuple[Index, list[dict[str, float]]]:
    """The shipped Cranfield sample indexed, and its queries as {token: weight} dicts."""
    index = Index.build(read_vectors(SAMPLE / "corpus.jsonl.gz"))
    queries = read_vectors(SAMPLE / "queries.jsonl.gz", index.vocab)
    return index, [queries.row(i) for i in range(len(queries))]


class SlowIndex:
    """An index whose searches take at least ``delay`` seconds (to fill the queue)."""

    def __init__(self, index: Index, delay: float, gate: threading.Event | None = None) -> None:
        self._index, self.delay, self.gate = index, delay, gate
        self.vocab, self.n_docs, self.ids, self.device = index.vocab, index.n_docs, index.ids, index.device
        self.batch_sizes: list[int] = []

    def search(self, queries, k, **kwargs):
        self.batch_sizes.append(len(queries))
        if self.gate is not None:
            self.gate.wait(20)
        time.sleep(self.delay)
        return self._index.search(queries, k, **kwargs)


class LiveServer:
    """uvicorn serving ``app`` on a free loopback port, in a thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # The server `gpusparse serve` runs: per-client connection cap, draining shutdown.
        self.server = build_server(app, log_level="warning", timeout_graceful_shutdown=10, backlog=512)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        if self.thread.is_alive():
            raise RuntimeError("the server did not stop")

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive():
            self.stop()
        self.sock.close()


def expected(index: Index, queries: list[dict[str, float]], k: int) -> list[dict]:
    """What the server must answer: offline ``index.search``, padding dropped."""
    res = index.search(queries, k)
    out = []
    for srow, irow in zip(res.scores.tolist(), res.ids.tolist(), strict=True):
        keep = [j for j, d in enumerate(irow) if d >= 0]
        out.append({"ids": [index.ids[irow[j]] for j in keep], "scores": [srow[j] for j in keep]})
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Check Prometheus text format 0.0.4 line by line; ``{series: value}``."""
    series: dict[str, float] = {}
    typed: set[str] = set()
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*"\})? (\S+)$')
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram")
            assert name not in typed
            typed.add(name)
            continue
        if line.startswith("# HELP "):
            continue
        m = sample.match(line)
        assert m, f"not a sample line: {line!r}"
        name = m.group(1)
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in typed or base in typed, f"{name} has no # TYPE line"
        series[name + (m.group(2) or "")] = float(m.group(3))
    return series


# -- exact answers under concurrent load (real sockets) -------------------------------------


def test_concurrent_clients_get_offline_results_and_batches_form():
    index, queries = cranfield()
    app = create_app(index, max_batch_size=64, max_wait_ms=20, queue_size=512)
    rng = random.Random(7)
    requests = []
    for _ in range(200):
        picks = rng.sample(range(len(queries)), rng.randint(1, 3))
        requests.append(([queries[i] for i in picks], rng.choice([1, 5, 10, 50])))

    with LiveServer(app) as live:
        local = threading.local()

        def call(req):
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=live.url, timeout=20)
            qs, k = req
            body = {"queries": qs, "k": k} if len(qs) > 1 else {"query": qs[0], "k": k}
            return local.client.post("/search", json=body)

        with ThreadPoolExecutor(32) as pool:
            responses = list(pool.map(call, requests, timeout=60))
        metrics = parse_metrics(httpx.get(f"{live.url}/metrics", timeout=10).text)
        health = httpx.get(f"{live.url}/health", timeout=10)

    for (qs, k), r in zip(requests, responses, strict=True):
        assert r.status_code == 200, r.text
        assert r.json() == {"k": k, "results": expected(index, qs, k)}
    n_queries = sum(len(qs) for qs, _ in requests)
    assert metrics['gpusparse_requests_total{status="200"}'] == 200
    assert metrics["gpusparse_queries_total"] == n_queries
    assert metrics["gpusparse_batch_size_sum"] == n_queries
    batches = metrics["gpusparse_batch_size_count"]
    assert metrics['gpusparse_batch_size_bucket{le="+Inf"}'] == batches
    # Dynamic batching happened: fewer batches than requests, some of more than one query.
    assert batches < 200
    assert metrics['gpusparse_batch_size_bucket{le="1"}'] < batches
    assert metrics["gpusparse_request_latency_seconds_count"] == 200
    assert metrics["gpusparse_queue_depth"] == 0
    assert health.status_code == 200 and health.json()["documents"] == index.n_docs


def test_overload_gets_429_and_no_response_is_lost():
    index, queries = cranfield()
    slow = SlowIndex(index, delay=0.05)
    app = create_app(slow, max_batch_size=1, max_wait_ms=0, queue_size=2)
    with LiveServer(app) as live:

        def call(i):
            with httpx.Client(base_url=live.url, timeout=20) as client:
                return client.post("/search", json={"query": queries[i], "k": 5})

        with ThreadPoolExecutor(24) as pool:
            responses = list(pool.map(call, range(48), timeout=60))
        metrics = parse_metrics(httpx.get(f"{live.url}/metrics", timeout=10).text)
        still_alive = httpx.get(f"{live.url}/health", timeout=10).status_code

    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) > 0
    for i, r in enumerate(responses):
        if r.status_code == 200:
            assert r.json()["results"] == expected(index, [queries[i]], 5)
        else:
            assert "queue is full" in r.json()["detail"]
    assert metrics['gpusparse_requests_total{status="429"}'] == codes.count(429)
    assert metrics['gpusparse_requests_total{status="200"}'] == codes.count(200)
    assert still_alive == 200


def test_admission_refuses_at_the_front_while_the_worker_is_stuck():
    """Past a full queue and a full batch, requests get 429 at once, before their body is parsed."""
    index, queries = cranfield()
    gate = threading.Event()
    slow = SlowIndex(index, delay=0.0, gate=gate)  # the worker blocks in its first batch
    app = create_app(slow, max_batch_size=2, max_wait_ms=300, queue_size=4)
    limit, n = 4 + 2, 30
    with LiveServer(app) as live:
        clients = [httpx.Client(base_url=live.url, timeout=20) for _ in range(n)]

        def call(i):
            t = time.monotonic()
            r = clients[i].post("/search", json={"query": queries[i], "k": 5})
            return r, time.monotonic() - t

        def wait_for(condition):
            deadline = time.monotonic() + 15
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.01)

        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(call, i) for i in range(2)]
            wait_for(lambda: slow.batch_sizes == [2])  # one full batch, stuck at the gate
            futures += [pool.submit(call, i) for i in range(2, n)]
            wait_for(lambda: sum(f.done() for f in futures) >= n - limit)
            # With the worker stuck, every refusal came back while the gate is still shut ...
            refused_early = [f.result()[0].status_code for f in futures if f.done()]
            in_flight = app.state.metrics.in_flight
            # ... and before the body is parsed: a malformed one is refused, not read as JSON.
            garbage = httpx.post(f"{live.url}/search", content=b"{not json", headers=JSON_TYPE, timeout=10)
            # A large body (~450 kB, sent whole before the answer is read) is refused too, not stuck.
            big = {"queries": [queries[i % len(queries)] for i in range(256)], "k": 5}
            big_client = httpx.Client(base_url=live.url, timeout=20)
            big_refused = [big_client.post("/search", json=big) for _ in range(4)]
            gate.set()
            answers = [f.result(timeout=30) for f in futures]
        # A refused connection stays usable (keep-alive after a 429 that left its body unread).
        refused = [i for i, (r, _) in enumerate(answers) if r.status_code == 429][:3]
        again = {i: clients[i].post("/search", json={"query": queries[i], "k": 5}) for i in refused}
        big_again = big_client.post("/search", json=big)  # the connection that sent the large body
        for c in [*clients, big_client]:
            c.close()
        metrics = parse_metrics(httpx.get(f"{live.url}/metrics", timeout=10).text)

    assert slow.batch_sizes[0] == 2
    assert len(refused_early) == n - limit and set(refused_early) == {429}, refused_early
    assert in_flight == limit
    assert garbage.status_code == 429
    for r in big_refused:
        assert r.status_code == 429 and "queue is full" in r.json()["detail"]
    codes = [r.status_code for r, _ in answers]
    assert codes[:2] == [200, 200] and codes.count(200) == limit and codes.count(429) == n - limit, codes
    for i, (r, seconds) in enumerate(answers):
        if r.status_code == 200:
            assert r.json()["results"] == expected(index, [queries[i]], 5)
        else:
            assert "queue is full" in r.json()["detail"] and r.headers["retry-after"] == "1"
            assert seconds < 10
    assert len(again) == 3
    for i, r in again.items():
        assert r.status_code == 200, r.text
        assert r.json()["results"] == expected(index, [queries[i]], 5)
    assert big_again.status_code == 200, big_again.text
    assert big_again.json()["results"] == expected(index, big["queries"], 5)
    assert metrics['gpusparse_requests_total{status="429"}'] == n - limit + 5
    assert metrics['gpusparse_requests_total{status="200"}'] == limit + len(again) + 1
    assert metrics["gpusparse_requests_in_flight"] == 0


def test_far_over_capacity_every_request_is_answered_exactly_or_refused():
    """Many keep-alive clients hammer a slowed worker: 200s exact, 429s fast, none lost, batches fill."""
    index, queries = cranfield()
    slow = SlowIndex(index, delay=0.02)  # about 200 queries/s at most with batches of 4
    app = create_app(slow, max_batch_size=4, max_wait_ms=2, queue_size=8)
    n_clients, per_client = 48, 8
    with LiveServer(app) as live:

        def client_loop(c):
            out = []
            with httpx.Client(base_url=live.url, timeout=20) as client:
                for j in range(per_client):
                    i = (c * per_client + j) % len(queries)
                    t = time.monotonic()
                    r = client.post("/search", json={"query": queries[i], "k": 10})
                    out.append((i, r, time.monotonic() - t))
            return out

        t0 = time.monotonic()
        with ThreadPoolExecutor(n_clients) as pool:
            results = [x for part in pool.map(client_loop, range(n_clients), timeout=90) for x in part]
        elapsed = time.monotonic() - t0
        metrics = parse_metrics(httpx.get(f"{live.url}/metrics", timeout=10).text)

    assert len(results) == n_clients * per_client
    codes = [r.status_code for _, r, _ in results]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) > 0
    for i, r, _ in results:
        if r.status_code == 200:
            assert r.json()["results"] == expected(index, [queries[i]], 10)
    refusals = sorted(s for _, r, s in results if r.status_code == 429)
    assert refusals[len(refusals) // 2] < 0.5  # the median refusal does not wait for the worker
    assert metrics['gpusparse_requests_total{status="429"}'] == codes.count(429)
    assert metrics['gpusparse_requests_total{status="200"}'] == codes.count(200)
    assert metrics["gpusparse_requests_in_flight"] == 0
    assert max(slow.batch_sizes) == 4  # under load the worker takes whole batches
    assert elapsed < 60


def test_graceful_shutdown_answers_in_flight_requests():
    index, queries = cranfield()
    gate = threading.Event()
    slow = SlowIndex(index, delay=0.05, gate=gate)  # the first batch waits at the gate
    app = create_app(slow, max_batch_size=2, max_wait_ms=0, queue_size=64)
    live = LiveServer(app)
    with live:

        def call(i):
            with httpx.Client(base_url=live.url, timeout=20) as client:
                return client.post("/search", json={"query": queries[i], "k": 3})

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(call, i) for i in range(6)]
            deadline = time.monotonic() + 10
            while app.state.metrics.in_flight < 6 and time.monotonic() < deadline:  # all six received
                time.sleep(0.01)
            assert app.state.metrics.in_flight == 6 and len(slow.batch_sizes) == 1
            live.server.should_exit = True  # what SIGTERM does
            time.sleep(0.2)
            gate.set()
            live.stop()
            responses = [f.result(timeout=30) for f in futures]
        assert app.state.batcher.closing
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        assert r.json()["results"] == expected(index, [queries[i]], 3)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{live.url}/health", timeout=2)


# -- invalid requests -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    index, _ = cranfield()
    with TestClient(create_app(index, max_wait_ms=1, max_query_terms=8, max_queries_per_request=4), LOCAL) as c:
        yield c


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"query": {"zzzqqqx": 1.0}}, 400, "unknown token 'zzzqqqx'"),
        ({"queries": [{"wing": 1.0}, {"wing": 1.0, "blorfx": 2.0}]}, 400, "query 1: unknown token 'blorfx'"),
        ({"query": {"wing": 1.0}, "k": 0}, 422, "k: Input should be greater than or equal to 1"),
        ({"query": {"wing": 1.0}, "k": -3}, 422, "k: Input should be greater than or equal to 1"),
        ({"query": {f"a{i}" if i else "wing": 1.0 for i in range(9)}}, 400, "9 query terms; at most 8"),
        ({"query": "   "}, 400, "empty query text"),
        ({"k": 3}, 400, "give exactly one of 'query' and 'queries'"),
        ({"query": {"wing": 1.0}, "queries": [{"wing": 1.0}]}, 400, "give exactly one of"),
        ({"queries": [{"wing": 1.0}] * 5}, 400, "5 queries in one request; at most 4"),
        ({"query": {"wing": -1.0}}, 400, "weight -1.0 is negative"),
        ({"query": {"wing": "heavy"}}, 400, "weight 'heavy' is not a number"),
        ({"query": "wing flutter"}, 400, "text queries need an encoder"),
        ({"query": {"wing": 1.0}, "kk": 3}, 422, "kk: Extra inputs are not permitted"),
    ],
)
def test_invalid_requests_get_4xx_with_a_message(client, body, status, message):
    r = client.post("/search", json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["detail"]


def test_bad_json_gets_400(client):
    r = client.post("/search", content=b'{"query": {"wing": 1.0', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["detail"].startswith("malformed JSON")


def test_valid_request_health_openapi_and_metrics(client):
    index, _ = cranfield()
    r = client.post("/search", json={"queries": [{"wing": 1.0}, {"flutter": 0.5, "wing": 2.0}], "k": 1398})
    assert r.status_code == 200
    assert r.json()["results"] == expected(index, [{"wing": 1.0}, {"flutter": 0.5, "wing": 2.0}], 1398)
    assert client.get("/health").json()["status"] == "ok"
    schema = client.get("/openapi.json").json()
    assert {"/search", "/health", "/metrics"} <= set(schema["paths"])
    assert "429" in schema["paths"]["/search"]["post"]["responses"]
    body_schema = schema["paths"]["/search"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in body_schema:
        body_schema = schema["components"]["schemas"][body_schema["$ref"].rsplit("/", 1)[-1]]
    assert {"query", "queries", "k"} <= set(body_schema["properties"])
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    metrics = parse_metrics(r.text)
    assert metrics['gpusparse_requests_total{status="200"}'] >= 1


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["1", "01", "2", "3", "007", "7", "40", "nope"]),
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True),
            st.sampled_from([0.0, -0.0, 1e-46, 3.5e38, 1e39, 2.5]),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_canonical_vector_matches_from_dicts(vector):
    """The server's per-request path gives what SparseCollection.from_dicts gives, errors included."""
    vocab = Vocabulary.integer(41)  # "7" and "007" are one term: summed, as from_dicts does
    try:
        coll = SparseCollection.from_dicts([vector], vocab=vocab, unknown="error")
    except InputError as exc:
        with pytest.raises(InputError) as caught:
            canonical_vector(vector, vocab)
        assert caught.value.reason == exc.reason
        return
    terms, weights = canonical_vector(vector, vocab)
    assert terms.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(terms, coll.indices)
    np.testing.assert_array_equal(weights, coll.values)


# -- the batcher on its own -----------------------------------------------------------------


def test_batcher_is_fifo_keeps_requests_whole_and_skips_cancelled():
    served: list[list[int]] = []
    gate = threading.Event()

    def run(batch):
        gate.wait(5)
        served.append([r.k for r in batch])
        for r in batch:
            r.deliver(None)

    b = DynamicBatcher(run, max_batch_size=4, max_wait_s=0.0, queue_size=10)
    sizes = [1, 3, 2, 2, 5, 1]  # k doubles as the request's number
    reqs = [PendingRequest([("q",)] * n, k, lambda _: None) for k, n in enumerate(sizes)]  # type: ignore[list-item]
    b.submit(reqs[0])
    time.sleep(0.1)  # the worker holds request 0 at the gate
    for r in reqs[1:]:
        b.submit(r)
    reqs[3].cancelled = True
    gate.set()
    b.close(timeout=5)
    assert served == [[0], [1], [2], [4], [5]]  # 3 + 2 > 4 splits; a 5-query request goes alone


def test_batcher_refuses_when_full_and_when_closing():
    from gpusparse.serve import QueueFullError, ShuttingDownError

    block = threading.Event()
    b = DynamicBatcher(lambda batch: block.wait(5), max_batch_size=1, max_wait_s=0.0, queue_size=1)
    b.submit(PendingRequest([("q",)], 1, lambda _: None))  # type: ignore[list-item]
    time.sleep(0.1)  # taken by the worker
    b.submit(PendingRequest([("q",)], 2, lambda _: None))  # type: ignore[list-item]
    with pytest.raises(QueueFullError):
        b.submit(PendingRequest([("q",)], 3, lambda _: None))  # type: ignore[list-item]
    block.set()
    b.close(timeout=5)
    with pytest.raises(ShuttingDownError):
        b.submit(PendingRequest([("q",)], 4, lambda _: None))  # type: ignore[list-item]


def test_request_timeout_gets_504():
    index, queries = cranfield()
    slow = SlowIndex(index, delay=0.5)
    with TestClient(create_app(slow, max_batch_size=1, max_wait_ms=0, request_timeout_s=0.1), LOCAL) as c:
        r = c.post("/search", json={"query": queries[0], "k": 3})
    assert r.status_code == 504
    assert "not answered within 0.1 s" in r.json()["detail"]


def test_create_app_checks_its_settings():
    index, _ = cranfield()
    for kwargs in ({"max_batch_size": 0}, {"queue_size": -1}, {"max_wait_ms": -1}, {"request_timeout_s": 0}):
        with pytest.raises(ValueError):
            create_app(index, **kwargs)


# -- text queries (splade-tiny) -------------------------------------------------------------


@needs_shared
def test_text_queries_are_encoded_on_the_server():
    index, _ = cranfield()
    encoder = tiny_encoder()
    texts = ["what similarity laws must be obeyed when constructing aeroelastic models", "boundary layer transition"]
    with TestClient(create_app(index, encoder=encoder, max_wait_ms=1), LOCAL) as c:
        answers = [c.post("/search", json={"query": t, "k": 10}) for t in texts]  # one text per batch
        mixed = c.post("/search", json={"queries": [texts[1], {"wing": 1.5}], "k": 4})
    for t, r in zip(texts, answers, strict=True):
        assert r.status_code == 200, r.text
        q = encoder.encode_queries([t])
        assert r.json()["results"] == expected(index, [q.row(0)], 10)
    assert mixed.status_code == 200
    got = mixed.json()["results"]
    assert got[1] == expected(index, [{"wing": 1.5}], 4)[0]
    assert len(got[0]["ids"]) == 4
    assert json.loads(json.dumps(got))  # plain JSON
    assert SPLADE_TINY.is_dir()


# -- the command line -----------------------------------------------------------------------


def test_cli_serve_one_line_errors(monkeypatch, tmp_path):
    import sys

    from click.testing import CliRunner

    import gpusparse.serve
    from gpusparse.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the command should have stopped before serving")

    monkeypatch.setattr(gpusparse.serve, "serve", never)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # so 'scatter' is refused on the CPU
    index, _ = cranfield()
    index.save(tmp_path / "index")
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "index"), "--kernel", "scatter", "--device", "cpu"])
    assert r.exit_code == 2 and "Invalid value for --kernel" in r.stderr
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "missing")])
    assert r.exit_code == 1 and r.stderr.startswith("gpusparse: error: ") and len(r.stderr.splitlines()) == 1
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "index")])
    assert r.exit_code == 1
    assert r.stderr == "gpusparse: error: gpusparse serve needs fastapi and uvicorn: pip install 'gpusparse[serve]'\n"


# -- slow, large and lying bodies (issue 24: 2, 3) --------------------------------------------


def send_raw(live: LiveServer, data: bytes, timeout: float = 10) -> socket.socket:
    """A loopback connection to ``live`` that has sent ``data`` (and stays open)."""
    port = int(live.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (bounded by ``timeout``)."""
    sock.settimeout(timeout)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def status_of(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1.1 "), raw[:80]
    return int(raw.split(b" ", 2)[1])


def detail_of(raw: bytes) -> str:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])["detail"]


def post_head(length: int | None, host: str = "127.0.0.1") -> bytes:
    """Request line and headers of a JSON POST /search (chunked when ``length`` is None)."""
    framing = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
    return f"POST /search HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n{framing}\r\n\r\n".encode()


def test_slow_bodies_take_no_slot_and_get_408():
    """Clients trickling a body hold no queue slot: normal requests still get 200; the slow ones 408 and close."""
    index, queries = cranfield()
    app = create_app(index, max_batch_size=1, max_wait_ms=0, queue_size=1, body_timeout_s=1.5)  # 2 slots
    with LiveServer(app) as live:
        slow = [send_raw(live, post_head(100) + b'{"query": {"wi') for _ in range(8)]
        deadline = time.monotonic() + 5
        while app.state.metrics.reading < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        reading = app.state.metrics.reading
        with httpx.Client(base_url=live.url, timeout=10) as client:
            normal = [client.post("/search", json={"query": queries[i], "k": 5}) for i in range(3)]
        t = time.monotonic()
        answers = [read_until_closed(s) for s in slow]
        waited = time.monotonic() - t
        for s in slow:
            s.close()
        metrics = parse_metrics(httpx.get(f"{live.url}/metrics", timeout=10).text)
    assert reading == 8
    for i, r in enumerate(normal):
        assert r.status_code == 200, r.text
        assert r.json()["results"] == expected(index, [queries[i]], 5)
    for raw in answers:  # answered, then closed (read_until_closed returned before its timeout)
        assert status_of(raw) == 408 and "did not arrive within 1.5 s" in detail_of(raw)
        assert b"connection: close" in raw.lower()
    assert waited < 5
    assert metrics['gpusparse_requests_total{status="408"}'] == 8
    assert metrics["gpusparse_requests_reading_body"] == 0 and metrics["gpusparse_requests_in_flight"] == 0


def test_connections_per_client_address_are_capped():
    index, queries = cranfield()
    app = create_app(index, max_connections_per_client=3, max_wait_ms=0)
    with LiveServer(app) as live:
        held = [send_raw(live, b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n") for _ in range(3)]
        for s in held:  # each answered; the keep-alive connection stays open
            s.settimeout(10)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        over = send_raw(live, b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        refused = read_until_closed(over)
        over.close()
        held.pop().close()
        deadline = time.monotonic() + 5
        while True:  # the server sees the close a moment later
            r = httpx.post(f"{live.url}/search", json={"query": queries[0], "k": 3}, timeout=10)
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for s in held:
            s.close()
    assert status_of(refused) == 429 and "more than 3 connections from this address" in detail_of(refused)
    assert r.status_code == 200 and r.json()["results"] == expected(index, [queries[0]], 3)


def test_shutdown_does_not_wait_for_stalled_uploads(caplog):
    """SIGTERM with uploads stalled mid-body: they get 503 at once, the server stops in seconds, no traceback."""
    index, queries = cranfield()
    app = create_app(index, body_timeout_s=60, max_wait_ms=0)
    live = LiveServer(app)
    with live:
        stalled = [send_raw(live, post_head(100) + b'{"query"') for _ in range(4)]
        half_headers = send_raw(live, b"POST /search HTTP/1.1\r\nhost: local")
        deadline = time.monotonic() + 5
        while app.state.metrics.reading < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        ok = httpx.post(f"{live.url}/search", json={"query": queries[0], "k": 3}, timeout=10)
        t = time.monotonic()
        live.stop()  # what SIGTERM does, then waits for the server thread
        stop_seconds = time.monotonic() - t
        answers = [read_until_closed(s, timeout=5) for s in stalled]
        rest = read_until_closed(half_headers, timeout=5)
        for s in [*stalled, half_headers]:
            s.close()
    assert ok.status_code == 200
    assert stop_seconds < 5, stop_seconds
    for raw in answers:
        assert status_of(raw) == 503 and "shutting down" in detail_of(raw)
    assert rest == b""  # closed without an answer: it never finished its request
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_body_size_is_limited_by_content_length_and_while_streaming():
    index, queries = cranfield()
    app = create_app(index, max_body_bytes=4000, max_wait_ms=0)
    fits = json.dumps({"query": queries[0], "k": 3}).encode()
    assert len(fits) < 4000
    with LiveServer(app) as live:
        # Declared too large: 413 before a byte of the body is sent, and the connection closed.
        declared = send_raw(live, post_head(50_000_000))
        too_large = read_until_closed(declared)
        declared.close()

        def chunks(n: int):  # no Content-Length: the limit is checked as the body streams in
            yield b'{"query": {'
            for i in range(n):
                yield b'"wing": 1.0, ' if i else b'"wing": 1.0'
            yield b"}}"

        with httpx.Client(base_url=live.url, timeout=10, headers=JSON_TYPE) as client:
            streamed = client.post("/search", content=chunks(1000))
            small_stream = client.post("/search", content=iter([fits[:10], fits[10:]]))
            exact = client.post("/search", content=fits + b" " * (4000 - len(fits)))
            over_by_one = client.post("/search", content=fits + b" " * (4001 - len(fits)))
    assert status_of(too_large) == 413 and "larger than 4,000 bytes" in detail_of(too_large)
    assert streamed.status_code == 413 and "larger than 4,000 bytes" in streamed.json()["detail"]
    for r in (small_stream, exact):
        assert r.status_code == 200, r.text
        assert r.json()["results"] == expected(index, [queries[0]], 3)
    assert over_by_one.status_code == 413


def test_content_length_lies_are_answered_not_believed():
    index, queries = cranfield()
    app = create_app(index, body_timeout_s=1.0, max_wait_ms=0)
    body = json.dumps({"query": queries[0], "k": 3}).encode()
    with LiveServer(app) as live:
        # Promises more than it sends: the body never completes, 408 after the body timeout.
        short = send_raw(live, post_head(len(body) + 50) + body)
        short_answer = read_until_closed(short)
        short.close()
        # Promises less than it sends: the first bytes are the body (not JSON), the rest is not HTTP.
        long = send_raw(live, post_head(10) + body)
        long.shutdown(socket.SHUT_WR)  # the server sees the end of what it was sent
        long_answer = read_until_closed(long, timeout=5)
        long.close()
        health = httpx.get(f"{live.url}/health", timeout=10)
        again = httpx.post(f"{live.url}/search", json={"query": queries[0], "k": 3}, timeout=10)
    assert status_of(short_answer) == 408
    assert status_of(long_answer) == 400 and detail_of(long_answer).startswith("malformed JSON")
    assert b" 500 " not in long_answer
    assert health.status_code == 200
    assert again.status_code == 200 and again.json()["results"] == expected(index, [queries[0]], 3)


def test_large_bodies_are_parsed_off_the_loop_and_answered_exactly():
    """A body over the inline-parse size (64 KiB) goes through the parsing thread: same answer."""
    index, queries = cranfield()
    many = [queries[i % len(queries)] for i in range(200)]
    body = {"queries": many, "k": 4}
    assert len(json.dumps(body)) > 64 << 10
    with TestClient(create_app(index, max_wait_ms=1), LOCAL) as c:
        r = c.post("/search", json=body)
        bad = c.post("/search", json={"queries": [*many[:199], {"wing": "1.5"}], "k": 4})
    assert r.status_code == 200 and r.json()["results"] == expected(index, many, 4)
    assert bad.status_code == 400 and bad.json()["detail"] == "query 199: weight '1.5' is not a number"


# -- security defaults (issue 24: 10) -------------------------------------------------------


def test_bearer_token_is_required_when_configured():
    index, _ = cranfield()
    app = create_app(index, auth_token="s3cret-token", max_wait_ms=1)
    assert "s3cret" not in repr(app.state.config)
    good = {"authorization": "Bearer s3cret-token"}
    with TestClient(app, LOCAL) as c:
        missing = c.post("/search", json={"query": {"wing": 1.0}})
        wrong = c.post("/search", json={"query": {"wing": 1.0}}, headers={"authorization": "Bearer s3cret-tokeN"})
        basic = c.post("/search", json={"query": {"wing": 1.0}}, headers={"authorization": "s3cret-token"})
        health = c.get("/health")
        metrics = c.get("/metrics")
        ok = c.post("/search", json={"query": {"wing": 1.0}, "k": 2}, headers=good)
        ok_health = c.get("/health", headers=good)
    for r in (missing, wrong, basic, health, metrics):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert r.json()["detail"] == "missing or wrong bearer token"
    assert ok.status_code == 200 and ok.json()["results"] == expected(index, [{"wing": 1.0}], 2)
    assert ok_health.status_code == 200


def test_host_header_must_be_allowed():
    index, _ = cranfield()
    body = {"query": {"wing": 1.0}, "k": 2}
    with TestClient(create_app(index, max_wait_ms=1), LOCAL) as c:
        codes = {
            host: c.post("/search", json=body, headers={"host": host}).status_code
            for host in ["localhost", "LOCALHOST:8000", "127.0.0.1:80", "[::1]:8000", "evil.example", "evil.example:80"]
        }
        rebound = c.get("/health", headers={"host": "attacker.example:8000"})
    assert codes == {
        "localhost": 200,
        "LOCALHOST:8000": 200,
        "127.0.0.1:80": 200,
        "[::1]:8000": 200,
        "evil.example": 400,
        "evil.example:80": 400,
    }
    assert rebound.status_code == 400 and "Host 'attacker.example' is not allowed" in rebound.json()["detail"]
    with TestClient(create_app(index, max_wait_ms=1, allowed_hosts=("search.internal",)), LOCAL) as c:
        assert c.get("/health").status_code == 400
        assert c.get("/health", headers={"host": "search.internal:8000"}).status_code == 200
    with TestClient(create_app(index, max_wait_ms=1, allowed_hosts=("*",)), "http://anything.example") as c:
        assert c.post("/search", json=body).status_code == 200


def test_post_needs_a_json_content_type_and_no_cdn_docs(client):
    body = json.dumps({"query": {"wing": 1.0}, "k": 2}).encode()
    plain = client.post("/search", content=body, headers={"content-type": "text/plain"})
    form = client.post("/search", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    none = client.post("/search", content=body)
    charset = client.post("/search", content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    for r in (plain, form, none):
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["detail"]
    assert charset.status_code == 200
    # No CORS: a preflight gets no Access-Control-Allow-* header, so browsers refuse cross-site JSON.
    preflight = client.options(
        "/search", headers={"origin": "http://evil.example", "access-control-request-method": "POST"}
    )
    assert not any(h.startswith("access-control-") for h in preflight.headers)
    assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404
    assert client.get("/openapi.json").status_code == 200


# -- strict validation, non-finite scores (issue 24: 9, 7) ----------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"query": {"wing": 1.0}, "k": True}, "k: Input should be a valid integer"),
        ({"query": {"wing": 1.0}, "k": "3"}, "k: Input should be a valid integer"),
        ({"query": {"wing": 1.0}, "k": 3.0}, "k: Input should be a valid integer"),
        ({"query": {"wing": "1.5"}}, "weight '1.5' is not a number"),
        ({"query": {"wing": True}}, "weight True is not a number"),
        ({"queries": [{"wing": 1.0}, {"flutter": False}]}, "query 1: weight False is not a number"),
        ({"query": {"wing": None}}, "weight None is not a number"),
    ],
)
def test_booleans_and_strings_are_not_numbers(client, body, message):
    """k by pydantic's strict check (422); weights by the file reader's parse_vector (400)."""
    r = client.post("/search", json=body)
    assert r.status_code == (422 if "k" in body else 400), r.text
    assert r.json()["detail"].startswith(message)


@pytest.mark.parametrize("weight", [True, False, "1.5", None, 10**400])
def test_canonical_vector_takes_only_numbers(weight):
    """The server's vector path is as strict as the file reader, whatever the HTTP layer let through."""
    with pytest.raises(InputError, match=r"is not a number|overflows float32"):
        canonical_vector({"wing": weight}, Vocabulary.bert())


def strict_json(text: str):
    """json.loads refusing NaN and Infinity, which are not JSON."""

    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_overflowing_scores_get_400_never_infinity(client):
    r = client.post("/search", json={"query": {"wing": 3e38, "flutter": 3e38}, "k": 5})
    assert r.status_code == 400, r.text
    assert "overflow" in strict_json(r.text)["detail"]
    for weight in ("1e39", "Infinity", "NaN", "1" + "0" * 400):  # parsed, then refused by the weight checks
        raw = b'{"query": {"wing": ' + weight.encode() + b"}}"
        r = client.post("/search", content=raw, headers=JSON_TYPE)
        assert r.status_code == 400 and strict_json(r.text)["detail"].startswith("weight"), (weight, r.text)


def test_a_batch_refused_for_input_is_retried_request_by_request():
    """When the search refuses a batch (InputError), only the request at fault gets it."""
    index, queries = cranfield()

    class Picky:
        vocab, n_docs, ids, device = index.vocab, index.n_docs, index.ids, index.device
        calls = 0

        def search(self, coll, k, **kwargs):
            Picky.calls += 1
            if float(coll.values.max()) > 1e6:
                raise InputError("query scores can overflow float32", field="vector")
            return index.search(coll, k, **kwargs)

    got: dict[str, object] = {}
    good = PendingRequest([canonical_vector(queries[0], index.vocab)], 3, lambda v: got.setdefault("good", v))
    bad = PendingRequest([canonical_vector({"wing": 1e7}, index.vocab)], 3, lambda v: got.setdefault("bad", v))
    search_requests(Picky(), [good, bad])
    scores, ids = got["good"]
    res = index.search([queries[0]], 3)
    np.testing.assert_array_equal(ids, res.ids.numpy())
    np.testing.assert_array_equal(scores, res.scores.numpy())
    assert isinstance(got["bad"], InputError)
    assert Picky.calls == 3


# -- fuzzing the HTTP body ------------------------------------------------------------------

TOKENS = ["wing", "flutter", "boundary", "layer", "pressure", "zzzqqqx", ""]
weights = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-5, max_value=10**40),
    st.sampled_from([0, 0.0, 1.5, 3e38, True, False, None, "1.5", "heavy", [], {}]),
)
vectors = st.dictionaries(st.sampled_from(TOKENS), weights, max_size=5)
queries_st = st.one_of(vectors, st.sampled_from(["wing flutter", "", 3, None, [], True]))
ks = st.one_of(st.integers(min_value=-2, max_value=1500), st.sampled_from([True, False, "3", 2.0, None, [3]]))
bodies = st.one_of(
    st.fixed_dictionaries({"query": queries_st}, optional={"k": ks}),
    st.fixed_dictionaries({"queries": st.lists(queries_st, max_size=5)}, optional={"k": ks}),
    st.dictionaries(st.sampled_from(["query", "queries", "k", "kk"]), st.one_of(queries_st, ks), max_size=3),
    st.lists(vectors, max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(
    body=bodies, mangle=st.sampled_from(["none", "none", "truncate", "bytes"]), cut=st.floats(0, 1), junk=st.binary()
)
@example(body={"query": {"wing": 3e38, "flutter": 3e38}}, mangle="none", cut=0.0, junk=b"")  # once answered Infinity
@example(body={"query": {"wing": "1.5"}, "k": True}, mangle="none", cut=0.0, junk=b"")  # once answered as 1.5, k 1
def test_fuzzed_bodies_get_a_clean_4xx_or_the_offline_result(client, body, mangle, cut, junk):
    raw = json.dumps(body).encode()  # allow_nan: NaN and Infinity literals are sent too
    if mangle == "truncate":
        raw = raw[: int(cut * len(raw))]
    elif mangle == "bytes":
        raw = junk[:40]
    r = client.post("/search", content=raw, headers=JSON_TYPE)
    assert r.status_code < 500, r.text
    answer = strict_json(r.text)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500 and isinstance(answer["detail"], str) and answer["detail"]
        return
    index, _ = cranfield()
    queries = [body["query"]] if "query" in body else body["queries"]
    k = body.get("k", 10)
    assert type(k) is int  # answered: k was a JSON integer, not true or "3"
    assert answer == {"k": k, "results": expected(index, queries, k)}


def test_cli_serve_security_and_limit_flags(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import gpusparse.serve
    from gpusparse.cli import main

    seen = {}

    def capture(app, **kwargs):
        seen["config"], seen["kwargs"] = app.state.config, kwargs

    monkeypatch.setattr(gpusparse.serve, "serve", capture)
    monkeypatch.delenv("GPUSPARSE_AUTH_TOKEN", raising=False)
    index, _ = cranfield()
    index.save(tmp_path / "index")
    args = ["serve", str(tmp_path / "index"), "--device", "cpu", "--host", "10.1.2.3", "--allow-host", "search.lan"]
    args += ["--max-body-bytes", "64KiB", "--body-timeout", "2.5", "--max-connections-per-client", "0"]
    r = CliRunner().invoke(main, args, env={"GPUSPARSE_AUTH_TOKEN": "from-the-env"})
    assert r.exit_code == 0, r.output
    config = seen["config"]
    assert config.auth_token == "from-the-env" and "from-the-env" not in repr(config)
    assert config.allowed_hosts == ("localhost", "127.0.0.1", "::1", "10.1.2.3", "search.lan")
    assert (config.max_body_bytes, config.body_timeout_s, config.max_connections_per_client) == (65536, 2.5, 0)
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "index"), "--device", "cpu", "--host", "0.0.0.0"])
    assert r.exit_code == 0, r.output
    assert seen["config"].allowed_hosts == ("localhost", "127.0.0.1", "::1") and seen["config"].auth_token is None


def test_engine_in_metrics_and_health(client):
    """The engine that searched: a gauge labelled with it, a counter of searches by engine, /health."""
    index, queries = cranfield()
    fresh = create_app(index, max_wait_ms=1, search_kwargs={"kernel": "reference"})
    with TestClient(fresh, LOCAL) as c:
        metrics = parse_metrics(c.get("/metrics").text)
        assert not any(s.startswith("gpusparse_engine_info") for s in metrics)  # nothing searched yet
        assert c.get("/health").json()["engine"] is None
        for q in queries[:3]:
            assert c.post("/search", json={"query": q, "k": 5}).status_code == 200
        metrics = parse_metrics(c.get("/metrics").text)
        assert c.get("/health").json()["engine"] == "reference"
    assert metrics['gpusparse_engine_info{engine="reference"}'] == 1
    assert metrics['gpusparse_searches_total{engine="reference"}'] == metrics["gpusparse_batch_size_count"] >= 1
    # With kernel auto, the engine that offline search reports for the same index.
    assert client.post("/search", json={"query": {"wing": 1.0}, "k": 5}).status_code == 200
    want = index.search(SparseCollection.from_dicts([{"wing": 1.0}], vocab=index.vocab), 5).engine
    assert want and client.get("/health").json()["engine"] == want
    assert parse_metrics(client.get("/metrics").text)[f'gpusparse_engine_info{{engine="{want}"}}'] == 1


@pytest.mark.parametrize("kernel", ["auto", "tiled"])
def test_engine_of_a_segmented_index(tmp_path, kernel):
    from gpusparse.segments import SegmentedIndex

    index, queries = cranfield()
    docs = read_vectors(SAMPLE / "corpus.jsonl.gz", index.vocab)
    seg = SegmentedIndex.create(tmp_path / "seg", docs[:700])
    seg.add(docs[700:])
    seg.delete([docs.ids[3]])
    want = index.search(read_vectors(SAMPLE / "queries.jsonl.gz", index.vocab), 5, kernel=kernel).engine
    assert kernel == "auto" or want == kernel
    with TestClient(create_app(seg, max_wait_ms=1, search_kwargs={"kernel": kernel}), LOCAL) as c:
        assert c.post("/search", json={"query": queries[0], "k": 5}).status_code == 200
        assert c.get("/health").json()["engine"] == want
        metrics = parse_metrics(c.get("/metrics").text)
    assert metrics[f'gpusparse_engine_info{{engine="{want}"}}'] == 1
    assert metrics[f'gpusparse_searches_total{{engine="{want}"}}'] == 1


def test_engine_label_is_escaped():
    from gpusparse.serve.metrics import Metrics

    m = Metrics(4)
    m.observe_engine('we"ird\\')
    m.observe_engine("")
    text = m.render(0)
    assert 'gpusparse_searches_total{engine="we\\"ird\\\\"} 1' in text
    assert 'gpusparse_engine_info{engine="unknown"} 1' in text and 'gpusparse_engine_info{engine="we' not in text
