"""The benchmark: the synthetic generator, the GPU-free baselines, the runner's records, the report."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.cli import main
from gpusparse.synthetic import BERT_VOCAB_SIZE, SyntheticSpec, generate, synthetic_stats
from gpusparse_bench.report import headline, markdown, render, short_table
from gpusparse_bench.runner import RunConfig, compare, run, spec_from_overrides
from gpusparse_bench.systems import (
    CuSparseSpGEMM,
    CuSparseSpMM,
    DenseMatmul,
    PaperScatterChunked,
    SpareIterative,
    Workload,
)

from .shared_data import needs_shared


def _canonical(indptr: torch.Tensor, terms: torch.Tensor, weights: torch.Tensor, spec: SyntheticSpec, max_nnz: int):
    assert indptr.dtype == torch.int64 and terms.dtype == torch.int32 and weights.dtype == torch.float32
    assert int(indptr[0]) == 0 and int(indptr[-1]) == terms.numel() == weights.numel()
    lengths = torch.diff(indptr)
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= max_nnz
    assert int(terms.min()) >= 0 and int(terms.max()) < spec.n_terms
    assert float(weights.min()) > 0 and float(weights.max()) <= spec.weight_max
    # strictly increasing terms inside each row
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    same_row = rows[1:] == rows[:-1]
    assert bool((terms[1:][same_row] > terms[:-1][same_row]).all())


def test_generator_is_seeded_and_canonical():
    spec = SyntheticSpec()
    a = generate(400, 20, seed=1)
    b = generate(400, 20, seed=1)
    c = generate(400, 20, seed=2)
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            assert torch.equal(s, t)
    assert not torch.equal(a[0][1], c[0][1])
    _canonical(*a[0], spec, spec.doc_nnz_max)
    _canonical(*a[1], spec, spec.query_nnz_max)


def test_generator_small_chunks_give_canonical_rows():
    spec = SyntheticSpec()
    docs, _ = generate(300, 4, seed=3, doc_chunk=37)
    _canonical(*docs, spec, spec.doc_nnz_max)


def test_statistics_near_targets_at_small_scale():
    docs, queries = generate(3000, 64, seed=0)
    st = synthetic_stats(docs, queries, max_queries=64)
    assert st["doc_nnz_mean"] == pytest.approx(120, abs=4)
    assert st["doc_nnz_sd"] == pytest.approx(34, abs=4)
    assert st["query_nnz_mean"] == pytest.approx(45, abs=6)
    assert 0.40 <= st["frac_docs_touched"] <= 0.68
    assert 1.3 <= st["postings_per_query_per_doc"] <= 3.0
    assert st["frac_docs_touched"] < st["frac_docs_touched_if_independent"]
    assert st["weight_min"] > 0 and st["weight_max"] <= 3.5


def test_spec_overrides_and_validation():
    spec = spec_from_overrides(["zipf=1.2", "n_topics=8"])
    assert spec.zipf == 1.2 and spec.n_topics == 8
    with pytest.raises(ValueError):
        spec_from_overrides(["nope=1"])
    with pytest.raises(ValueError):
        SyntheticSpec(generic_frac=2.0)


@pytest.fixture(scope="module")
def small():
    docs, qcsr = generate(700, 12, seed=5)
    vocab = Vocabulary.bert()
    index = Index.from_csr(*docs, vocab)
    queries = SparseCollection(qcsr[0].numpy(), qcsr[1].numpy(), qcsr[2].numpy(), vocab=vocab)
    return index, docs, queries


@pytest.mark.parametrize("cls", [SpareIterative, CuSparseSpMM, CuSparseSpGEMM, DenseMatmul])
@pytest.mark.parametrize("k", [1, 10, 900])
def test_gpu_free_baselines_return_the_exact_top_k(small, cls, k):
    index, docs, queries = small
    ref = index.search(queries, k, kernel="reference")
    system = cls()
    system.prepare(Workload(index, docs))
    scores, ids = system.search(queries, k)
    system.close()
    assert scores.shape == ids.shape == (len(queries), k)
    valid = ref.ids >= 0
    assert torch.allclose(scores[valid], ref.scores[valid], rtol=1e-5, atol=1e-6)
    # ids must match wherever the score is not tied (within tolerance) with a neighbour
    ref_s = ref.scores.to(torch.float64)
    gap = torch.full_like(ref_s, float("inf"))
    gap[:, 1:] = (ref_s[:, 1:] - ref_s[:, :-1]).abs()
    gap[:, :-1] = torch.minimum(gap[:, :-1], (ref_s[:, :-1] - ref_s[:, 1:]).abs())
    clear = valid & (gap > 1e-5 * ref_s.abs().clamp_min(1e-6))
    assert torch.equal(ids[clear], ref.ids[clear])
    assert compare(scores, ids, ref.scores, ref.ids, with_scores=True)["recall_vs_exact"] > 0.999


def test_paper_chunked_merges_query_and_document_chunks(small):
    pytest.importorskip("triton")
    from gpusparse.kernels import triton_available

    if not triton_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    index, docs, queries = small
    if torch.cuda.is_available():  # Triton runs CPU tensors only under its interpreter
        index, docs = index.to("cuda"), tuple(t.cuda() for t in docs)
    q = queries[:3]
    ref = index.search(q, 20, kernel="reference")
    system = PaperScatterChunked(query_chunk=2, doc_chunk=300)
    system.prepare(Workload(index, docs))
    scores, ids = system.search(q, 20)
    scores, ids = scores.cpu(), ids.cpu()
    assert torch.allclose(scores, ref.scores, rtol=1e-5)
    assert compare(scores, ids, ref.scores, ref.ids, with_scores=True)["recall_vs_exact"] > 0.99


def test_compare_counts_ties_and_non_matches():
    ref_s = torch.tensor([[3.0, 2.0, 0.0]])
    ref_i = torch.tensor([[4, 1, -1]])
    r = compare(torch.tensor([[3.0, 2.0, 0.0]]), torch.tensor([[4, 1, 7]]), ref_s, ref_i, with_scores=True)
    assert r == {"exact": True, "recall_vs_exact": 1.0, "max_score_diff": 0.0}
    r = compare(torch.tensor([[3.0, 1.5, 0.0]]), torch.tensor([[4, 2, 7]]), ref_s, ref_i, with_scores=True)
    assert not r["exact"] and r["recall_vs_exact"] == 0.5 and r["max_score_diff"] == 0.5


@pytest.fixture(scope="module")
def results_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cfg = RunConfig(
        sizes=[500],
        batches=[1, 4],
        ks=[5, 50],
        device="cpu",
        reps=2,
        time_cap_s=0.2,
        cpu_engines=False,
        systems=["ours-reference", "ours-tiled-q8", "spare-iterative", "cusparse-spmm", "dense-matmul"],
        dense_max_bytes=1,  # too small for the dense matrix: it is skipped with the reason
        out=out,
        name="tiny",
        command="pytest",
        stat_queries=4,
    )
    return run(cfg, log=lambda s: None)


def test_runner_writes_the_record_schema(results_file):
    data = json.loads(results_file.read_text())
    env = data["env"]
    for key in ("card", "driver", "cuda", "torch", "triton", "git_commit", "command", "copy_bandwidth_bytes_per_s"):
        assert key in env
    assert env["card"] == "cpu" and results_file.name.endswith("-cpu-tiny.json")
    ok = [r for r in data["results"] if r["status"] == "ok"]
    assert {r["system"] for r in ok} == {"ours-reference", "ours-tiled-q8", "spare-iterative", "cusparse-spmm"}
    assert len(ok) == 4 * 2 * 2
    for r in ok:
        for key in ("system", "n_docs", "batch_size", "k", "ms_per_batch", "qps", "peak_mem_bytes", "cupy_pool_bytes",
                    "exact"):  # fmt: skip
            assert key in r
        assert r["exact"] is True
        if r["system"] == "ours-tiled-q8":  # exact for its quantized vectors, not the float32 ones
            assert "quantized" in r["exact_against"] and 0.5 < r["recall_vs_exact"] <= 1.0
            continue
        assert r["recall_vs_exact"] == 1.0
        assert r["floor_ms"] > 0 and r["frac_of_floor"] > 0
        assert r["qps"] == pytest.approx(r["batch_size"] / r["ms_per_batch"] * 1e3)
    skipped = [r for r in data["results"] if r["system"] == "dense-matmul"]
    assert skipped and skipped[0]["status"] == "skipped" and "allowed" in skipped[0]["reason"]
    stats = data["collections"][0]["stats"]
    assert stats["n_docs"] == 500 and "frac_docs_touched" in stats


def test_report_renders_table_and_plots(results_file, tmp_path):
    data = json.loads(results_file.read_text())
    assert "ours-reference" in short_table(data)
    md = markdown(data)
    assert "| system | N | B | k |" in md and "dense-matmul" in md
    assert headline(data, b=4, k=50)[0]["ours"] == "ours-reference"
    written = render(results_file, tmp_path)
    assert written[0].suffix == ".md" and written[0].exists()
    pytest.importorskip("matplotlib")
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 2 and all(p.stat().st_size > 1000 for p in pngs)


def test_bench_report_command(results_file, tmp_path):
    res = CliRunner().invoke(main, ["bench", "report", str(results_file), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / f"{results_file.stem}.md").exists()


def test_vocabulary_size_matches_bert():
    assert SyntheticSpec().n_terms == BERT_VOCAB_SIZE == len(Vocabulary.bert())


# -- gpusparse bench paper ------------------------------------------------------------------


def test_spec_scaled_for_sparsity_and_vocabulary():
    spec = SyntheticSpec()
    assert spec.doc_chunk() == 1 << 19  # the calibrated spec keeps the generator's default chunks
    s = spec.with_doc_nnz(500)
    assert s.doc_nnz_mean == 500 and s.doc_nnz_sd == pytest.approx(34 * 500 / 120) and s.doc_nnz_max == 1250
    assert s.doc_chunk() < 1 << 19
    assert spec.with_doc_nnz(120) == spec
    v = spec.with_vocabulary(10_000)
    assert v.n_terms == 10_000 and v.active_terms == round(28_700 * 10_000 / 30_522)
    assert v.doc_nnz_mean == spec.doc_nnz_mean  # same postings for the same number of documents
    with pytest.raises(ValueError):
        spec.with_doc_nnz(0)
    for sp in (spec.with_doc_nnz(10), spec.with_vocabulary(1000)):
        docs, queries = generate(200, 5, spec=sp, seed=0, doc_chunk=sp.doc_chunk())
        _canonical(*docs, sp, sp.doc_nnz_max)
        _canonical(*queries, sp, sp.query_nnz_max)
    docs, _ = generate(300, 2, spec=spec.with_doc_nnz(10), seed=0)
    assert float(torch.diff(docs[0]).double().mean()) == pytest.approx(10, abs=1.5)


@pytest.fixture(scope="module")
def paper_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper")
    args = ["bench", "paper", "--device", "cpu", "--scale", "tiny", "--only", "batch,sparsity,vocab,memory"]
    res = CliRunner().invoke(main, [*args, "--out", str(out), "--commit", "abc"])
    assert res.exit_code == 0, res.output
    (path,) = out.glob("*-cpu-paper.json")
    return path


def test_paper_dry_run_records_every_part(paper_results):
    from gpusparse_bench.paper import SCALES

    data = json.loads(paper_results.read_text())
    sc = SCALES["tiny"]
    assert data["env"]["card"] == "cpu" and data["env"]["git_commit"] == "abc"
    assert data["env"]["command"]
    assert {p: v["status"] for p, v in data["parts"].items()} == dict.fromkeys(
        ("batch", "sparsity", "vocab", "memory"), "ok"
    )
    ours = [r for r in data["results"] if r.get("family") == "ours" and r["status"] == "ok"]
    assert {r["system"] for r in ours} == {"ours-reference"}  # what kernel="auto" runs on a CPU
    assert all(r["exact"] for r in ours if "exact" in r)
    batch = [r for r in ours if r["part"] == "batch"]
    assert sorted(r["batch_size"] for r in batch) == list(sc.batch_batches)
    assert all(r["k"] == sc.batch_k and r["n_docs"] == sc.batch_docs for r in batch)
    colls = data["collections"]
    nnz = {c["doc_nnz"]: c for c in colls if c["part"] == "sparsity"}
    assert sorted(nnz) == list(sc.nnz_values)
    for n, c in nnz.items():
        assert c["stats"]["doc_nnz_mean"] == pytest.approx(n, rel=0.2)
    assert nnz[100]["n_postings"] > nnz[10]["n_postings"] * 5
    vocab = {c["n_terms"]: c for c in colls if c["part"] == "vocab"}
    assert sorted(vocab) == list(sc.vocab_values)
    assert vocab[10_000]["stats"]["nonempty_lists"] < 10_000 < vocab[100_000]["stats"]["nonempty_lists"]
    mem = [r for r in data["results"] if r["part"] == "memory"]
    assert sorted({r["n_docs"] for r in mem}) == list(sc.memory_sizes)
    assert {r["system"] for r in mem} == {"ours-reference", "paper-scatter", "paper-scatter-chunked"}
    for r in mem:
        if r["status"] == "ok":
            assert r["index_bytes"] >= r["paper_layout_bytes"] > r["n_postings"] * 8
        else:  # the Triton kernels run only on a GPU or under the interpreter
            assert r["status"] == "skipped" and r["reason"]


def test_paper_report_keeps_gpu_tables_for_gpu_results(paper_results, tmp_path):
    from gpusparse_bench.paper_report import END, NOT_MEASURED, START, load_results, paper_markdown

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\n{START}\nold\n{END}\n\nafter\n")
    res = CliRunner().invoke(
        main, ["bench", "paper-report", str(paper_results.parent), "--out", str(tmp_path), "--readme", str(readme)]
    )
    assert res.exit_code == 0, res.output
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{END}\n\nafter\n")
    # A CPU dry run never fills the speed tables: placeholders, and the paper's figures beside them.
    assert text.count(NOT_MEASURED) >= 5 and "118,704 QPS" in text and "0.43 ms/query" in text
    assert "ours-reference" not in text
    assert (tmp_path / "paper-tables.md").exists()
    # The same records, as if measured on a card: the tables fill, the card is named.
    data = load_results([paper_results])[0]
    data["env"]["card"] = "NVIDIA H200"
    md = paper_markdown([data])
    assert "**H200**" in md
    batch = md.split("### Batch-size sweep")[1].split("###")[0]
    assert "| 4 |" in batch and NOT_MEASURED not in batch
    sparsity = md.split("### Sparsity sensitivity")[1].split("###")[0]
    assert "| 100 |" in sparsity and "ours-reference" not in sparsity.split("\n\n")[0]
    memory = md.split("### Memory footprint")[1].split("###")[0]
    assert "| 600 |" in memory


@needs_shared
def test_paper_e2e_and_quality_dry_run(tmp_path):
    from .shared_data import SPLADE_TINY, cranfield_slice, write_beir

    root = tmp_path / "data"
    write_beir(root / "cranslice", *cranfield_slice(40))
    args = ["bench", "paper", "--device", "cpu", "--scale", "tiny", "--only", "e2e,quality", "--out", str(tmp_path)]
    args += ["--tiny-model", str(SPLADE_TINY), "--data-root", str(root)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    (path,) = tmp_path.glob("*-cpu-paper.json")
    data = json.loads(path.read_text())
    assert data["parts"]["e2e"]["status"] == "ok" and data["parts"]["quality"]["status"] == "ok"
    assert data["parts_info"]["e2e_query_texts"].startswith("generated text")
    e2e = [r for r in data["results"] if r["part"] == "e2e" and r["status"] == "ok"]
    assert {r["model"] for r in e2e} == {"bert-shrunk-random (dry run)", "splade-tiny"}
    for r in e2e:
        assert r["exact"] and r["encode_ms"] > 0 and r["score_ms"] > 0
        assert r["ms_per_batch"] == pytest.approx(r["encode_ms"] + r["score_ms"])
        if r["model"].startswith("bert"):
            assert r["query_nnz_mean"] <= 45  # random outputs cut to the base_query_terms largest
    (q,) = [r for r in data["results"] if r["part"] == "quality"]
    assert q["collection"] == "cranslice" and q["verify"]["exact"] is True
    assert 0 < q["measures"]["nDCG@10"] <= 1


def test_paper_parts_skip_with_a_reason(tmp_path):
    args = ["bench", "paper", "--device", "cpu", "--scale", "tiny", "--only", "e2e,quality", "--out", str(tmp_path)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    (path,) = tmp_path.glob("*-cpu-paper.json")
    parts = json.loads(path.read_text())["parts"]
    assert parts["e2e"]["status"] == "skipped" and "--tiny-model" in parts["e2e"]["reason"]
    assert parts["quality"]["status"] == "skipped" and "--data-root" in parts["quality"]["reason"]
    res = CliRunner().invoke(main, ["bench", "paper", "--device", "cpu", "--only", "nope", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "unknown part" in res.output


def test_paper_part_failure_is_recorded_and_the_rest_runs(tmp_path, monkeypatch):
    import gpusparse_bench.paper as paper

    def boom(ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(paper, "_part_batch", boom)
    args = ["bench", "paper", "--device", "cpu", "--scale", "tiny", "--only", "batch,quality", "--out", str(tmp_path)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1
    (path,) = tmp_path.glob("*-cpu-paper.json")
    parts = json.loads(path.read_text())["parts"]
    assert parts["batch"]["status"] == "error" and "boom" in parts["batch"]["reason"]
    assert "RuntimeError" in parts["batch"]["traceback"]
    assert parts["quality"]["status"] == "skipped"  # the next part still ran


# -- where the harness lives -----------------------------------------------------------------


def test_bench_command_without_a_checkout_fails_with_one_line(tmp_path):
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import gpusparse

    # The package alone, as an install has it: no bench/ beside its src/.
    shutil.copytree(Path(gpusparse.__file__).parent, tmp_path / "src" / "gpusparse")
    # the package copy first; packages installed beside the suite (PYTHONPATH on a GPU machine) stay
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not p.rstrip("/").endswith("src")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "src"), *others]))
    argv = [sys.executable, "-m", "gpusparse.cli", "bench", "run", "--quick"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        "gpusparse: error: gpusparse bench needs a source checkout: its harness is bench/gpusparse_bench, not installed"
    ]


def test_only_the_cli_hook_imports_the_harness():
    import re
    from pathlib import Path

    import gpusparse

    root = Path(gpusparse.__file__).parent
    imports = re.compile(r"^\s*(from|import)\s+gpusparse_bench\b", re.MULTILINE)
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if imports.search(p.read_text()))
    assert users == ["cli/bench.py"]
    assert not (root / "bench").exists()  # the harness is not shipped in the package
