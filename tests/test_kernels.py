"""The Triton score kernels against a dense float64 brute force, and through exact top-k.

Without a GPU the kernels run in Triton's CPU interpreter, which must be switched on
before anything imports Triton: hence the lines above the other imports.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before tests/test_kernels.py could set TRITON_INTERPRET=1; "
            "set it in the environment (or a conftest) to run the kernel tests without a GPU"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp

from gpusparse import Index, SparseCollection
from gpusparse.exact import pad_results, select_exact_topk
from gpusparse.kernels import docpar_scores, scatter_add_scores, triton_available
from gpusparse.layout.forward import forward_index
from gpusparse.queries import QueryBatch, query_batch
from gpusparse.topk import merge_topk

from .conftest import require_cuda_kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = ("scatter", "docpar")
RTOL = 1e-5  # of the row's largest score: float32 sums of a few dozen products

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs Triton and a GPU or TRITON_INTERPRET=1")


# -- data ---------------------------------------------------------------------------------


def random_csr(
    rng: np.random.Generator,
    n_rows: int,
    n_cols: int,
    density: float,
    *,
    eighths: bool = False,
    empty_rows: tuple[int, ...] = (),
) -> sp.csr_matrix:
    """Random non-negative sparse rows; ``eighths``: weights in {1/8, 2/8, 3/8, 4/8} (exact sums, real ties)."""
    m = sp.random(n_rows, n_cols, density=density, format="csr", random_state=rng, dtype=np.float64)
    m.data = np.ceil(m.data * 4) / 8 if eighths else m.data * 3
    for r in empty_rows:
        m.data[m.indptr[r] : m.indptr[r + 1]] = 0
    m.eliminate_zeros()
    return m.astype(np.float32)


@dataclass
class Case:
    docs: sp.csr_matrix
    queries: sp.csr_matrix
    index: Index
    batch: QueryBatch
    ref: np.ndarray  # float64 [B, N]: the brute-force scores

    @property
    def n_docs(self) -> int:
        return self.docs.shape[0]

    def ref_window(self, d0: int, width: int) -> np.ndarray:
        """Reference scores of documents ``d0 .. d0 + width - 1`` (0 past the collection)."""
        out = np.zeros((self.ref.shape[0], width))
        n = max(0, min(self.n_docs, d0 + width) - d0)
        out[:, :n] = self.ref[:, d0 : d0 + n]
        return out


def make_case(docs: sp.csr_matrix, queries: sp.csr_matrix, device: torch.device = DEVICE) -> Case:
    index = Index.build(SparseCollection.from_scipy(docs), device=device)
    batch = query_batch(SparseCollection.from_scipy(queries), index.device)
    ref = queries.toarray().astype(np.float64) @ docs.toarray().astype(np.float64).T
    return Case(docs, queries, index, batch, ref)


def build_case(name: str) -> Case:
    rng = np.random.default_rng(CASES.index(name))
    if name == "basic":
        return make_case(random_csr(rng, 300, 50, 0.1), random_csr(rng, 6, 50, 0.15))
    if name == "long_lists":  # ~400 postings a list: several BLOCK_PL chunks
        return make_case(random_csr(rng, 700, 6, 0.6), random_csr(rng, 3, 6, 0.7))
    if name == "empty_queries":  # rows 0, 2 and the last have no terms
        return make_case(random_csr(rng, 200, 40, 0.1), random_csr(rng, 5, 40, 0.2, empty_rows=(0, 2, 4)))
    if name == "empty_docs":  # empty documents at both ends and inside; many terms with no postings
        docs = random_csr(rng, 150, 400, 0.01, empty_rows=(0, 1, 70, 149))
        return make_case(docs, random_csr(rng, 4, 400, 0.05))
    if name == "single_doc":
        return make_case(random_csr(rng, 1, 30, 0.5), random_csr(rng, 4, 30, 0.5))
    if name == "single_term":
        return make_case(random_csr(rng, 90, 1, 0.6), random_csr(rng, 2, 1, 1.0))
    raise KeyError(name)


CASES = ("basic", "long_lists", "empty_queries", "empty_docs", "single_doc", "single_term")


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    return {name: build_case(name) for name in CASES}


def windows(n: int) -> list[tuple[int, int]]:
    """Document ranges ``(d0, width)``: whole, wider than the collection, inside, across and past its end."""
    return [(0, n), (0, n + 37), (n // 3, n // 2), (max(0, n - 3), 9), (n + 5, 4)]


# -- running and checking -----------------------------------------------------------------


def run_kernel(name: str, case: Case, d0: int, width: int, out: torch.Tensor | None = None, **kw) -> torch.Tensor:
    if name == "scatter":
        return scatter_add_scores(case.index, case.batch, d0, width, out, **kw)
    return docpar_scores(case.index, case.batch, d0, width, forward_index(case.index), out, **kw)


def assert_scores_close(got: torch.Tensor, ref: np.ndarray, what: str) -> None:
    """Within ``RTOL`` of each row's largest score, exactly 0 where no term is shared; names the bad cells."""
    assert got.dtype == torch.float32, what
    g = got.cpu().numpy().astype(np.float64)
    assert g.shape == ref.shape, f"{what}: shape {g.shape}, expected {ref.shape}"
    tol = RTOL * np.abs(ref).max(axis=1, keepdims=True, initial=0.0)
    ok = (np.abs(g - ref) <= tol) & ((ref != 0) | (g == 0))  # NaN fails both
    if not ok.all():
        bad = np.argwhere(~ok)
        cells = ", ".join(f"[{r}, {c}] got {g[r, c]!r} want {ref[r, c]!r}" for r, c in bad[:8])
        raise AssertionError(f"{what}: {len(bad)} of {ok.size} scores wrong: {cells}")


