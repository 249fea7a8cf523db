"""Metrics: gpusparse eval against ir_measures called directly, and a case computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import ir_measures
import pytest

from gpusparse import Index, InputError, read_vectors, write_trec_run
from gpusparse.evaluate import evaluate, format_table, parse_measures

from .test_cli import assert_one_line_error, ok, run

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory) -> Path:
    """A depth-100 run of the shipped Cranfield sample."""
    docs = read_vectors(SAMPLE / "corpus.jsonl.gz", progress=False)
    queries = read_vectors(SAMPLE / "queries.jsonl.gz", progress=False)
    index = Index.build(docs)
    res = index.search(queries, 100)
    path = tmp_path_factory.mktemp("eval") / "run.trec"
    write_trec_run(path, queries.ids, index.ids, res.scores.numpy(), res.ids.numpy())
    return path


def qrels_from_beir_tsv(path: Path) -> list[ir_measures.Qrel]:
    with path.open(encoding="utf-8") as f:
        next(f)
        return [ir_measures.Qrel(q, d, int(g)) for q, d, g in (line.split() for line in f)]


MEASURES = "RR@10 nDCG@10 R@100 AP P@5 nDCG@20 Success@1"


def test_evaluate_equals_ir_measures_directly(sample_run):
    got = evaluate(sample_run, SAMPLE / "qrels.tsv", MEASURES)
    want = ir_measures.calc_aggregate(
        [ir_measures.parse_measure(m) for m in MEASURES.split()],
        qrels_from_beir_tsv(SAMPLE / "qrels.tsv"),
        list(ir_measures.read_trec_run(str(sample_run))),
    )
    assert got.values == {str(m): pytest.approx(v, abs=1e-12) for m, v in want.items()}
    assert got.n_queries == 225 and not got.missing_from_run and not got.unjudged_in_run
    assert 0 < got.values["RR@10"] < 1


def write_run(path: Path, rows: list[tuple[str, str, float]]) -> Path:
    ranks: dict[str, int] = {}
    with path.open("w") as f:
        for q, d, s in rows:
            ranks[q] = ranks.get(q, 0) + 1
            f.write(f"{q} Q0 {d} {ranks[q]} {s} test\n")
    return path


def test_a_case_computed_by_hand(tmp_path):
    # q1: the relevant document is 2nd -> RR 1/2; q2: relevant doc 1st -> RR 1;
    # q3 is judged but has no results -> 0. RR@10 = (0.5 + 1 + 0) / 3 = 0.5.
    # R@1: q1 0/2, q2 1/1, q3 0 -> 1/3. P@2: q1 1/2, q2 1/2, q3 0 -> 1/3.
    # q9 has results but no judgments: ignored.
    runf = write_run(
        tmp_path / "run",
        [("q1", "a", 3.0), ("q1", "b", 2.0), ("q1", "c", 1.0), ("q2", "x", 5.0), ("q2", "y", 1.0), ("q9", "a", 1.0)],
    )
    qrels = tmp_path / "qrels"
    qrels.write_text("q1 0 b 1\nq1 0 z 2\nq2 0 x 1\nq3 0 a 1\n")
    ev = evaluate(runf, qrels, "RR@10 R@1 P@2")
    assert ev.values == pytest.approx({"RR@10": 0.5, "R@1": 1 / 3, "P@2": 1 / 3})
    assert ev.missing_from_run == ["q3"] and ev.unjudged_in_run == ["q9"]
    warnings = ev.warnings()
    assert "1 of 3 judged queries have no results" in warnings[0] and "count as 0" in warnings[0]
    assert "1 queries of the run have no judgments" in warnings[1]


def test_ranking_is_by_score_not_by_rank_column(tmp_path):
    runf = tmp_path / "run"
    runf.write_text("q1 Q0 a 1 1.0 t\nq1 Q0 b 2 2.0 t\n")  # b scores higher although ranked 2nd
    assert evaluate(runf, {"q1": {"b": 1}}, "RR@10").values["RR@10"] == 1.0


def test_identical_ids_are_kept():
    """Query 23 and document 23 are different things: the pair counts (BEIR's default would drop it)."""
    ev = evaluate({"23": {"23": 2.0, "7": 1.0}}, {"23": {"23": 1}}, ["RR@10"])
    assert ev.values["RR@10"] == 1.0 and ev.identical_id_pairs == 1


def test_measure_names():
    assert [str(m) for m in parse_measures("RR@10, nDCG@10 ndcg_cut.10 map")] == ["RR@10", "nDCG@10", "AP"]
    with pytest.raises(InputError, match="unknown measure 'MRR@x'"):
        parse_measures("nDCG@10 MRR@x")
    with pytest.raises(InputError, match="no measures"):
        parse_measures(" ")


def test_format_table():
    ev = evaluate({"q": {"a": 1.0}}, {"q": {"a": 1}}, "RR@10 R@100")
    lines = format_table([("my-run", ev)]).splitlines()
    assert lines[0].split() == ["run", "queries", "RR@10", "R@100"]
    assert lines[1].split() == ["my-run", "1", "1.0000", "1.0000"]


def test_cli_eval_prints_the_ir_measures_table(sample_run):
    out = ok("eval", sample_run, SAMPLE / "qrels.tsv").stdout.splitlines()
    want = evaluate(sample_run, SAMPLE / "qrels.tsv")
    assert out[0].split() == ["run", "queries", "RR@10", "nDCG@10", "R@100", "R@1000"]
    cells = out[1].split()
    assert cells[1] == "225"
    assert [float(c) for c in cells[2:]] == [round(want.values[m], 4) for m in ("RR@10", "nDCG@10", "R@100", "R@1000")]
    js = json.loads(ok("eval", sample_run, SAMPLE / "qrels.tsv", "--json", "-m", "AP ndcg_cut.20").stdout)
    assert js["measures"] == pytest.approx(evaluate(sample_run, SAMPLE / "qrels.tsv", "AP nDCG@20").values)
    assert js["judged_queries"] == 225
    assert "identical" in ok("eval", "--help").stdout.replace("\n", " ")


def test_cli_eval_warns_about_missing_queries(tmp_path):
    runf = write_run(tmp_path / "run", [("q1", "a", 1.0), ("q8", "a", 1.0)])
    qrels = tmp_path / "qrels"
    qrels.write_text("q1 0 a 1\nq2 0 a 1\n")
    result = ok("eval", runf, qrels, "-m", "RR@10")
    assert result.stdout.splitlines()[1].split()[1:] == ["2", "0.5000"]
    assert "warning: 1 of 2 judged queries have no results in the run (e.g. 'q2'); they count as 0" in result.stderr
    assert "warning: 1 queries of the run have no judgments (e.g. 'q8'); ignored" in result.stderr


def test_cli_eval_bad_input(tmp_path, sample_run):
    assert_one_line_error(run("eval", sample_run, SAMPLE / "qrels.tsv", "-m", "nDCG@ten"), "unknown measure 'nDCG@ten'")
    assert_one_line_error(run("eval", tmp_path / "nope", SAMPLE / "qrels.tsv"), "nope", "cannot read")
    bad = tmp_path / "bad.trec"
    bad.write_text("q1 Q0 a 1 1.0 t\nq1 Q0 b two 0.5 t\n")
    assert_one_line_error(run("eval", bad, SAMPLE / "qrels.tsv"), "bad.trec:2", "bad rank")
    dup = write_run(tmp_path / "dup", [("q1", "a", 2.0), ("q1", "a", 1.0)])
    assert_one_line_error(run("eval", dup, SAMPLE / "qrels.tsv"), "document 'a' appears twice for query 'q1'")
    badq = tmp_path / "qrels"
    badq.write_text("q1 0 a high\n")
    assert_one_line_error(run("eval", sample_run, badq), "qrels:1", "not an integer")
    empty = tmp_path / "empty"
    empty.write_text("")
    assert_one_line_error(run("eval", sample_run, empty), "no judgments")
