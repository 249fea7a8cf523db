"""The server answers as the API and the file reader do (issue 24 item 9; issue 20's serve frictions).

Edge cases (k larger than the collection, empty or all-zero vectors, an empty list, unknown
tokens), the reader's vector rules on the same JSON text (repeated tokens summed, the same
refusals), scores that would overflow float32 refused by the search itself, and every folder
kind `search` reads (plain, sharded, segmented) served with its string ids.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from gpusparse import Index, SparseCollection, read_vectors
from gpusparse.errors import InputError
from gpusparse.segments import SegmentedIndex
from gpusparse.serve import PendingRequest, canonical_vector, create_app, load_served, search_requests
from gpusparse.serve.served import ServedSegments
from gpusparse.shards import document_ranges, save_sharded

from .test_serve import JSON_TYPE, LOCAL, SAMPLE, cranfield, expected, strict_json

HUGE_K = 100_000_000_000


@pytest.fixture(scope="module")
def client():
    index, _ = cranfield()
    with TestClient(create_app(index, max_wait_ms=1), LOCAL) as c:
        yield c


def post(client, raw: bytes | str):
    return client.post("/search", content=raw.encode() if isinstance(raw, str) else raw, headers=JSON_TYPE)


# -- edge cases: as Index.search --------------------------------------------------------------


@pytest.mark.parametrize(
    ("queries", "k"),
    [
        ([{"wing": 1.0}], 1399),  # k > n_docs: padded by the API, fewer hits from the server
        ([{"wing": 1.0}, {"flutter": 2.0}], HUGE_K),  # far larger: capped, not allocated
        ([{}], 5),  # an empty vector: no results
        ([{"wing": 0.0, "flutter": 0.0}], 5),  # every weight zero: no results
        ([{"wing": 1.0}, {}], 3),
        ([], 5),  # no queries: no results
    ],
)
def test_edge_cases_are_answered_as_the_api_answers_them(client, queries, k):
    index, _ = cranfield()
    r = client.post("/search", json={"queries": queries, "k": k})
    assert r.status_code == 200, r.text
    want = expected(index, queries, k) if queries else []
    assert r.json() == {"k": k, "results": want}
    if len(queries) == 1:
        r = client.post("/search", json={"query": queries[0], "k": k})
        assert r.status_code == 200 and r.json() == {"k": k, "results": want}


def test_unknown_tokens_policy_as_the_api_and_the_reader():
    index, _ = cranfield()
    body = {"query": {"wing": 1.0, "zzzqqqx": 2.0}, "k": 4}
    with pytest.raises(InputError, match="unknown token 'zzzqqqx'"):
        index.search([body["query"]], 4)  # the API refuses
    with TestClient(create_app(index, max_wait_ms=1), LOCAL) as c:
        r = c.post("/search", json=body)
        assert r.status_code == 400 and "unknown token 'zzzqqqx'" in r.json()["detail"]
    skipped = SparseCollection.from_dicts([body["query"]], vocab=index.vocab, unknown="skip")
    with TestClient(create_app(index, max_wait_ms=1, unknown_tokens="skip"), LOCAL) as c:
        r = c.post("/search", json=body)
        assert r.status_code == 200 and r.json()["results"] == expected(index, [skipped.row(0)], 4)
    with pytest.raises(ValueError, match="unknown_tokens"):
        create_app(index, unknown_tokens="drop")


# -- the reader's rules on the same JSON text -------------------------------------------------


def test_repeated_tokens_are_summed_as_the_reader_sums_them(client, tmp_path):
    index, _ = cranfield()
    text = '{"wing": 1.25, "flutter": 0.5, "wing": 2.0}'
    r = post(client, '{"query": ' + text + ', "k": 5}')
    assert r.status_code == 200, r.text
    assert r.json()["results"] == expected(index, [{"wing": 3.25, "flutter": 0.5}], 5)
    (tmp_path / "q.jsonl").write_text('{"id": "q", "vector": ' + text + "}\n")
    read = read_vectors(tmp_path / "q.jsonl", index.vocab, progress=False)
    assert read.row(0) == {"flutter": 0.5, "wing": 3.25}
    r = post(client, '{"query": {"wing": 1.0}, "k": 2, "k": 3}')
    assert r.status_code == 400 and r.json()["detail"] == "key 'k' given twice"


TOKENS = ["wing", "flutter", "boundary", "zzzqqqx", ""]
BAD_WEIGHTS = {"-1", "1e39", "true", "null", '"1.5"', "[]", "{}", "NaN", "1" + "0" * 40}
WEIGHTS = ["1", "2.5", "0", "0.0", "3e38", "1e-46", *sorted(BAD_WEIGHTS)]


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.sampled_from(TOKENS), st.sampled_from(WEIGHTS)), max_size=6))
@example(pairs=[("wing", "1"), ("wing", "2.5")])  # a repeated token: summed
@example(pairs=[("wing", "true"), ("wing", "1")])  # pydantic alone kept only the last
@example(pairs=[("wing", "3e38"), ("flutter", "3e38")])  # finite weights, overflowing scores
def test_fuzzed_vectors_server_equals_reader_on_the_same_json_text(client, tmp_path_factory, pairs):
    """One JSON text (repeated keys and all) sent to the server and read by the file reader:
    both refuse with the same reason, or both give the same vector and the server the API's answer."""
    index, _ = cranfield()
    text = "{" + ", ".join(f"{json.dumps(t)}: {w}" for t, w in pairs) + "}"
    path = tmp_path_factory.mktemp("fuzz") / "q.jsonl"
    path.write_text('{"id": "q", "vector": ' + text + "}\n")
    r = post(client, '{"query": ' + text + ', "k": 7}')
    assert r.status_code < 500, r.text
    answer = strict_json(r.text)
    try:
        read = read_vectors(path, index.vocab, progress=False)
        want = expected(index, [read.row(0)], 7)
    except InputError as exc:
        assert r.status_code == 400, (text, r.text)
        # The same reason (the reader adds the CLI's hint to an unknown token's) when there is one
        # fault to report; with several bad weights each may name another first.
        unknown = any(t not in ("wing", "flutter", "boundary") for t, _ in pairs)
        if unknown or sum(w in BAD_WEIGHTS for _, w in pairs) <= 1:
            detail = answer["detail"]
            assert detail == exc.reason or exc.reason.startswith(detail + " (use --unknown-tokens"), (text, detail)
        return
    assert r.status_code == 200, (text, r.text)
    assert answer == {"k": 7, "results": want}