def poisoned(b: int, width: int) -> torch.Tensor:
    return torch.full((b, width), float("nan"), dtype=torch.float32, device=DEVICE)


# -- scores -------------------------------------------------------------------------------


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_scores_match_float64(kernel: str, case_name: str, cases: dict[str, Case]) -> None:
    case = cases[case_name]
    b = case.queries.shape[0]
    for d0, width in windows(case.n_docs):
        ref = case.ref_window(d0, width)
        what = f"{kernel} {case_name} d0={d0} width={width}"
        assert_scores_close(run_kernel(kernel, case, d0, width), ref, what)
        out = poisoned(b, width)
        got = run_kernel(kernel, case, d0, width, out)
        assert got is out, f"{what}: out was not filled in place"
        assert_scores_close(got, ref, what + " (NaN-poisoned out)")


@pytest.mark.parametrize("block_pl", [32, 64, 128])
def test_scatter_block_sizes(block_pl: int, cases: dict[str, Case]) -> None:
    case = cases["long_lists"]
    for d0, width in [(0, case.n_docs), (101, 350)]:
        got = scatter_add_scores(case.index, case.batch, d0, width, block_pl=block_pl)
        assert_scores_close(got, case.ref_window(d0, width), f"block_pl={block_pl} d0={d0}")


@pytest.mark.parametrize("block_d", [1, 16, 64])
def test_docpar_block_sizes(block_d: int, cases: dict[str, Case]) -> None:
    case = cases["empty_queries"]  # 200 documents; block_d=1 runs one program per (query, document)
    fwd = forward_index(case.index)
    for d0, width in [(0, 48), (170, 40)]:
        got = docpar_scores(case.index, case.batch, d0, width, fwd, block_d=block_d)
        assert_scores_close(got, case.ref_window(d0, width), f"block_d={block_d} d0={d0}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n_queries", [0, 3])
def test_batches_without_terms(kernel: str, n_queries: int, cases: dict[str, Case]) -> None:
    """No queries at all, or queries without terms (``padded_terms`` is ``[B, 0]``): all zeros."""
    base = cases["basic"]
    queries = sp.csr_matrix((n_queries, base.docs.shape[1]), dtype=np.float32)
    case = make_case(base.docs, queries)
    assert case.batch.padded_terms.shape == (n_queries, 0)
    out = run_kernel(kernel, case, 0, 40, poisoned(n_queries, 40))
    assert_scores_close(out, np.zeros((n_queries, 40)), kernel)


@pytest.mark.parametrize("chunk", [1 << 23, 7, 1])
def test_forward_index_is_document_major_csr(chunk: int, cases: dict[str, Case]) -> None:
    """Built in pieces of ``chunk`` postings (a piece ends inside lists and documents)."""
    for name in ("basic", "empty_docs", "single_doc"):
        case = cases[name]
        indptr, terms, weights = forward_index(case.index, chunk=chunk)
        assert (indptr.dtype, terms.dtype, weights.dtype) == (torch.int64, torch.int32, torch.float32)
        want = sp.csr_matrix(case.docs)
        want.sort_indices()
        np.testing.assert_array_equal(indptr.cpu().numpy(), want.indptr, err_msg=name)
        np.testing.assert_array_equal(terms.cpu().numpy(), want.indices, err_msg=name)
        np.testing.assert_array_equal(weights.cpu().numpy(), want.data, err_msg=name)


# -- exact top-k --------------------------------------------------------------------------


