"""``serve``: an index over HTTP/JSON (the service itself is :mod:`gpusparse.serve`)."""

from __future__ import annotations

from pathlib import Path

import click

# The module, not its functions: tests replace ``gpusparse.serve.serve`` to stop before listening.
from .. import serve as server
from ..encode import SpladeEncoder
from ..index import Index
from ..serve.config import DEFAULT_ALLOWED_HOSTS
from ..serve.served import load_served
from ._common import (
    check_kernel,
    default_device,
    device_memory_limit_option,
    device_memory_scope,
    fail,
    friendly_errors,
    kernel_choice,
    limit_option,
    parse_size,
    unknown_option,
)


@click.command("serve")
@click.argument("index_dir", type=click.Path(path_type=Path))
@click.option("--model", help="SPLADE model (folder or hub id) to encode text queries [default: vectors only].")
@click.option("--pooling", type=click.Choice(["max", "sum"]), default="max", show_default=True, help="With --model.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--device", help="cpu or cuda[:N] [default: cuda if available, else cpu].")
@click.option("--kernel", type=kernel_choice, default="auto", show_default=True, help="Scoring kernel.")
@click.option("--max-batch-size", default=256, show_default=True, type=click.IntRange(min=1), help="Queries per batch.")
@click.option(
    "--max-wait-ms",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="How long a request waits for others to join its batch.",
)
@click.option(
    "--queue-size", default=1024, show_default=True, type=click.IntRange(min=1), help="Waiting requests; more get 429."
)
@click.option(
    "--request-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds before an unanswered request gets 504.",
)
@click.option("--max-query-terms", default=1024, show_default=True, type=click.IntRange(min=1), help="Per vector.")
@click.option(
    "--limit-concurrency",
    type=click.IntRange(min=1),
    help="Open connections and requests in progress at most; more get 503 [default: no limit].",
)
@click.option(
    "--auth-token",
    envvar="GPUSPARSE_AUTH_TOKEN",
    show_envvar=True,
    help="Require 'Authorization: Bearer TOKEN' on every request (prefer the variable: argv is visible).",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    help="A name clients may send in Host, besides localhost and --host (repeatable; '*' allows any).",
)
@click.option("--max-body-bytes", default="4MiB", show_default=True, help="Request body size at most; more get 413.")
@click.option(
    "--body-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to receive a request body; slower get 408.",
)
@click.option(
    "--max-connections-per-client",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Open connections per client address; more get 429 (0: no cap; behind a proxy, raise it or 0).",
)
@click.option("--memory-budget", default="1GiB", show_default=True, help="Bytes of search temporaries.")
@device_memory_limit_option
@click.option("--verify/--no-verify", default=True, show_default=True, help="Check the index files' checksums.")
@unknown_option
@friendly_errors
def serve_cmd(
    index_dir: Path,
    model: str | None,
    pooling: str,
    host: str,
    port: int,
    device: str | None,
    kernel: str,
    max_batch_size: int,
    max_wait_ms: float,
    queue_size: int,
    request_timeout: float,
    max_query_terms: int,
    limit_concurrency: int | None,
    auth_token: str | None,
    allow_hosts: tuple[str, ...],
    max_body_bytes: str,
    body_timeout: float,
    max_connections_per_client: int,
    memory_budget: str,
    device_memory_limit: str | None,
    verify: bool,
    unknown_tokens: str,
) -> None:
    """Serve INDEX_DIR over HTTP/JSON: POST /search, GET /health, GET /metrics, /openapi.json.

    INDEX_DIR may be plain, sharded or updated by add/delete (the snapshot at start-up).

    Concurrent requests are batched dynamically (up to --max-batch-size queries, or
    --max-wait-ms); a full queue answers 429; Ctrl-C or SIGTERM finishes the requests in
    flight, then stops. Example: curl -s localhost:8000/search -H 'content-type:
    application/json' -d '{"query": {"wing": 1.2, "flutter": 0.8}, "k": 3}'
    """
    try:
        server.require_server_stack()
    except ImportError:
        fail("gpusparse serve needs fastapi and uvicorn: pip install 'gpusparse[serve]'")
    budget = parse_size(memory_budget)
    if budget < 1 << 16:
        raise click.BadParameter("must be at least 64KiB", param_hint="--memory-budget")
    body_limit = parse_size(max_body_bytes)
    if body_limit < 1:
        raise click.BadParameter("must be at least 1 byte", param_hint="--max-body-bytes")
    # The bound address is a name clients use; a wildcard address is not (give --allow-host).
    bound = () if host in ("0.0.0.0", "::", "") else (host,)
    allowed_hosts = (*DEFAULT_ALLOWED_HOSTS, *bound, *allow_hosts)
    dev = default_device(device)
    check_kernel(kernel, dev)
    limit = limit_option(device_memory_limit)
    with device_memory_scope(limit):  # under a limit the lists stay on the host until the first search plans
        index = load_served(index_dir, device=dev, verify=verify)  # plain, sharded or segmented
    search_kwargs = {"kernel": kernel, "memory_budget": budget}
    if limit is not None:
        if not isinstance(index, Index):
            raise click.UsageError("--device-memory-limit applies to plain and sharded index folders")
        search_kwargs["device_memory_limit"] = limit  # the worker thread does not see this thread's settings
    encoder = None
    if model is not None:
        try:
            encoder = SpladeEncoder(model, pooling=pooling, device=dev)  # type: ignore[arg-type]
        except ImportError as exc:  # transformers is optional: its install hint, on one line
            fail(str(exc))
    app = server.create_app(
        index,
        encoder=encoder,
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        queue_size=queue_size,
        request_timeout_s=request_timeout,
        max_query_terms=max_query_terms,
        max_body_bytes=body_limit,
        body_timeout_s=body_timeout,
        max_connections_per_client=max_connections_per_client,
        auth_token=auth_token or None,
        allowed_hosts=allowed_hosts,
        unknown_tokens=unknown_tokens,
        search_kwargs=search_kwargs,
    )
    texts = f"text queries encoded by {encoder.name}" if encoder is not None else "{token: weight} queries only"
    click.echo(
        f"serving {index.n_docs:,} documents from {index_dir} on {dev} ({texts}) at http://{host}:{port}", err=True
    )
    server.serve(app, host=host, port=port, limit_concurrency=limit_concurrency)
