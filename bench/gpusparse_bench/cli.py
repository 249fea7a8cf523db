"""The harness's command group: ``run``, ``report``, ``paper``, ``paper-report`` (``gpusparse bench ...``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from gpusparse.sizes import parse_size

from .paper import PaperConfig, run_paper
from .paper_report import render_paper
from .report import load, performance_section, render
from .runner import RunConfig, run, spec_from_overrides


def _ints(text: str) -> list[int]:
    try:
        return [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from e


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _command_line() -> str:
    """The command as typed: ``gpusparse bench run ...``, ``python -m gpusparse.cli bench run ...``
    or ``python -m gpusparse_bench run ...``."""
    main = Path(sys.argv[0]) if sys.argv else Path()
    if main.name != "__main__.py":
        prog = "gpusparse bench"
    elif main.parent.name == "cli":  # gpusparse/cli/__main__.py
        prog = "python -m gpusparse.cli bench"
    else:
        prog = "python -m gpusparse_bench"
    args = sys.argv[1:]
    if args[:1] == ["bench"]:
        args = args[1:]
    return " ".join([prog, *args])


@click.group("bench")
def bench() -> None:
    """Benchmark every system side by side on synthetic MS MARCO-scale collections."""


@bench.command("run")
@click.option("--sizes", default="100000,1000000,8841823", show_default=True, help="Collection sizes (documents).")
@click.option(
    "--batches",
    default="1,32,256,1024",
    show_default=True,
    help="Batch sizes (above 256 only up to --big-batch-max-docs).",
)
@click.option("--ks", default="10,1000", show_default=True, help="Values of k.")
@click.option("--big-batch-max-docs", default=1_000_000, show_default=True, type=int)
@click.option("--device", default="cuda", show_default=True, help="cuda, or cpu for a dry run.")
@click.option(
    "--reps", default=10, show_default=True, type=click.IntRange(min=1), help="Timed calls per configuration."
)
@click.option(
    "--time-cap", default=2.0, show_default=True, type=float, help="Seconds per configuration before fewer reps."
)
@click.option("--memory-budget", default="4GiB", show_default=True, help="Our search's temporaries.")
@click.option("--dense-max", default="16GiB", show_default=True, help="Largest dense [N, V] matrix allowed.")
@click.option("--exact-sample", default=256, show_default=True, type=int, help="Queries checked against the reference.")
@click.option("--systems", default=None, help="Comma-separated name patterns to run (default: all).")
@click.option("--skip", "skip_systems", default="", help="Comma-separated name patterns to leave out.")
@click.option("--cpu-engines/--no-cpu-engines", default=True, show_default=True)
@click.option("--cpu-max-docs", default=1_000_000, show_default=True, type=int)
@click.option("--cpu-batches", default="1,32", show_default=True)
@click.option("--cpu-time-cap", default=20.0, show_default=True, type=float)
@click.option("--deadline", "deadline_s", default=None, type=float, help="Seconds after which the rest is skipped.")
@click.option("--spec", "spec_items", multiple=True, help="Override a SyntheticSpec field: --spec zipf=1.2.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--quick", is_flag=True, help="100K documents, B 1 and 32, k 10: a pipeline check.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench/results"), show_default=True)
@click.option("--name", default="bench", show_default=True, help="Result file: <out>/<date>-<card>-<name>.json.")
@click.option("--commit", default=None, help="Git commit to record (default: git rev-parse HEAD).")
def run_cmd(**o: object) -> None:
    """Generate the collections, run every system, check exactness, write results and print a table."""
    try:
        spec = spec_from_overrides(list(o["spec_items"]))
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    cfg = RunConfig(
        sizes=_ints(o["sizes"]),
        batches=_ints(o["batches"]),
        ks=_ints(o["ks"]),
        big_batch_max_docs=o["big_batch_max_docs"],
        device=o["device"],
        reps=o["reps"],
        time_cap_s=o["time_cap"],
        memory_budget=_size(o["memory_budget"]),
        dense_max_bytes=_size(o["dense_max"]),
        exact_sample=o["exact_sample"],
        systems=[s for s in o["systems"].split(",") if s] if o["systems"] else None,
        skip_systems=[s for s in o["skip_systems"].split(",") if s],
        cpu_engines=o["cpu_engines"],
        cpu_max_docs=o["cpu_max_docs"],
        cpu_batches=_ints(o["cpu_batches"]),
        cpu_time_cap_s=o["cpu_time_cap"],
        deadline_s=o["deadline_s"],
        seed=o["seed"],
        out=o["out"],
        name=o["name"],
        commit=o["commit"],
        command=_command_line(),
        spec=spec,
    )
    if o["quick"]:
        cfg.sizes, cfg.batches, cfg.ks, cfg.cpu_batches = [100_000], [1, 32], [10], [32]
    run(cfg, log=lambda s: click.echo(s))


@bench.command("report")
@click.argument("results", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder for .md and .png.")
@click.option("--readme", is_flag=True, help="Also write <stem>-readme.md: the README's Performance section.")
def report_cmd(results: Path, out: Path, readme: bool) -> None:
    """Render a result file: Markdown tables and plots (latency vs size, QPS vs batch)."""
    written = render(results, out)
    if readme:
        stem = results.stem
        section = performance_section(
            load(results),
            json_rel=str(results),
            md_rel=str(out / f"{stem}.md"),
            plot_rel=str(out / f"{stem}-latency-vs-size.png"),
        )
        p = out / f"{stem}-readme.md"
        p.write_text(section)
        written.append(p)
    for p in written:
        click.echo(f"wrote {p}")


@bench.command("paper")
@click.option("--device", default="cuda", show_default=True, help="cuda, or cpu for a dry run.")
@click.option(
    "--scale", type=click.Choice(["full", "tiny"]), default="full", show_default=True, help="tiny: a dry run."
)
@click.option("--only", default=",".join(("e2e", "batch", "sparsity", "vocab", "memory", "quality")), show_default=True)
@click.option(
    "--tiny-model",
    type=click.Path(path_type=Path),
    help="splade-tiny's folder: the e2e and quality encoder, and the base model's tokenizer.",
)
@click.option(
    "--query-texts",
    type=click.Path(path_type=Path),
    help="A BEIR queries.jsonl whose texts the e2e part encodes [default: generated text].",
)
@click.option("--data-root", type=click.Path(path_type=Path), help="Folder of BEIR collections for the quality part.")
@click.option("--base-query-terms", default=45, show_default=True, type=click.IntRange(min=1))
@click.option("--memory-budget", default="4GiB", show_default=True, help="Our search's temporaries.")
@click.option("--deadline", "deadline_s", default=None, type=float, help="Seconds after which the rest is skipped.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench/results"), show_default=True)
@click.option("--name", default="paper", show_default=True, help="Result file: <out>/<date>-<card>-<name>.json.")
@click.option("--commit", default=None, help="Git commit to record (default: git rev-parse HEAD).")
def paper_cmd(**o: object) -> None:
    """The paper's remaining experiments (end to end, batch sweep, sparsity, vocabulary, memory,
    cross-domain quality), ours beside the paper's kernel, into one result file."""
    try:
        cfg = PaperConfig(
            device=o["device"],
            scale=o["scale"],
            only=tuple(p.strip() for p in o["only"].split(",") if p.strip()),
            tiny_model=o["tiny_model"],
            query_texts=o["query_texts"],
            data_root=o["data_root"],
            base_query_terms=o["base_query_terms"],
            memory_budget=_size(o["memory_budget"]),
            seed=o["seed"],
            deadline_s=o["deadline_s"],
            out=o["out"],
            name=o["name"],
            commit=o["commit"],
            command=_command_line(),
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    path = run_paper(cfg, log=lambda s: click.echo(s))
    failed = [p for p, v in json.loads(path.read_text())["parts"].items() if v["status"] == "error"]
    if failed:
        raise SystemExit(f"gpusparse bench paper: part(s) {', '.join(failed)} failed (see {path})")


@bench.command("paper-report")
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder for .md and .png.")
@click.option(
    "--readme",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Rewrite this file's block between the paper-tables markers with the tables.",
)
def paper_report_cmd(results: tuple[Path, ...], out: Path, readme: Path | None) -> None:
    """Render `bench paper` results (files, or folders searched for *-paper*.json) beside the paper's figures."""
    for p in render_paper(list(results), out, readme=readme):
        click.echo(f"wrote {p}")
