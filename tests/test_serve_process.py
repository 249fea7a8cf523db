"""`gpusparse serve` as a real process: started from the command line on 127.0.0.1, asked over
HTTP, answering what offline search answers, and stopped by a real SIGTERM that drains it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from gpusparse import Index, read_vectors

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, path: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST" if data else "GET")
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_serve_process_answers_as_offline_search_and_drains_on_sigterm(tmp_path):
    docs = read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False)
    index = Index.build(docs)
    index.save(tmp_path / "idx")
    port = free_port()
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]))
    argv = [sys.executable, "-m", "gpusparse.cli", "serve", str(tmp_path / "idx"), "--port", str(port),
            "--device", "cpu", "--max-wait-ms", "1"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while True:  # bounded: the process starts in seconds (it imports torch)
            if proc.poll() is not None:
                pytest.fail(f"serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                status, _ = request(port, "/health", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("serve did not answer /health within 90 s")
            time.sleep(0.2)
        query = {"wing": 1.2, "flutter": 0.8, "speed": 0.5}
        status, answer = request(port, "/search", {"query": query, "k": 5})
        assert status == 200, answer
        want = index.retrieve([query], k=5)
        (hits,) = want.values()
        assert answer["results"][0]["ids"] == [d for d, _ in hits]
        assert answer["results"][0]["scores"] == [s for _, s in hits]  # float32 values, exactly
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        # uvicorn drains, then re-raises the signal it caught: the exit status says SIGTERM
        assert proc.returncode in (0, -signal.SIGTERM), (proc.returncode, err[-2000:])
        assert "Application shutdown complete" in err and "Finished server process" in err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