def reference_topk(ref: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by score desc then id asc, matching documents only; padding -1 / 0."""
    b, n = ref.shape
    ids = np.full((b, k), -1, dtype=np.int64)
    scores = np.zeros((b, k), dtype=np.float32)
    for r in range(b):
        order = np.lexsort((np.arange(n), -ref[r]))[:k]
        order = order[ref[r, order] > 0]
        ids[r, : order.size] = order
        scores[r, : order.size] = ref[r, order]
    return scores, ids


def chunked_topk(kernel: str, case: Case, k: int, chunk: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel scores chunk by chunk, exact top-k of each, merged: as search drives the kernels."""
    best = None
    for d0 in range(0, case.n_docs, chunk):
        width = min(chunk, case.n_docs - d0)
        approx = run_kernel(kernel, case, d0, width, poisoned(case.queries.shape[0], width), **kw)
        top = select_exact_topk(case.index, case.batch, approx, k, d0)
        best = top if best is None else merge_topk(best, top, k)
    return pad_results(best, k, case.queries.shape[0], case.index.device)


def assert_topk_equal(got: tuple[torch.Tensor, torch.Tensor], ref: np.ndarray, k: int, what: str) -> None:
    want_scores, want_ids = reference_topk(ref, k)
    scores, ids = (t.cpu().numpy() for t in got)
    for r in range(ids.shape[0]):
        if not np.array_equal(ids[r], want_ids[r]):
            raise AssertionError(f"{what}: query {r} ids {ids[r].tolist()} want {want_ids[r].tolist()}")
    np.testing.assert_array_equal(scores, want_scores, err_msg=what)


@pytest.mark.parametrize("kernel", KERNELS)
def test_exact_topk_with_ties(kernel: str) -> None:
    rng = np.random.default_rng(8)
    case = make_case(random_csr(rng, 400, 12, 0.3, eighths=True), random_csr(rng, 5, 12, 0.3, eighths=True))
    # Weights in eighths: every float32 sum is exact, so the kernels agree with float64
    # bit for bit and equal scores are real ties.
    full = run_kernel(kernel, case, 0, case.n_docs)
    np.testing.assert_array_equal(full.cpu().numpy(), case.ref.astype(np.float32))
    ref_sorted = np.sort(case.ref, axis=1)[:, ::-1]
    assert (ref_sorted[:, 9] == ref_sorted[:, 10]).any(), "the data should have ties at the cut"
    for chunk in (case.n_docs, 97):
        assert_topk_equal(chunked_topk(kernel, case, 10, chunk), case.ref, 10, f"{kernel} chunk={chunk}")


# -- argument checks ----------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_rejects_bad_arguments(kernel: str, cases: dict[str, Case]) -> None:
    case = cases["basic"]
    b = case.queries.shape[0]
    with pytest.raises(TypeError, match="float32"):
        run_kernel(kernel, case, 0, 10, torch.zeros((b, 10), dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="shape"):
        run_kernel(kernel, case, 0, 10, torch.zeros((b, 11), device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        run_kernel(kernel, case, 0, 10, torch.zeros((10, b), device=DEVICE).t())
    with pytest.raises(ValueError, match="meta"):
        run_kernel(kernel, case, 0, 10, torch.zeros((b, 10), device="meta"))
    with pytest.raises(ValueError, match="d0"):
        run_kernel(kernel, case, -1, 10)
    with pytest.raises(TypeError, match="width"):
        run_kernel(kernel, case, 0, 10.0)
    with pytest.raises(TypeError, match="d0"):
        run_kernel(kernel, case, True, 10)
    with pytest.raises(TypeError, match="QueryBatch"):
        fn = scatter_add_scores if kernel == "scatter" else docpar_scores
        fn(case.index, tuple(case.batch), 0, 10, *([] if kernel == "scatter" else [forward_index(case.index)]))
    bad = case.batch._replace(padded_weights=case.batch.padded_weights.double())
    with pytest.raises(TypeError, match="padded_weights"):
        run_kernel(kernel, Case(case.docs, case.queries, case.index, bad, case.ref), 0, 10)


def test_rejects_bad_block_sizes_and_forward(cases: dict[str, Case]) -> None:
    case = cases["basic"]
    with pytest.raises(ValueError, match="power of two"):
        scatter_add_scores(case.index, case.batch, 0, 10, block_pl=96)
    with pytest.raises(ValueError, match="power of two"):
        scatter_add_scores(case.index, case.batch, 0, 10, block_pl=8)
    with pytest.raises(ValueError, match="power of two"):
        docpar_scores(case.index, case.batch, 0, 10, forward_index(case.index), block_d=24)
    indptr, terms, weights = forward_index(case.index)
    with pytest.raises(ValueError, match="n_docs"):
        docpar_scores(case.index, case.batch, 0, 10, (indptr[:-1].contiguous(), terms, weights))
    with pytest.raises(TypeError, match="int32"):
        docpar_scores(case.index, case.batch, 0, 10, (indptr, terms.long(), weights))
    with pytest.raises(TypeError, match="triple"):
        docpar_scores(case.index, case.batch, 0, 10, (indptr, terms))


def test_import_without_triton() -> None:
    """``import gpusparse.kernels`` neither needs nor imports Triton; using a kernel says what to install."""
    code = (
        "import sys\n"
        "import gpusparse.kernels as k\n"
        "assert 'triton' not in sys.modules, 'importing gpusparse.kernels imported triton'\n"
        "sys.modules['triton'] = None\n"
        "assert not k.triton_available()\n"
        "try:\n"
        "    k.scatter_add_scores\n"
        "except ImportError as e:\n"
        "    assert 'pip install triton' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr


# -- on a GPU, at a larger size -----------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def large_case() -> Case:
    rng = np.random.default_rng(20_000)
    docs = random_csr(rng, 20_000, 1000, 0.03, eighths=True)  # ~30 terms a document, ~600 a list
    return make_case(docs, random_csr(rng, 64, 1000, 0.02, eighths=True), torch.device("cuda"))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block", [None, "small", "large"])
def test_gpu_large_scores(kernel: str, block: str | None, large_case: Case) -> None:
    case = large_case
    kw = {}
    if block is not None:
        key = "block_pl" if kernel == "scatter" else "block_d"
        kw[key] = {"scatter": {"small": 32, "large": 512}, "docpar": {"small": 8, "large": 128}}[kernel][block]
    for d0, width in [*windows(case.n_docs), (5_000, 5_000)]:
        out = torch.full((case.queries.shape[0], width), float("nan"), device="cuda")
        got = run_kernel(kernel, case, d0, width, out, **kw)
        ref = case.ref_window(d0, width)
        # Eighths: the float32 sums are exact whatever the order.
        np.testing.assert_array_equal(got.cpu().numpy(), ref.astype(np.float32), err_msg=f"{kernel} {kw} d0={d0}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_large_exact_topk(kernel: str, large_case: Case) -> None:
    for chunk in (large_case.n_docs, 6_000):
        got = chunked_topk(kernel, large_case, 100, chunk)
        assert_topk_equal(got, large_case.ref, 100, f"{kernel} chunk={chunk}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width", [1, 7, 1000, 3024, 4096])
def test_row_sort_of_keys_equals_torch_topk(rng, width: int) -> None:
    """top_keys's one-block-per-row bitonic sort against torch.topk: distinct keys, zeros
    for empty slots, rows shorter and longer than k, counts from 0 past the width."""
    from gpusparse.kernels import rowsort
    from gpusparse.topk import encode_keys, top_keys

    require_cuda_kernels()
    b = 37
    scores = torch.from_numpy(rng.choice([0.0, 0.5, 1.25, 3.0], (b, width)).astype(np.float32))  # many ties
    ids = torch.from_numpy(np.stack([rng.permutation(1 << 20)[:width] for _ in range(b)]))
    keys = torch.where(scores > 0, encode_keys(scores, ids), torch.zeros((), dtype=torch.int64)).cuda()
    count = torch.from_numpy(rng.integers(0, width + 3, b).astype(np.int32)).cuda()
    count[:3] = torch.tensor([0, width, width + 2], dtype=torch.int32)
    cut = torch.where(torch.arange(width, device="cuda")[None, :] < count[:, None].long(), keys, 0)
    for k in (1, 10, width, width + 5, 1000):
        want = torch.topk(keys, min(k, width), dim=1).values
        assert torch.equal(rowsort.top_keys_cuda(keys, k), want), k
        assert torch.equal(top_keys(keys, k), want), k  # the policy takes the kernel
        want_cut = torch.topk(cut, min(k, width), dim=1).values
        assert torch.equal(rowsort.top_keys_cuda(keys, k, count), want_cut), k
    with pytest.raises(ValueError, match="at most"):
        rowsort.top_keys_cuda(torch.zeros((2, rowsort.MAX_WIDTH + 1), dtype=torch.int64, device="cuda"), 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("runs", "length"), [(1, 10), (2, 1000), (3, 50), (4, 1000), (8, 33)])
def test_packed_merge_of_process_results_equals_the_pytorch_merge(rng, runs: int, length: int) -> None:
    """pack_results_cuda and merge_gathered_cuda (the NCCL merge's two kernels) against
    result_keys, merge_keys and the flags' any, the PyTorch merge of the gloo path: ranked
    rows with empty slots (id -1 or score 0), redo flags, k below, at and above the total."""
    from gpusparse.kernels import rowsort
    from gpusparse.topk import decode_keys, encode_keys, merge_keys, result_keys

    require_cuda_kernels()
    b = 23
    per_run = []
    # distinct ids in a row across processes (their shards are disjoint)
    all_ids = np.stack([rng.permutation(4 * runs * length)[: runs * length] for _ in range(b)])
    for q in range(runs):  # a process's ranked results, padded as search returns them
        scores = torch.from_numpy(rng.choice([0.5, 1.25, 3.0, 7.0], (b, length)).astype(np.float32))
        ids = torch.from_numpy(all_ids[:, q * length : (q + 1) * length])
        keys = torch.sort(encode_keys(scores, ids), dim=1, descending=True).values
        real = torch.from_numpy(rng.integers(0, length + 1, b))
        s, i = decode_keys(keys)
        empty = torch.arange(length)[None, :] >= real[:, None]
        s = torch.where(empty, torch.zeros_like(s), s)
        i = torch.where(empty & torch.from_numpy(rng.random((b, length)) < 0.5), torch.full_like(i, -1), i)
        flags = torch.from_numpy(rng.random(b) < 0.2)
        per_run.append((s, i, flags))
    sent = [rowsort.pack_results_cuda(s.cuda(), i.cuda(), f.cuda()) for s, i, f in per_run]
    for (s, i, f), got in zip(per_run, sent, strict=True):
        want = torch.cat([result_keys(s, i), f.to(torch.int64)[:, None]], 1)
        assert torch.equal(got.cpu(), want)
    gathered = torch.cat(sent, 0)  # what all_gather_into_tensor returns
    for k in (1, length, runs * length, runs * length + 4):
        got_s, got_i, got_f = rowsort.merge_gathered_cuda(gathered, runs, k, flags=True)
        want_s, want_i = merge_keys(torch.cat([result_keys(s, i) for s, i, _ in per_run], 1), k)
        assert torch.equal(got_s.cpu(), want_s) and torch.equal(got_i.cpu(), want_i), k
        assert torch.equal(got_f.cpu(), torch.stack([f for _, _, f in per_run]).any(0)), k
        assert rowsort.merge_gathered_cuda(gathered, runs, k)[2] is None
    for bad in (0, runs * b + 1):
        with pytest.raises(ValueError, match="processes' rows"):
            rowsort.merge_gathered_cuda(gathered, bad, 5)


# -- the CUDA kernels' launch helper (no GPU, no CuPy: a stand-in records what would compile) --

CUDA_KERNELS = {  # .cu file -> the kernels its launchers look up in it
    "tile_candidates.cu": ["tiled_candidates"],
    "compact.cu": ["compact_candidates"],
    "rescore.cu": ["exact_scores_kernel", "candidate_keys"],
    "rowsort.cu": ["top_keys", "pack_results", "merge_gathered"],
    "finish.cu": ["finish_rows"],
    "query_params.cu": ["query_params"],
    "query_rows.cu": ["query_rows"],
}


def test_cuda_sources_are_package_data() -> None:
    """Every launcher's .cu file is in the package, declared as package data, and defines its kernels."""
    import tomllib
    from importlib import resources
    from pathlib import Path

    from gpusparse.kernels import (
        compact,
        cupy_launch,
        finish,
        query_params,
        query_rows,
        rescore,
        rowsort,
        tile_candidates,
    )

    folder = resources.files("gpusparse.kernels").joinpath("cuda")
    on_disk = sorted(p.name for p in folder.iterdir() if p.name.endswith(".cu"))
    assert on_disk == sorted(CUDA_KERNELS)
    launchers = (compact, finish, query_params, query_rows, rescore, rowsort, tile_candidates)
    assert {m.SOURCE for m in launchers} == set(CUDA_KERNELS)
    for name, kernels in CUDA_KERNELS.items():
        text = cupy_launch.source(name)
        for kernel in kernels:
            assert f" {kernel}(" in text and 'extern "C" __global__' in text, (name, kernel)
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["gpusparse"]
    assert "kernels/cuda/*.cu" in globs


class _FakeCupy:
    """What get_kernel uses of CuPy: RawModule(code, options).get_function(name), cuda.Device(i)."""

    def __init__(self) -> None:
        self.compiled: list[tuple[str, tuple[str, ...], int | None]] = []
        self.device: int | None = None
        fake = self

        class Device:
            def __init__(self, index: int | None = None) -> None:
                self.index = index

            def __enter__(self) -> None:
                self.before, fake.device = fake.device, self.index

            def __exit__(self, *exc: object) -> None:
                fake.device = self.before

        class RawModule:
            def __init__(self, code: str, options: tuple[str, ...] = ()) -> None:
                fake.compiled.append((code, options, fake.device))

            def get_function(self, name: str) -> SimpleNamespace:
                return SimpleNamespace(name=name, device=fake.device, max_dynamic_shared_size_bytes=0)

        self.RawModule = RawModule
        self.cuda = SimpleNamespace(Device=Device)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> _FakeCupy:
    from gpusparse.kernels import cupy_launch

    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cupy_launch, "_MODULES", {})  # the real caches stay untouched
    monkeypatch.setattr(cupy_launch, "_KERNELS", {})
    return fake


def test_kernel_cache_keys_on_source_name_options_and_device(fake_cupy: _FakeCupy) -> None:
    from gpusparse.kernels.cupy_launch import get_kernel, kernel_key

    code = '// a test source\nextern "C" __global__ void a() {}\nextern "C" __global__ void b() {}\n'
    key = kernel_key(code, "a", ["-DX=1"], 0)
    assert key == kernel_key(code, "a", ("-DX=1",), 0)
    others = [
        kernel_key(code + " ", "a", ["-DX=1"], 0),
        kernel_key(code, "b", ["-DX=1"], 0),
        kernel_key(code, "a", ["-DX=2"], 0),
        kernel_key(code, "a", ["-DX=1", "-DY"], 0),
        kernel_key(code, "a", ["-DX=1"], 1),
        kernel_key(code, "a", ["-DX=1"], 0, max_dynamic_shared=1 << 16),
    ]
    assert len({key, *others}) == len(others) + 1
    a0 = get_kernel(code, "a", options=["-DX=1"], device=0)
    assert a0 is get_kernel(code, "a", options=("-DX=1",), device=0)  # cached
    assert a0.device == 0 and fake_cupy.compiled == [(code, ("-DX=1",), 0)]
    get_kernel(code, "b", options=("-DX=1",), device=0)  # same module: no second compilation
    assert len(fake_cupy.compiled) == 1
    get_kernel(code, "a", options=("-DX=2",), device=0)
    a1 = get_kernel(code, "a", options=("-DX=1",), device=1)
    assert a1 is not a0 and a1.device == 1
    assert fake_cupy.compiled[1:] == [(code, ("-DX=2",), 0), (code, ("-DX=1",), 1)]
    big = get_kernel(code, "a", options=("-DX=1",), device=0, max_dynamic_shared=1 << 16)
    assert big.max_dynamic_shared_size_bytes == 1 << 16 and a0.max_dynamic_shared_size_bytes == 0


def test_variant_changes_source_and_defines_only_inside_its_block(fake_cupy: _FakeCupy) -> None:
    from gpusparse.kernels.cupy_launch import load_kernel, source, variant

    load_kernel("compact.cu", "compact_candidates", device=0)
    with variant("compact.cu", defines=("PROFILE_X",)):
        load_kernel("compact.cu", "compact_candidates", options=("-DA",), device=0)
        load_kernel("rowsort.cu", "top_keys", device=0)  # another file: unchanged
    with variant("rescore.cu", code="// an older rescore.cu\n"):
        load_kernel("rescore.cu", "candidate_keys", device=0)
    load_kernel("rescore.cu", "candidate_keys", device=0)
    assert fake_cupy.compiled == [
        (source("compact.cu"), (), 0),
        (source("compact.cu"), ("-DA", "-DPROFILE_X"), 0),
        (source("rowsort.cu"), (), 0),
        ("// an older rescore.cu\n", (), 0),
        (source("rescore.cu"), (), 0),
    ]


def test_tile_candidates_build_options() -> None:
    """The launch knobs reach the compile options (profiling passes them instead of setting globals)."""
    from gpusparse.kernels.tile_candidates import compile_options, launch_shape

    assert launch_shape(13, "u32") == (256, 4)
    assert launch_shape(13, "u32", threads=512, min_blocks=2) == (512, 2)
    assert launch_shape(13, "u32", threads=512)[1] == 3  # blocks per SM follow the threads given
    # a large batch of 8-bit levels: a fifth block where shared memory has room (8K tiles, 32-bit sums),
    # a sixth for queries of at most SHORT_WIDTH terms (the build's MAXT is then 128)
    from gpusparse.kernels.tile_candidates import SHORT_WIDTH, block_shared_bytes

    assert launch_shape(13, "u32", batch=256, levels=True) == (256, 5)  # width not given
    assert launch_shape(13, "u32", batch=256, levels=True, width=SHORT_WIDTH + 1) == (256, 5)
    assert launch_shape(13, "u32", batch=256, levels=True, width=SHORT_WIDTH) == (256, 6)
    assert launch_shape(13, "u32", batch=256, width=40) == (256, 4)  # float32
    assert launch_shape(13, "u32", batch=127, levels=True, width=40) == (256, 4)
    assert launch_shape(13, "carry", batch=256, levels=True, width=40) == (256, 3)
    assert launch_shape(14, "u32", batch=256, levels=True, width=40) == launch_shape(14, "u32") == (512, 3)
    # six blocks of 8K tiles fit an SM's 228 KB only with the smaller static arrays
    assert 6 * block_shared_bytes(13, "u32", 6) <= 228 << 10 < 6 * block_shared_bytes(13, "u32", 5)
    opts = compile_options(13, 256, 4, 4, "u32", "unsigned char", True, False, ("PROFILE_SKIP_DENSE",))
    assert opts == (
        "--std=c++17", "-DTILE_BITS=13", "-DTHREADS=256", "-DUNROLL=4", "-DMIN_BLOCKS=4", "-DACC_MODE=1",
        "-DWT=unsigned_char", "-DINT_W=1", "-DFIXED_W=0", "-DFIXED_STORED=0", "-DPACKED=0", "-DSELECT=1",
        "-DDENSE_LISTS=0", "-DOCTS=0", "-DMETA=0",
        "-DPROFILE_SKIP_DENSE",
    )  # fmt: skip
    fixed = compile_options(14, 512, 4, 3, "u32", "float", False, True)
    assert fixed[-9:-4] == ("-DWT=float", "-DINT_W=0", "-DFIXED_W=1", "-DFIXED_STORED=0", "-DPACKED=0")
    stored = compile_options(14, 512, 4, 3, "u32", "unsigned int", False, True)
    assert stored[-9:-4] == ("-DWT=unsigned_int", "-DINT_W=0", "-DFIXED_W=1", "-DFIXED_STORED=1", "-DPACKED=0")
    packed = compile_options(13, 256, 4, 4, "u32", "float", False, True, packed=True)
    assert packed[-9:-3] == ("-DWT=float", "-DINT_W=0", "-DFIXED_W=1", "-DFIXED_STORED=0", "-DPACKED=1", "-DSELECT=1")
    assert compile_options(13, 256, 4, 4, "u32", "float", False, True, select=False)[-4] == "-DSELECT=0"
    lists = compile_options(13, 256, 4, 4, "u32", "unsigned int", False, True, dense_lists=True)
    assert lists[-3] == "-DDENSE_LISTS=1"
    assert compile_options(13, 256, 4, 4, "u32", "unsigned char", True, octs=True)[-2] == "-DOCTS=1"
    assert compile_options(13, 256, 4, 4, "u32", "unsigned char", True, octs=True, meta=True)[-1] == "-DMETA=1"


def test_the_records_buffer_is_bounded_and_counted_in_the_search_bytes(monkeypatch) -> None:
    """META's records take 8 bytes a (query, padded term + 1) a tile, for batches of at least
    META_MIN_BATCH queries, at most META_MAX_BYTES (whole tiles); search_bytes counts them for
    8-bit layouts (later waves' tiles, the graphs' widest padding)."""
    from gpusparse.engines.tiled import waves
    from gpusparse.kernels import tile_candidates as tc

    b, width = tc.META_MIN_BATCH, 64
    per_tile = b * (width + 1) * 8
    assert tc.meta_bytes(b - 1, width, 10) == 0 and tc.meta_bytes(b, width, 0) == 0
    assert tc.meta_bytes(b, width, 3) == 3 * per_tile
    monkeypatch.setattr(tc, "META_MAX_BYTES", 5 * per_tile + 1)
    assert tc.meta_bytes(b, width, 100) == 5 * per_tile
    monkeypatch.setattr(tc, "META_MAX_BYTES", per_tile - 1)
    assert tc.meta_bytes(b, width, 100) == 0
    monkeypatch.setattr(tc, "META_MAX_BYTES", 1 << 40)
    plan = waves.wave_plan(1000, 256, 10, 132)
    later = waves.largest_later_wave(plan)
    assert later == max(n for first, n in plan if first > 0)
    extra = waves.search_bytes(1000, 256, 10, 132, levels=True) - waves.search_bytes(1000, 256, 10, 132)
    assert extra == later * 256 * (tc.SHORT_WIDTH + 1) * 8 > 0
    assert waves.search_bytes(1000, 8, 10, 132, levels=True) == waves.search_bytes(1000, 8, 10, 132)


def test_tile_meta_takes_fewer_tiles_a_warp_in_small_launches() -> None:
    """One tile a warp per 32 tiles of the launch, from 1 to META_TILES (measured: 2 in the 8.8M
    search's 64-tile launch, 4 in its 506-tile ones)."""
    from gpusparse.kernels import tile_candidates as tc

    assert [tc.meta_tiles(n) for n in (1, 31, 32, 64, 96, 127, 128, 506, 10_000)] == [1, 1, 1, 2, 3, 3, 4, 4, 4]
    assert tc.META_TILES == 4


def test_the_kernels_group_sizes_match_the_launchers() -> None:
    """The postings of an oct are written in both the CUDA source and Python (the layout pads its
    sparse arrays to them, the kernel reads them): a change to one side alone must fail. The
    tiles a warp of tile_meta takes are an argument of its launch, not a size of the source."""
    import re

    from gpusparse.kernels import tile_candidates as tc
    from gpusparse.kernels.cupy_launch import source
    from gpusparse.layout.tiled import OCT

    text = source(tc.SOURCE)
    defined = dict(re.findall(r"^#define (OCT|META_TILES) (\d+)", text, flags=re.M))
    assert defined == {"OCT": str(OCT)}
    assert re.search(r"tile_meta\((?:[^)]*\n)*[^)]*const int per,", text)


def test_sparse_postings_are_read_by_octs_only_where_their_storage_allows() -> None:
    """The kernel's OCTS build reads a layout's sparse offsets and weights eight at a time: only
    where the data is aligned to eight elements and its storage holds the last group of eight;
    the layout's builders allocate them so."""
    from gpusparse.kernels.tile_candidates import octs_readable
    from gpusparse.layout.tiled import sparse_array

    for n in (0, 1, 5, 10, 12, 16, 17):
        for dtype in (torch.int16, torch.uint8, torch.int32, torch.float32):
            x = sparse_array(n, dtype, torch.device("cpu"))
            assert x.shape == (n,) and x.dtype == dtype and octs_readable(x)
    assert octs_readable(torch.empty(16, dtype=torch.int16))
    assert not octs_readable(torch.empty(12, dtype=torch.int16))  # its last group ends past the storage
    assert not octs_readable(torch.empty(17, dtype=torch.int16)[1:])  # not aligned to eight elements
    assert not octs_readable(torch.empty(32, dtype=torch.int16)[4:12])  # aligned to four only
    assert octs_readable(torch.empty(24, dtype=torch.uint8)[8:17])  # aligned; storage up to 24
    assert octs_readable(torch.empty(16, dtype=torch.uint8)[8:10])  # its group ends at the storage's end
    assert not octs_readable(torch.empty(16, dtype=torch.uint8)[4:10])


def test_check_tensors_refuses_wrong_dtype_device_and_layout() -> None:
    from gpusparse.kernels.cupy_launch import check_tensors, pointer

    dev = torch.device("cpu")
    x = torch.zeros((4, 6), dtype=torch.int64)
    check_tensors({"x": (x, torch.int64), "y": (torch.zeros(3, dtype=torch.int32), torch.int32)}, dev)
    for bad in (x.to(torch.int32), x.t(), x[:, ::2], torch.zeros((4, 6), dtype=torch.int64, device="meta")):
        with pytest.raises(ValueError, match=r"x must be a contiguous torch\.int64 tensor on cpu"):
            check_tensors({"x": (bad, torch.int64)}, dev)
    assert pointer(x) == x.data_ptr() and isinstance(pointer(x), np.uint64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("floor_dtype", [None, torch.float32, torch.float64])
def test_finish_rows_equals_padding_and_the_uncertainty_check(rng, floor_dtype) -> None:
    """finish_rows (one launch) against what it replaces on the tiled engine's device path:
    decode_keys, pad_results and uncertain_rows. Rows with fewer keys than k, empty keys,
    no candidates at all; margins on both sides of each row's k-th score and match floor."""
    from gpusparse.engines.tiled.fixed_point import FixedPoint, uncertain_rows
    from gpusparse.exact import pad_results
    from gpusparse.kernels.finish import finish_rows
    from gpusparse.topk import decode_keys, encode_keys

    require_cuda_kernels()
    b = 41
    for kk, k in ((0, 10), (3, 10), (10, 10), (1000, 1000), (1, 1)):
        scores = torch.from_numpy(np.sort(rng.choice([0.0, 0.25, 1.5, 7.0], (b, kk)), 1)[:, ::-1].astype(np.float32))
        ids = torch.from_numpy(rng.integers(0, 1 << 30, (b, kk)))
        top = torch.where(scores > 0, encode_keys(scores, ids), 0).cuda()
        scale = torch.from_numpy(np.ldexp(1.0, rng.integers(20, 30, b))).cuda()
        # margins around the scaled k-th score, so both outcomes of each test occur
        delta = torch.from_numpy(rng.integers(1, 1 << 31, b)).cuda()
        delta[: b // 2] = torch.from_numpy(rng.integers(1, 1 << 24, b // 2)).cuda()
        lb = torch.from_numpy(rng.choice([0.0, 1e-9, 1e-5, 1.0], b)).cuda()
        floor = None
        if floor_dtype is not None:
            floor = torch.from_numpy(rng.choice([0.0, 0.3, 2.0, 9.0], b)).to(floor_dtype).cuda()
        # row 0 surely certain (its match floor is far above the margin), row 1 surely not (its
        # k-th score is below the margin and its floor 0): both outcomes, whatever the draws
        scale[:2] = torch.tensor([2.0**30, 2.0**20], dtype=torch.float64)
        delta[:2] = torch.tensor([1, 2**31 - 1])
        lb[:2] = torch.tensor([1.0, 0.0], dtype=torch.float64)
        redo0 = torch.from_numpy(rng.random(b) < 0.2).cuda()
        redo = redo0.clone()
        count = torch.from_numpy(rng.integers(0, 40, b).astype(np.int32)).cuda()
        fp = FixedPoint(scale, delta)
        want_s, want_i = pad_results(decode_keys(top) if kk else None, k, b, torch.device("cuda"))
        unsure = uncertain_rows(None, None, fp, want_s, k, lb, floor)
        assert 0 < int(unsure.sum()) < b, "both outcomes of the check are exercised"
        for with_count, packed in ((False, False), (True, False), (True, True)):
            want_flags = redo0 | unsure | ((count > 20) if with_count else False)
            got_s, got_i, flags = finish_rows(
                top if kk else None, k, delta, scale, lb, floor, redo, count=count if with_count else None, width=20,
                packed=packed,
            )  # fmt: skip
            assert torch.equal(got_s, want_s) and torch.equal(got_i, want_i), (kk, k)
            assert torch.equal(flags, want_flags), (kk, k, with_count)
            assert torch.equal(redo, redo0), "redo is read, not written"
            if packed:  # one buffer: ids, scores, flags
                ptr = got_i.untyped_storage().data_ptr()
                assert all(x.untyped_storage().data_ptr() == ptr for x in (got_s, flags))
                assert got_i.untyped_storage().nbytes() == 12 * b * k + b