def test_canonical_vector_takes_repeated_pairs():
    index, _ = cranfield()
    terms, weights = canonical_vector((("wing", 1.0), ("flutter", 2.0), ("wing", 0.5)), index.vocab)
    coll = SparseCollection.from_dicts([{"wing": 1.5, "flutter": 2.0}], vocab=index.vocab)
    np.testing.assert_array_equal(terms, coll.indices)
    np.testing.assert_array_equal(weights, coll.values)


# -- scores overflowing float32: refused by the search, not by a stub --------------------------


def test_overflowing_query_is_refused_by_the_real_search_only_for_its_request(client):
    index, queries = cranfield()
    r = client.post("/search", json={"queries": [{"wing": 1.0}, {"wing": 3e38, "flutter": 3e38}], "k": 5})
    assert r.status_code == 400
    assert strict_json(r.text)["detail"].startswith("query '1': its weights are too large: a score could overflow")
    got: dict[str, object] = {}
    good = PendingRequest([canonical_vector(queries[0], index.vocab)], 3, lambda v: got.setdefault("good", v))
    bad = PendingRequest(
        [canonical_vector({"wing": 3e38, "flutter": 3e38}, index.vocab)], 3, lambda v: got.setdefault("bad", v)
    )
    search_requests(index, [good, bad])  # the real Index: the batch is refused, then each request alone
    res = index.search([queries[0]], 3)
    np.testing.assert_array_equal(got["good"][1], res.ids.numpy())
    np.testing.assert_array_equal(got["good"][0], res.scores.numpy())
    assert isinstance(got["bad"], InputError) and "too large" in str(got["bad"])


# -- every folder kind --------------------------------------------------------------------------


def test_sharded_and_segmented_folders_are_served_with_their_string_ids(tmp_path):
    docs = read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False)
    index, queries = cranfield()
    save_sharded((Index.build(docs[a:b]) for a, b in document_ranges(len(docs), 3)), tmp_path / "sharded")
    seg = SegmentedIndex.create(tmp_path / "seg", docs[:700])
    seg.add(docs[700:])
    seg.delete([docs.ids[i] for i in (3, 702, 1000)])
    body = {"queries": queries[:6], "k": 20}
    sharded = load_served(tmp_path / "sharded")
    assert isinstance(sharded, Index)
    with TestClient(create_app(sharded, max_wait_ms=1), LOCAL) as c:
        assert c.post("/search", json=body).json()["results"] == expected(index, queries[:6], 20)
    served = load_served(tmp_path / "seg")
    assert isinstance(served, ServedSegments) and served.n_docs == len(docs) - 3
    want = SegmentedIndex.load(tmp_path / "seg").retrieve(
        SparseCollection.from_dicts(queries[:6], vocab=index.vocab), 20
    )
    for app_index in (served, SegmentedIndex.load(tmp_path / "seg")):  # loaded, or given to create_app
        with TestClient(create_app(app_index, max_wait_ms=1), LOCAL) as c:
            got = c.post("/search", json=body).json()["results"]
            assert [list(zip(g["ids"], g["scores"], strict=True)) for g in got] == [
                [(d, s) for d, s in want[str(i)]] for i in range(6)
            ]
            assert not {docs.ids[i] for i in (3, 702, 1000)} & {d for g in got for d in g["ids"]}
            assert c.get("/health").json()["documents"] == len(docs) - 3


def test_cli_serve_loads_a_segmented_folder(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import gpusparse.serve
    from gpusparse.cli import main

    seen = {}
    monkeypatch.setattr(gpusparse.serve, "serve", lambda app, **kw: seen.setdefault("app", app))
    runner = CliRunner()
    r = runner.invoke(main, ["index", str(SAMPLE / "corpus.jsonl.gz"), "-o", str(tmp_path / "idx"), "--no-progress"])
    assert r.exit_code == 0, r.stderr
    (tmp_path / "new.jsonl").write_text('{"id": "new-doc", "vector": {"wing": 9.0}}\n')
    r = runner.invoke(main, ["add", str(tmp_path / "idx"), str(tmp_path / "new.jsonl")])
    assert r.exit_code == 0, r.stderr
    r = runner.invoke(main, ["serve", str(tmp_path / "idx"), "--device", "cpu", "--unknown-tokens", "skip"])
    assert r.exit_code == 0, r.stderr
    app = seen["app"]
    assert app.state.config.unknown_tokens == "skip"
    with TestClient(app, LOCAL) as c:
        r = c.post("/search", json={"query": {"wing": 1.0, "zzzqqqx": 1.0}, "k": 1})
        assert r.json()["results"][0]["ids"] == ["new-doc"]
