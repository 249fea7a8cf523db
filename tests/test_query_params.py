"""The fixed-point parameters computed on the device (kernels/query_params) against the host's
(engines/tiled/fixed_point.fixed_point_host), and searches whose graph flags rows with them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpusparse import Index
from gpusparse.engines.tiled import fixed_point as fpm
from gpusparse.engines.tiled.engine import layout_for_search
from gpusparse.engines.tiled.graphs import query_width
from gpusparse.kernels.query_params import query_params
from gpusparse.kernels.tile_candidates import ACC_TOP
from gpusparse.layout.statistics import max_score, max_scores_host, min_weight
from gpusparse.queries import padded_host, prepare_queries

from .conftest import require_cuda_kernels
from .reference import dense_scores, random_collection, reference_topk

pytestmark = pytest.mark.gpu
TOP_BITS_U32 = int(math.log2(ACC_TOP["u32"]))


def _setup(rng, quantize, acc, prepared=True):
    docs = random_collection(rng, 5000, 300, 30)
    index = Index.build(docs, device="cuda", quantize=quantize)
    queries = random_collection(rng, 40, 300, 12, empty_fraction=0.1)
    if prepared:
        queries = prepare_queries(queries, index.vocab, index.quantization, max_scores_host(index))
    layout = layout_for_search(index, acc=acc)
    terms, weights, lengths = padded_host(queries, query_width)
    return index, layout, terms, weights, lengths


def _device(index, layout, terms, weights, acc, step):
    t, w = torch.from_numpy(terms).cuda(), torch.from_numpy(weights).cuda()
    fp, lb, redo = fpm.fixed_point_device(index, t, w, acc, layout.weight_bits, step)
    out = {"scale": fp.scale, "delta": fp.delta, "lb": lb, "redo": redo}
    if fp.mult is not None:
        out |= {"mult": fp.mult, "shift": fp.shift}
    return {name: x.cpu().numpy() for name, x in out.items()}


def _host_rows(index, layout, terms, weights, lengths, acc):
    """The host's parameters of each row alone, or ``None`` where the host refuses the row."""
    rows = []
    for r in range(terms.shape[0]):
        try:
            rows.append(fpm.fixed_point_host(index, terms[r : r + 1], weights[r : r + 1], lengths[r : r + 1], acc,
                                             layout.weight_bits))  # fmt: skip
        except ValueError:
            rows.append(None)
    return rows


@pytest.mark.parametrize(("quantize", "acc"), [(None, "u32"), (None, "carry"), (8, "u32")])
def test_device_parameters_are_the_hosts(rng, quantize, acc):
    """Every parameter of every row as the host computes it (the bound's and the sum's
    summation order may move ``delta`` by one unit at most; here they are equal on most rows),
    but ``delta`` where the kernel multiplies integers: 0 (fixed_point.exact_margin)."""
    require_cuda_kernels()
    index, layout, terms, weights, lengths = _setup(rng, quantize, acc)
    step = layout.step if layout.quantized and acc == "u32" else None
    dev = _device(index, layout, terms, weights, acc, step)
    host = fpm.fixed_point_host(index, terms, weights, lengths, acc, layout.weight_bits)
    assert not dev["redo"].any()
    assert set(dev) - {"redo"} == set(host)
    for name in ("scale", "lb", "mult", "shift"):
        if name in host:
            np.testing.assert_array_equal(dev[name], host[name], err_msg=name)
    if step is not None:  # the host's own check agrees: integer products, whose margin is 0
        assert fpm.integer_weights_host(layout, weights, host["scale"], acc)
        assert (dev["delta"] == 0).all() and (host["delta"] > 0).all()
    else:
        assert np.abs(dev["delta"] - host["delta"]).max() <= 1
        assert (dev["delta"] == host["delta"]).mean() >= 0.9


