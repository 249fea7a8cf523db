"""A batch's rows padded and quantized on the device (the tiled engine's CUDA graph's first kernel):
bit for bit the host's quantization and padding."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gpusparse import SparseCollection
from gpusparse.engines.tiled.graphs import _numpy_view, csr_batch
from gpusparse.kernels.cupy_launch import mapped_pointer
from gpusparse.kernels.query_rows import csr_fields, query_rows
from gpusparse.quantize import quantize_queries
from gpusparse.queries import padded_host

from .conftest import require_cuda_kernels


def _batch(rng, lengths: list[int], n_terms: int = 5000) -> SparseCollection:
    """Rows of the given lengths, weights spread over twelve decades (so that many round to
    level 0 and are dropped), a few ties to half a level and rows whose largest weight sits on
    a step's boundary."""
    cols = np.concatenate([np.sort(rng.choice(n_terms, size=m, replace=False)) for m in lengths]).astype(np.int64)
    vals = (10.0 ** rng.uniform(-8, 4, size=cols.size)).astype(np.float32)
    at = 0
    for m in lengths:
        if m >= 3 and rng.random() < 0.5:
            vals[at] = np.float32(255 * 2.0**-3)  # 8 bits: exactly the top level of step 2**-3
            vals[at + 1] = np.float32(5 * 2.0**-3 + 2.0**-4)  # half a level: to even (5)
            vals[at + 2] = np.float32(6 * 2.0**-3 + 2.0**-4)  # to even (6)
        at += m
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    return SparseCollection.from_scipy(sp.csr_matrix((vals, cols, indptr), shape=(len(lengths), n_terms)))


def _poison(dev: torch.device) -> None:
    """Leave the caching allocator's free blocks full of garbage (the outputs come from them)."""
    junk = torch.full((1 << 22,), 0x7F, dtype=torch.uint8, device=dev)
    del junk


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [0, 1, 4, 8])
def test_rows_padded_and_quantized_as_the_host_does(rng, bits):
    require_cuda_kernels()
    dev = torch.device("cuda")
    for lengths in ([3, 0, 45, 129, 1], [300, 256, 128, 127], [0], [7] * 40):
        q = _batch(rng, lengths)
        want = quantize_queries(q, bits) if bits else q
        batch = csr_batch(q.indptr, q.indices, q.values, bits)
        width = max(8, batch.longest + int(rng.integers(0, 9)))
        fields, size = csr_fields(batch.rows, batch.rows * width)
        buf = np.full(size, 0xCD, dtype=np.uint8)  # poisoned past the rows
        views = {n: _numpy_view(buf, spec) for n, spec in fields.items()}
        batch.fill(views["indptr"], views["indices"], views["values"])
        staged = torch.from_numpy(buf).to(dev)
        _poison(dev)
        terms, weights, terms32 = query_rows(staged, batch.rows, batch.rows * width, width, bits, device=dev)
        want_t, want_w, _ = padded_host(want, lambda _, w=width: w)
        np.testing.assert_array_equal(terms.cpu().numpy(), want_t)
        np.testing.assert_array_equal(terms32.cpu().numpy(), want_t)
        np.testing.assert_array_equal(weights.cpu().numpy().view(np.int32), want_w.view(np.int32))
        if bits:
            assert (want.nnz < q.nnz) or lengths == [0]  # some terms were dropped: the compaction ran
        # the same from page-locked host memory read in place (the graph's way)
        pinned = torch.from_numpy(buf).pin_memory()
        address = mapped_pointer(pinned)
        assert address is not None
        _poison(dev)
        t2, w2, t32 = query_rows(address, batch.rows, batch.rows * width, width, bits, device=dev)
        assert torch.equal(t2, terms) and torch.equal(w2.view(torch.int32), weights.view(torch.int32))
        assert torch.equal(t32, terms32)


def test_bits_outside_the_range_are_refused():
    with pytest.raises(ValueError, match="bits"):
        query_rows(0, 1, 8, 8, 17, device=torch.device("cpu"))
