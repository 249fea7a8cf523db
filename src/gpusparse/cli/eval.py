"""``eval``: retrieval metrics of a TREC run (ir_measures)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..evaluate import evaluate, format_table, parse_measures
from ._common import friendly_errors, warn

DEFAULT_MEASURES = "RR@10 nDCG@10 R@100 R@1000"


@click.command("eval")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("qrels", type=click.Path(path_type=Path))
@click.option(
    "-m",
    "--measures",
    default=DEFAULT_MEASURES,
    show_default=True,
    help="Any measures ir_measures parses, separated by spaces (e.g. 'AP P@5 nDCG@20' or TREC 'ndcg_cut.10').",
)
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@friendly_errors
def eval_cmd(run: Path, qrels: Path, measures: str, as_json: bool) -> None:
    """Compute retrieval metrics of a TREC run with ir_measures.

    QRELS are TREC qrels (qid iter docid grade) or BEIR TSV (query-id corpus-id score).
    Every judged query counts: one without results in the run scores 0. Queries of the
    run without judgments are ignored. Both are counted in warnings. Documents are ranked
    by score, ties broken by ir_measures (the rank column is not used), as trec_eval does.

    Identical ids: query and document ids are separate namespaces, and no document is
    dropped for having its query's id (unlike BEIR's default ignore_identical_ids=True):
    in Cranfield and CISI numeric ids collide and such pairs can be truly relevant.
    """
    parsed = parse_measures(measures)
    ev = evaluate(run, qrels, parsed)
    for line in ev.warnings():
        warn(line)
    if as_json:
        click.echo(json.dumps({"run": str(run), "qrels": str(qrels), **ev.as_dict()}, indent=2))
    else:
        click.echo(format_table([(str(run), ev)]))