def test_rows_the_host_refuses_are_flagged(rng, monkeypatch):
    """With the largest margin lowered so that some rows exceed it, the device flags exactly the
    rows the host refuses, and leaves the others' parameters as the host's. The limit sits in a gap
    of at least 3 between the rows' margins: the device's may differ from the host's by one."""
    require_cuda_kernels()
    index, layout, terms, weights, lengths = _setup(rng, None, "u32")
    host_all = fpm.fixed_point_host(index, terms, weights, lengths, "u32", layout.weight_bits)
    deltas = np.unique(host_all["delta"])
    gaps = [i for i in range(len(deltas) - 1) if deltas[i + 1] - deltas[i] >= 3]
    assert gaps, "margins with a gap to put the limit in"
    limit = int(deltas[gaps[len(gaps) // 2]]) + 1
    monkeypatch.setattr(fpm, "FIXED_MAX_DELTA", limit)
    refused = np.array([row is None for row in _host_rows(index, layout, terms, weights, lengths, "u32")])
    assert refused.any() and not refused.all()
    dev = _device(index, layout, terms, weights, "u32", None)
    np.testing.assert_array_equal(dev["redo"], refused)
    np.testing.assert_array_equal(dev["scale"][~refused], host_all["scale"][~refused])


def test_rows_with_weights_that_are_not_integers_are_flagged(rng):
    """On the 8-bit layout with integer products, queries that were not quantized (weights not
    integers at their scale) are flagged, row by row as the host's check says over the terms that
    have postings; a row whose only such weights are on terms without postings is not."""
    require_cuda_kernels()
    index, layout, terms, weights, lengths = _setup(rng, 8, "u32", prepared=False)
    ms = max_scores_host(index)
    # a row on a term no document has: its weight is never multiplied
    extra = np.full((1, terms.shape[1]), -1, dtype=terms.dtype)
    extra_w = np.zeros((1, terms.shape[1]), dtype=np.float32)
    extra[0, 0], extra_w[0, 0] = len(ms), 0.3  # the vocabulary's last slot past the lists: no postings
    ms_dev = torch.cat([index.max_scores, torch.zeros(1, device=index.max_scores.device)])
    t = np.concatenate([terms, extra])
    w = np.concatenate([weights, extra_w])
    p = query_params(
        torch.from_numpy(t).cuda(), torch.from_numpy(w).cuda(), ms_dev, top_bits=TOP_BITS_U32, min_w=min_weight(index),
        max_w=max_score(index), weight_bits=layout.weight_bits, step=layout.step, max_delta=fpm.FIXED_MAX_DELTA,
    )  # fmt: skip
    redo = p["redo"].cpu().numpy()
    host = fpm.fixed_point_host(index, terms, weights, lengths, "u32", layout.weight_bits)
    integral = [fpm.integer_weights_host(layout, weights[r : r + 1], host["scale"][r : r + 1], "u32")
                for r in range(len(terms))]  # fmt: skip
    np.testing.assert_array_equal(redo[:-1], ~np.array(integral))
    assert redo[:-1].any() and not redo[-1]


def test_a_graphed_search_with_flagged_rows_is_exact(rng, monkeypatch):
    """Rows the graph's parameters flag are searched the general way: the graph ran and flagged
    rows, and every row of the small batch equals the float64 reference."""
    require_cuda_kernels()
    from gpusparse.engines.tiled.engine import graphed_batch_search

    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda")
    queries = random_collection(rng, 6, 300, 10)
    # every row refused in the graph: a row's margin is at least one unit with float32 weights
    # (40 left some draws with no row refused, and the test then failed its own premise)
    monkeypatch.setattr(fpm, "FIXED_MAX_DELTA", 0)
    idx = index.resident_on(index.device)
    ready = prepare_queries(queries, idx.vocab, idx.quantization, max_scores_host(idx))
    direct = graphed_batch_search(idx, ready, 20)
    assert direct is not None and bool(direct.redo.any())
    res = index.search(queries, 20)
    ref_s, ref_i = reference_topk(dense_scores(docs, queries), 20)
    np.testing.assert_array_equal(res.ids.numpy(), ref_i)
    np.testing.assert_array_equal(res.scores.numpy(), ref_s)
    s, i = direct.resolved()
    np.testing.assert_array_equal(i.cpu().numpy(), ref_i)
    np.testing.assert_array_equal(s.cpu().numpy(), ref_s)


def test_prepared_queries_take_integer_products_on_the_8_bit_layout_unflagged(rng):
    """The graph assumes integer products on the 8-bit layout (prepared weights are levels times
    a power of two, and so are the documents'): for prepared queries of few to many terms no row
    is flagged, and the results are exact."""
    require_cuda_kernels()
    from gpusparse.engines.tiled.engine import graphed_batch_search

    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda", quantize=8)
    idx = index.resident_on(index.device)
    for mean_terms in (2, 12, 60, 250):
        queries = random_collection(rng, 5, 300, mean_terms)
        ready = prepare_queries(queries, idx.vocab, idx.quantization, max_scores_host(idx))
        res = graphed_batch_search(idx, ready, 10)
        assert res is not None and not bool(res.redo.any())
        scores = dense_scores(_levels_times_steps(index, docs), ready)
        ref_s, ref_i = reference_topk(scores, 10)
        np.testing.assert_array_equal(res.ids.cpu().numpy(), ref_i)
        np.testing.assert_array_equal(res.scores.cpu().numpy(), ref_s)


def _levels_times_steps(index, docs):
    from gpusparse.quantize import quantize_collection

    return quantize_collection(docs, index.quantization.bits, index.quantization.step)[0]
