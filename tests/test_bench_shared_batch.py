"""bench/shared_batch_ops.py and bench/shared_batch.cu (issue 23, fifth session): one block per document
chunk for the whole batch gives every (query, document) its exact integer score Σ q_level · d_level,
and at a threshold exactly the documents scoring at least it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import Index, SparseCollection, Vocabulary
from gpusparse.synthetic import generate

from .conftest import require_cuda_kernels
from .reference import dense_scores

ops = pytest.importorskip("shared_batch_ops")  # bench/ is on pytest's pythonpath


def _random_levels(rng: np.random.Generator, n: int, v: int, mean: float, empty: float = 0.0):
    """CSR document levels (int64 1..255), terms ascending and unique in a row, some rows empty."""
    indptr, terms, lev = [0], [], []
    for _ in range(n):
        k = 0 if rng.random() < empty else int(min(v, rng.poisson(mean)))
        t = np.sort(rng.choice(v, size=k, replace=False, p=_skewed(v)))
        terms.append(t)
        lev.append(rng.integers(1, 256, size=k))
        indptr.append(indptr[-1] + k)
    return (
        torch.tensor(indptr, dtype=torch.int64),
        torch.from_numpy(np.concatenate(terms).astype(np.int32)),
        torch.from_numpy(np.concatenate(lev).astype(np.int64)),
    )


def _skewed(v: int) -> np.ndarray:
    p = 1.0 / np.arange(1, v + 1)
    return p / p.sum()


def _random_queries(rng: np.random.Generator, b: int, v: int, mean: float, shared_term: int | None = None):
    """Query levels as CSR numpy arrays; ``shared_term`` is in every query (m = b)."""
    indptr, terms, lev = [0], [], []
    for _ in range(b):
        t = set(rng.choice(v, size=max(1, rng.poisson(mean)), replace=False, p=_skewed(v)).tolist())
        if shared_term is not None:
            t.add(shared_term)
        t = np.array(sorted(t), dtype=np.int64)
        terms.append(t)
        lev.append(rng.integers(1, 256, size=len(t)))
        indptr.append(indptr[-1] + len(t))
    return np.array(indptr, dtype=np.int64), np.concatenate(terms), np.concatenate(lev).astype(np.int64)


def _brute_force(d_csr, q_csr, v: int, n: int) -> np.ndarray:
    """float64 dense brute force (tests/reference.py) of the levels as weights: exact integers."""
    di, dt, dl = (x.numpy() for x in d_csr)
    qi, qt, ql = q_csr
    docs = SparseCollection.from_scipy(sp.csr_matrix((dl.astype(np.float32), dt, di), shape=(n, v)))
    queries = SparseCollection.from_scipy(sp.csr_matrix((ql.astype(np.float32), qt, qi), shape=(len(qi) - 1, v)))
    return dense_scores(docs, queries)


@pytest.mark.parametrize(("n", "b", "chunk", "window"), [(700, 33, 100, 64), (513, 7, 256, 4096), (300, 64, 1, 16)])
def test_emulation_is_exact(rng, n, b, chunk, window):
    v = 300
    d_csr = _random_levels(rng, n, v, 25, empty=0.05)
    q_csr = _random_queries(rng, b, v, 12, shared_term=int(rng.integers(v)))
    layout = ops.chunk_layout(*d_csr, v, chunk)
    bt = ops.batch_terms(*q_csr, v, "cpu")
    expected = _brute_force(d_csr, q_csr, v, n)
    ref = ops.reference_scores(*d_csr, bt, v)
    assert np.array_equal(ref.numpy().astype(np.float64), expected)
    theta = ops.oracle_theta(ref, 5)
    stats = ops.chunk_statistics(layout, bt, window)
    for variant in ("flat", "warp"):
        em = ops.emulate(layout, bt, theta, variant=variant, window=window)
        bad = np.argwhere(em.acc.numpy() != ref.numpy())
        assert bad.size == 0, f"{variant}: (query, doc) sums differ at {bad[:5].tolist()}"
        assert torch.equal(em.qmax, ref.max(1).values)
        assert em.pairs == stats["pairs_total"]
        for q in range(b):
            want = np.flatnonzero(expected[q] >= float(theta[q]))
            assert np.array_equal(em.candidates[q].numpy(), want), f"{variant}: query {q}'s candidates"


def test_layout_packs_every_posting_sorted(rng):
    v, n, chunk = 1000, 333, 50
    d_csr = _random_levels(rng, n, v, 30, empty=0.1)
    layout = ops.chunk_layout(*d_csr, v, chunk, group_postings=500)  # several build groups
    assert layout.n_chunks == -(-n // chunk) and int(layout.chunk_start[-1]) == d_csr[1].numel()
    term, off, lev = layout.unpack()
    for c in range(layout.n_chunks):
        lo, hi = int(layout.chunk_start[c]), int(layout.chunk_start[c + 1])
        key = term[lo:hi] * 256 + off[lo:hi]
        assert bool((key[1:] > key[:-1]).all()), f"chunk {c} not sorted by (term, doc)"
        docs = c * chunk + off[lo:hi]
        got = sorted(zip(docs.tolist(), term[lo:hi].tolist(), lev[lo:hi].tolist(), strict=True))
        di, dt, dl = d_csr
        want = sorted(
            (d, int(dt[p]), int(dl[p]))
            for d in range(c * chunk, min(n, (c + 1) * chunk))
            for p in range(int(di[d]), int(di[d + 1]))
        )
        assert got == want


@pytest.mark.parametrize(("n", "tile_bits", "dense_min"), [(333, 4, 0.25), (100, 3, 0.0), (64, 6, 0.5)])
def test_sparse_only_drops_exactly_the_dense_rows_postings(rng, n, tile_bits, dense_min):
    """bench/shared_batch.py --sparse-only: a posting goes iff its (tile, term) holds at least
    max(1, int(dense_min * 2**tile_bits)) postings (build_tiled's dense rule); the rest keep
    their documents, order and levels."""
    v = 40
    d_csr = _random_levels(rng, n, v, 9, empty=0.1)
    (oi, ot, ol), info = ops.sparse_only(*d_csr, v, tile_bits=tile_bits, dense_min=dense_min)
    di, dt, dl = (x.numpy() for x in d_csr)
    tile, need = 1 << tile_bits, max(1, int(dense_min * (1 << tile_bits)))
    want_ptr, want_t, want_l, rows = [0], [], [], 0
    for t0 in range(0, n, tile):
        lo, hi = di[t0], di[min(n, t0 + tile)]
        counts = np.bincount(dt[lo:hi], minlength=v)
        rows += int((counts >= need).sum())
        for d in range(t0, min(n, t0 + tile)):
            keep = [p for p in range(di[d], di[d + 1]) if counts[dt[p]] < need]
            want_t += [dt[p] for p in keep]
            want_l += [dl[p] for p in keep]
            want_ptr.append(want_ptr[-1] + len(keep))
    assert oi.tolist() == want_ptr and ot.tolist() == want_t and ol.tolist() == want_l
    assert ot.dtype == d_csr[1].dtype and ol.dtype == d_csr[2].dtype
    assert info["dense_rows"] == rows and info["sparse_postings"] == len(want_t) and info["postings"] == len(dt)
    if dense_min == 0.0:  # every present (tile, term) is a row: nothing stays
        assert len(want_t) == 0


def test_levels_rank_as_the_8bit_index():
    """The prototype's integers are the 8-bit index's float32 scores over the two steps: the same
    ranking (scores equal to their product with the steps, bit for bit)."""
    (di, dt, dw), (qi, qt, qw) = generate(3000, 8, seed=3)
    vocab = Vocabulary.bert()
    (li, lt, ll), step = ops.doc_levels(di, dt, dw)
    queries = SparseCollection(qi.numpy(), qt.numpy(), qw.numpy(), vocab=vocab)
    q_csr = ops.query_levels(queries)
    bt = ops.batch_terms(*q_csr, len(vocab), "cpu")
    ints = ops.reference_scores(li, lt, ll, bt, len(vocab))
    index = Index.from_csr(di, dt, dw, vocab, quantize=8)
    assert index.quantization.step == step
    res = index.search(queries, 10)
    raw = queries.values.astype(np.float64)
    row_max = np.array([raw[a:b].max() for a, b in zip(queries.indptr[:-1], queries.indptr[1:], strict=True)])
    steps = ops.power_of_two_steps(row_max, 8)
    for q in range(len(queries)):
        top = torch.topk(ints[q], 10).values.to(torch.float64) * steps[q] * step
        assert torch.equal(res.scores[q].to(torch.float64), top), f"query {q}"
        assert torch.equal(ints[q][res.ids[q]].to(torch.float64) * steps[q] * step, top)


def test_batch_terms_refuses_big_batches():
    qi = np.arange(258, dtype=np.int64)
    with pytest.raises(ValueError, match=r"1\.\.256"):
        ops.batch_terms(qi, np.zeros(257, dtype=np.int64), np.ones(257, dtype=np.int64), 10, "cpu")
    with pytest.raises(ValueError, match="chunk"):
        ops.chunk_layout(torch.zeros(1, dtype=torch.int64), torch.zeros(0), torch.zeros(0), 10, chunk=300)


def _host_kernel(tmp: Path, variant: str, layout, bt, theta: np.ndarray, *, emit: bool, cap: int, threads: int,
                 items: int, grid: int, exe_dir: Path | None = None):  # fmt: skip
    """bench/shared_batch.cu's kernel ``variant`` compiled for the CPU (tests/shared_batch_host.cpp, into
    ``exe_dir``, default ``tmp``) and run in ``tmp``: qmax, count, cand_doc, cand_val as numpy arrays."""
    root = Path(__file__).resolve().parents[1]
    b = bt.n_queries
    exe = (exe_dir or tmp) / f"host_{threads}_{items}_{layout.chunk}_{b}"
    if not exe.exists():
        subprocess.run(
            ["g++", "-std=c++20", "-O1", f"-DTHREADS={threads}", f"-DITEMS={items}",
             f"-DCHUNK={layout.chunk}", f"-DNQ={b}", f"-DSTRIDE={ops.row_stride(b)}",
             f'-DKERNEL_SOURCE="{root / "bench" / "shared_batch.cu"}"', str(root / "tests" / "shared_batch_host.cpp"),
             "-o", str(exe)],
            check=True, capture_output=True,
        )  # fmt: skip
    layout.post.numpy().tofile(tmp / "post.bin")
    layout.chunk_start.numpy().tofile(tmp / "chunk_start.bin")
    bt.tinfo.numpy().tofile(tmp / "tinfo.bin")
    bt.qlist.numpy().tofile(tmp / "qlist.bin")
    theta.astype(np.int32).tofile(tmp / "theta.bin")
    args = [layout.n_chunks, layout.n_docs, bt.n_pairs, int(emit), cap, grid]
    subprocess.run([str(exe), str(tmp), variant, *map(str, args)], check=True, timeout=120)
    qmax, count = (np.fromfile(tmp / f"{n}.bin", dtype=np.int32) for n in ("qmax", "count"))
    doc, val = (np.fromfile(tmp / f"{n}.bin", dtype=np.int32).reshape(b, cap) for n in ("cand_doc", "cand_val"))
    return qmax, count, doc, val


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20) to run the CUDA source on the CPU")
@pytest.mark.parametrize(
    ("n", "b", "chunk", "threads", "items", "grid"),
    [
        (400, 33, 100, 64, 2, 3),
        (300, 7, 256, 96, 1, 1),
        (150, 40, 1, 32, 4, 7),
        (90, 64, 16, 64, 4, 2),
        (300, 256, 128, 1024, 4, 2),
    ],  # the benchmark's shape: 1024 threads, 4 postings each, 256 queries
)
def test_cuda_source_on_cpu_threads_is_exact(rng, tmp_path, n, b, chunk, threads, items, grid):
    """The .cu file itself (not an emulation of it), its threads as CPU threads: every non-zero sum
    at theta 1, the maxima, and the candidates at an oracle theta with a small capacity (overflow)."""
    v = 500
    d_csr = _random_levels(rng, n, v, 40, empty=0.05)
    q_csr = _random_queries(rng, b, v, 20, shared_term=int(rng.integers(20)))
    layout = ops.chunk_layout(*d_csr, v, chunk)
    bt = ops.batch_terms(*q_csr, v, "cpu")
    ref = ops.reference_scores(*d_csr, bt, v).numpy()
    for variant in ("flat", "warp"):
        run = dict(threads=threads, items=items, grid=grid)
        qmax, count, doc, val = _host_kernel(tmp_path, variant, layout, bt, np.ones(b), emit=True, cap=n, **run)
        assert np.array_equal(qmax, ref.max(1)), variant
        for q in range(b):
            want = np.flatnonzero(ref[q] > 0)
            order = np.argsort(doc[q, : count[q]])
            assert count[q] == len(want), f"{variant}: query {q}'s count"
            assert np.array_equal(doc[q, : count[q]][order], want), f"{variant}: query {q}'s documents"
            assert np.array_equal(val[q, : count[q]][order], ref[q][want]), f"{variant}: query {q}'s sums"
        theta = ops.oracle_theta(torch.from_numpy(ref), 4).numpy()
        theta[0] = 0
        qmax, count, doc, val = _host_kernel(tmp_path, variant, layout, bt, theta, emit=True, cap=5, **run)
        assert np.array_equal(qmax, ref.max(1)) and count[0] == 0
        for q in range(1, b):
            want = np.flatnonzero(ref[q] >= theta[q])
            got = doc[q, : min(5, count[q])]
            assert count[q] == len(want) and len(got) == min(5, len(want)), f"{variant}: query {q}"
            assert set(got.tolist()) <= set(want.tolist())
            assert np.array_equal(val[q, : len(got)], ref[q][got])


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "b", "chunk", "threads"), [(5000, 33, 100, 64), (3000, 256, 128, 1024), (800, 5, 1, 256)]
)
def test_cuda_kernels_match_the_emulation(rng, n, b, chunk, threads):
    require_cuda_kernels()
    cuda = pytest.importorskip("shared_batch_cuda")
    v = 2000
    d_csr = _random_levels(rng, n, v, 60, empty=0.05)
    q_csr = _random_queries(rng, b, v, 30, shared_term=int(rng.integers(50)))
    bt_cpu = ops.batch_terms(*q_csr, v, "cpu")
    ref = ops.reference_scores(*d_csr, bt_cpu, v)
    layout = ops.chunk_layout(*(x.cuda() for x in d_csr), v, chunk)
    bt = ops.batch_terms(*q_csr, v, "cuda")
    em = ops.emulate(ops.chunk_layout(*d_csr, v, chunk), bt_cpu, None, variant="flat", window=threads * 4)
    assert torch.equal(em.acc, ref)
    for variant in ("flat", "warp"):
        # theta 1 and room for every document: the candidates are every non-zero sum
        out = cuda.Outputs.allocate(b, n, torch.device("cuda"))
        ones = torch.ones(b, dtype=torch.int32, device="cuda")
        cuda.run(variant, layout, bt, ones, out, threads=threads, blocks=7)  # blocks loop over chunks
        torch.cuda.synchronize()
        assert torch.equal(out.qmax.cpu().to(torch.int64), ref.max(1).values), variant
        assert int(out.overflow().sum()) == 0
        for q in range(b):
            doc, val = out.candidates(q)
            want = np.flatnonzero(ref[q].numpy() > 0)
            assert np.array_equal(doc, want), f"{variant}: query {q}'s documents"
            assert np.array_equal(val, ref[q].numpy()[want]), f"{variant}: query {q}'s sums"
        # the oracle threshold at k = 3, and a capacity that overflows for some query
        theta = ops.oracle_theta(ref, 3).to(torch.int32).cuda()
        theta[0] = 0  # no candidates for query 0
        out = cuda.Outputs.allocate(b, 4, torch.device("cuda"))
        cuda.run(variant, layout, bt, theta, out, threads=threads)
        cuda.run(variant, layout, bt, theta, out, threads=threads, emit=False, reset=False)  # no emission
        counts = out.count.cpu().numpy()
        assert counts[0] == 0
        for q in range(1, b):
            want = np.flatnonzero(ref[q].numpy() >= int(theta[q]))
            assert counts[q] == len(want), f"{variant}: query {q}'s count"
            doc, val = out.candidates(q)
            assert set(doc.tolist()) <= set(want.tolist()) and len(doc) == min(4, len(want))
            assert np.array_equal(val, ref[q].numpy()[doc])


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20) to run the CUDA source on the CPU")
def test_benchmark_checks_on_cpu(tmp_path, monkeypatch):
    """bench/shared_batch.py's oracle (the engine's exact 8-bit results as integers) and its exactness
    checks, with the kernels run on CPU threads in place of the GPU: every check passes on a correct
    kernel and fails on a wrong one."""
    bench = pytest.importorskip("shared_batch")
    cuda = pytest.importorskip("shared_batch_cuda")
    (di, dt, dw), (qi, qt, qw) = generate(800, 24, seed=5)
    vocab = Vocabulary.bert()
    v = len(vocab)
    (li, lt, ll), step = ops.doc_levels(di, dt, dw)
    layout = ops.chunk_layout(li, lt, ll, v, 128)
    queries = SparseCollection(qi.numpy(), qt.numpy(), qw.numpy(), vocab=vocab)
    bt = ops.batch_terms(*ops.query_levels(queries), v, "cpu")
    index = Index.from_csr(li, lt, ll.to(torch.float32) * step, vocab, quantize=8)
    steps = ops.power_of_two_steps(bench._row_max(queries), 8)
    thetas = {k: bench.oracle_thetas(index.search(queries, k), steps, step, k) for k in (3, 30)}
    qmax = bench.oracle_thetas(index.search(queries, 1), steps, step, 1)
    ref = ops.reference_scores(li, lt, ll, bt, v)
    assert np.array_equal(qmax, ref.max(1).values.numpy())
    for k, theta in thetas.items():
        assert np.array_equal(theta, torch.topk(ref, k).values[:, -1].numpy())
    dirs = iter(range(10**6))

    def host_run(variant, layout, bt, theta, out, *, emit=True, threads=64, reset=True, wrong=False):
        work = tmp_path / f"run{next(dirs)}"
        work.mkdir()
        got = _host_kernel(work, variant, layout, bt, theta.cpu().numpy(), emit=emit, cap=out.cap, threads=threads,
                           items=4, grid=3, exe_dir=tmp_path)  # fmt: skip
        for tensor, value in zip((out.qmax, out.count, out.cand_doc, out.cand_val), got, strict=True):
            tensor.copy_(torch.from_numpy(value).view_as(tensor))
        if wrong:
            out.cand_val[out.cand_val > 0] += 1

    monkeypatch.setattr(cuda, "run", host_run)
    report = bench.check_exact(layout, bt, (li, lt, ll), v, thetas, qmax, [1, 5, 6], torch.device("cpu"))
    for variant in ("flat", "warp"):
        assert report[variant] and all(report[variant].values()), report
    monkeypatch.setattr(cuda, "run", lambda *a, **kw: host_run(*a, **kw, wrong=True))
    report = bench.check_exact(layout, bt, (li, lt, ll), v, thetas, qmax, [1, 5, 6], torch.device("cpu"))
    assert not any(report["flat"][name] for name in report["flat"] if name.startswith(("candidates", "all_sums")))


@pytest.mark.gpu
def test_benchmark_runs_small_on_gpu(tmp_path, monkeypatch):
    """bench/shared_batch.py end to end at a small size: every exactness check passes, every row timed."""
    require_cuda_kernels()
    bench = pytest.importorskip("shared_batch")
    argv = ["shared_batch.py", "--n", "30000", "--batch", "100", "--ks", "10", "100", "--reps", "2"]
    argv += ["--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    bench.main()
    (path,) = tmp_path.glob("*-shared-batch.json")
    res = json.loads(path.read_text())
    assert res["layouts"]
    for layout in res["layouts"]:
        for variant in ("flat", "warp"):
            checks = layout["exact"][variant]
            assert checks and all(checks.values()), layout["exact"]
    assert {r["what"] for r in res["rows"]} == {"engine 8-bit", "kernel flat", "kernel warp"}
    assert all(r.get("overflow", 0) == 0 for r in res["rows"])
