"""Fitting what users already have: the engine a search ran and why auto skipped a faster one,
text queries (CLI and API), ``-o -``, Ctrl-C, refusing to overwrite, sharded updates, ids."""

from __future__ import annotations

import gzip
import json
import pickle
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from gpusparse import Index, SparseCollection, engines
from gpusparse.cli import main
from gpusparse.engines.tiled import engine as tiled_engine
from gpusparse.errors import InputError
from gpusparse.search import SearchResults
from gpusparse.topics import is_text_query_file, read_query_texts

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "cranfield"
SPLADE_TINY = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "splade-tiny"


def _small_index() -> Index:
    docs = SparseCollection.from_dicts(
        [{"a": 1.0, "b": 2.0}, {"b": 1.0}, {"c": 3.0}], ids=["d0", "d1", "d2"], vocab=None
    )
    return Index.build(docs)


@pytest.fixture(scope="module")
def sample_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ix") / "index"
    r = CliRunner().invoke(main, ["index", str(SAMPLE / "corpus.jsonl.gz"), "-o", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    return out


# -- the engine ------------------------------------------------------------------------------


def test_search_results_carry_the_engine_and_still_unpack_as_two() -> None:
    index = _small_index()
    res = index.search([{"b": 1.0}], k=2, kernel="reference")
    scores, ids = res
    assert res.engine == "reference" and len(res) == 2
    assert ids.tolist() == [[0, 1]] and torch.equal(scores, res.scores)
    assert pickle.loads(pickle.dumps(res)).engine == "reference"
    assert res._replace(scores=res.scores * 2).engine == "reference"
    assert SearchResults(scores, ids).engine == ""
    auto = index.search([{"b": 1.0}], k=2)
    assert auto.engine == engines.choose("auto", torch.device("cpu")).name


def test_doc_ids_of_names_rows_and_drops_padding() -> None:
    index = _small_index()
    res = index.search([{"b": 1.0}, {"c": 1.0}], k=3)
    assert res.ids.tolist() == [[0, 1, -1], [2, -1, -1]]  # row numbers, padded
    assert index.doc_ids_of(res) == [["d0", "d1"], ["d2"]]


@pytest.fixture
def cuda_without_cupy(monkeypatch: pytest.MonkeyPatch):
    """Pretend a CUDA device is present and CuPy is not (the chooser only; nothing searches)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tiled_engine.cupy_launch, "available", lambda: False)
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name, *a: None)
    engines._warn_once.cache_clear()
    yield
    engines._warn_once.cache_clear()


def test_fallback_reason_names_the_install_command(cuda_without_cupy: None) -> None:
    cuda = torch.device("cuda")
    reason = engines.fallback_reason(cuda)
    assert reason is not None
    assert "'tiled'" in reason and f"pip install 'gpusparse[{engines.cuda_extra()}]'" in reason
    assert engines.fallback_reason("cpu") is None  # off a GPU auto's pick is the best there is


def test_auto_warns_once_per_process(cuda_without_cupy: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = engines.choose("auto", torch.device("cuda"))
        engines.choose("auto", torch.device("cuda"))
    slow = [w for w in caught if issubclass(w.category, engines.SlowEngineWarning)]
    assert first.name != "tiled"
    assert len(slow) == 1 and "pip install 'gpusparse[" in str(slow[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engines.choose("reference", torch.device("cuda"))  # an explicit choice: no warning
    assert not caught


def test_no_warning_when_the_fast_engine_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tiled_engine.cupy_launch, "available", lambda: True)
    engines._warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engines.choose("auto", torch.device("cuda")).name == "tiled"
    assert engines.fallback_reason("cuda") is None and not caught


def test_cli_warns_once_on_one_line(cuda_without_cupy: None, capsys: pytest.CaptureFixture[str]) -> None:
    from gpusparse.cli._common import check_kernel

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CLI prints it; Python's warning machinery stays quiet
        check_kernel("auto", "cuda")
        check_kernel("auto", "cuda")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: kernel 'auto' runs")
    assert "pip install 'gpusparse[" in lines[0]


def test_cuda_extra_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert engines.cuda_extra() == "cuda12"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert engines.cuda_extra() == "cuda13"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert engines.cuda_extra() == "cuda13"


def test_extras_declare_cupy() -> None:
    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["cuda12"][0].startswith("cupy-cuda12x")
    assert extras["cuda13"][0].startswith("cupy-cuda13x")
    assert extras["cuda"] == extras["cuda13"]


# -- the search command ----------------------------------------------------------------------


def test_search_to_stdout_names_the_engine(sample_index: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(
        main, ["search", str(sample_index), str(SAMPLE / "queries.jsonl.gz"), "-k", "5", "-o", "-", "--no-progress"]
    )
    assert r.exit_code == 0, r.output
    assert not Path("-").exists()
    run = [line for line in r.stdout.splitlines() if " Q0 " in line]
    assert run and all(len(line.split()) == 6 for line in run)
    ran = engines.choose("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu")).name
    assert f"with engine {ran}" in r.stderr and "to stdout" in r.stderr
    out = tmp_path / "run.trec"
    r2 = CliRunner().invoke(
        main, ["search", str(sample_index), str(SAMPLE / "queries.jsonl.gz"), "-k", "5", "-o", str(out)]
    )
    assert r2.exit_code == 0, r2.output
    assert out.read_text().splitlines() == run


def test_search_refuses_to_overwrite(sample_index: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.trec"
    out.write_text("keep me\n")
    args = ["search", str(sample_index), str(SAMPLE / "queries.jsonl.gz"), "-k", "2", "-o", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "--overwrite" in r.stderr and len(r.stderr.splitlines()) == 1
    assert out.read_text() == "keep me\n"
    r = CliRunner().invoke(main, [*args, "--overwrite"])
    assert r.exit_code == 0, r.output
    assert " Q0 " in out.read_text()


def test_pipeline_refuses_to_overwrite(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.trec").write_text("keep me\n")
    r = CliRunner().invoke(main, ["pipeline", str(tmp_path / "no-beir"), "-o", str(tmp_path / "out")])
    assert r.exit_code == 1 and "--overwrite" in r.stderr, r.output
    assert (tmp_path / "out" / "run.trec").read_text() == "keep me\n"


def test_ctrl_c_exits_130_with_one_line(sample_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Index, "search", interrupted)
    r = CliRunner().invoke(
        main, ["search", str(sample_index), str(SAMPLE / "queries.jsonl.gz"), "-o", str(tmp_path / "r")]
    )
    assert r.exit_code == 130
    assert [line for line in r.stderr.splitlines() if line.strip()][-1] == "gpusparse: interrupted"
    assert "Traceback" not in r.output and "Aborted" not in r.output


def test_updates_of_a_sharded_folder(tmp_path: Path) -> None:
    """Sharded folders take add/delete/compact (tests/test_shard_updates.py): a missing vector
    file is one line, and compacting a folder as index --shards made it writes nothing."""
    out = tmp_path / "sh"
    r = CliRunner().invoke(main, ["index", str(SAMPLE / "corpus.jsonl.gz"), "--shards", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    manifest = (out / "manifest.json").read_bytes()
    r = CliRunner().invoke(main, ["add", str(out), str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 1
    assert len(r.stderr.splitlines()) == 1 and "missing.jsonl" in r.stderr
    r = CliRunner().invoke(main, ["compact", str(out)])
    assert r.exit_code == 0 and "shard sizes already even" in r.stderr, r.stderr
    assert (out / "manifest.json").read_bytes() == manifest


# -- text queries ----------------------------------------------------------------------------


def test_text_query_files_are_told_from_vector_files(tmp_path: Path) -> None:
    beir = tmp_path / "queries.jsonl"
    beir.write_text('{"_id": "q1", "text": "wing flutter"}\n{"_id": "q2", "text": null}\n')
    anserini = tmp_path / "topics.jsonl.gz"
    with gzip.open(anserini, "wt") as f:
        f.write(json.dumps({"qid": "7", "title": "heat transfer"}) + "\n")
    tsv = tmp_path / "topics.tsv"
    tsv.write_text("1\twing flutter\n\n2\tboundary layer\n")
    assert read_query_texts(beir).texts == ["wing flutter", ""]
    assert read_query_texts(anserini).ids == ["7"] and read_query_texts(anserini).texts == ["heat transfer"]
    assert read_query_texts(tsv).ids == ["1", "2"]
    assert all(map(is_text_query_file, (beir, anserini, tsv)))
    assert not is_text_query_file(SAMPLE / "queries.jsonl.gz")  # vectors
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\tok\nno tab here\n")
    with pytest.raises(InputError, match=r"bad.tsv:2"):
        read_query_texts(bad)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"qid": "1", "query": "a"}\n{"qid": "1", "query": "b"}\n')
    with pytest.raises(InputError, match="duplicate"):
        read_query_texts(dup)


def test_text_queries_without_model_get_a_hint(sample_index: Path, tmp_path: Path) -> None:
    q = tmp_path / "queries.jsonl"
    q.write_text('{"_id": "1", "text": "wing flutter"}\n')
    r = CliRunner().invoke(main, ["search", str(sample_index), str(q), "-o", str(tmp_path / "run")])
    assert r.exit_code == 1
    assert r.stderr.strip().endswith(
        "these are text queries: pass --model MODEL (the SPLADE model of the corpus) to encode them"
    )
    assert len(r.stderr.splitlines()) == 1 and "vector" not in r.stderr


def test_index_search_takes_texts_only_with_an_encoder() -> None:
    index = _small_index()
    with pytest.raises(TypeError, match="attach an encoder"):
        index.search(["b"], k=2)

    class Words:
        vocab = index.vocab

        def encode_queries(self, texts: list[str], ids: list[str]) -> SparseCollection:
            return SparseCollection.from_dicts([dict.fromkeys(t.split(), 1.0) for t in texts], ids, index.vocab)

    index.attach_encoder(Words())
    assert index.search("b", k=2).ids.tolist() == [[0, 1]]
    assert index.retrieve({"q": "c"}, k=2) == {"q": [("d2", 3.0)]}
    assert list(index.retrieve(["a", "c"], k=1)) == ["0", "1"]
    with pytest.raises(TypeError, match="encode_queries"):
        index.attach_encoder(object())


@pytest.fixture(scope="module")
def splade_tiny():
    pytest.importorskip("transformers")
    if not SPLADE_TINY.is_dir():
        pytest.skip("../shared/models/splade-tiny is absent")
    from gpusparse.encode import SpladeEncoder

    return SpladeEncoder(SPLADE_TINY, device="cpu")


def test_cli_text_queries_equal_the_api(sample_index: Path, tmp_path: Path, splade_tiny) -> None:
    q = tmp_path / "topics.tsv"
    texts = {"1": "similarity laws for aeroelastic models", "2": "heat transfer in boundary layers"}
    q.write_text("".join(f"{k}\t{v}\n" for k, v in texts.items()))
    r = CliRunner().invoke(
        main, ["search", str(sample_index), str(q), "--model", str(SPLADE_TINY), "-k", "10", "-o", "-",
               "--encode-device", "cpu", "--no-progress"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    cli = [line.split()[:3] for line in r.stdout.splitlines() if " Q0 " in line]
    index = Index.load(sample_index).attach_encoder(splade_tiny)
    api = index.retrieve(texts, k=10)
    assert cli == [[qid, "Q0", d] for qid, rows in api.items() for d, _ in rows]
    assert len(cli) == 20


def test_hub_id_offline_fails_fast_with_the_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from gpusparse import encode, encode_models

    monkeypatch.setattr(encode_models, "hub_reachable", lambda timeout=3.0: False)
    t0 = time.perf_counter()
    with pytest.raises(InputError, match="HF_HUB_OFFLINE=1") as err:
        encode.load_masked_lm("no-such-org/no-such-splade-model")
    assert time.perf_counter() - t0 < 20
    assert "model folder" in str(err.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(encode_models, "hub_reachable", lambda timeout=3.0: pytest.fail("probed although offline"))
    with pytest.raises(InputError, match="not in the local cache"):
        encode.load_masked_lm("no-such-org/no-such-splade-model")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_results_name_the_engine_that_ran() -> None:
    from gpusparse.kernels import cupy_launch

    index = _small_index()
    res = index.search([{"b": 1.0}], k=2, device="cuda")
    expected = "tiled" if cupy_launch.available() else engines.choose("auto", torch.device("cuda")).name
    assert res.engine == expected and res.ids.tolist() == [[0, 1]]
    assert (engines.fallback_reason("cuda") is None) == cupy_launch.available()
