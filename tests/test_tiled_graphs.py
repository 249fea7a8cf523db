"""Batches on a GPU by the CUDA graph of their shape, fed through one staging copy."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from gpusparse import Index
from gpusparse.config import override_config
from gpusparse.engines.tiled import engine as engine_mod
from gpusparse.engines.tiled.graphs import _numpy_view, _packed, _view_at, csr_batch, padded_batch, query_width
from gpusparse.kernels.query_rows import csr_fields
from gpusparse.quantize import quantize_queries
from gpusparse.queries import padded_host

from .conftest import require_cuda_kernels
from .reference import dense_scores, random_collection, reference_topk


def test_query_width_is_a_power_of_two_of_at_least_8():
    assert [query_width(t) for t in (0, 1, 8, 9, 16, 17, 100)] == [8, 8, 8, 16, 16, 32, 128]


def test_staged_rows_are_aligned_and_hold_the_batch_rebased(rng):
    """Every field of the staging layout starts 8-byte aligned; a batch whose row pointers do not
    start at 0 is written over a poisoned buffer with its
    pointers from 0 and its terms and weights as they are; a batch padded on the host comes back
    to the same rows."""
    b, width = 3, 8
    fields, size = csr_fields(b, b * width)
    assert all(start % 8 == 0 for start, *_ in fields.values())
    assert size >= sum(nbytes for _, nbytes, _, _ in fields.values())
    assert [fields[n][3] for n in ("indptr", "indices", "values")] == [(b + 1,), (b * width,), (b * width,)]
    part = random_collection(rng, 3, 50, 6)
    shifted = part.indptr + 11  # the rows' pointers as a view into a larger collection has them
    for batch in (csr_batch(shifted, part.indices, part.values, 8), padded_batch(*padded_host(part))):
        buf = np.full(size, 0xAB, dtype=np.uint8)
        views = {n: _numpy_view(buf, spec) for n, spec in fields.items()}
        batch.fill(views["indptr"], views["indices"], views["values"])
        nnz = int(part.indptr[-1] - part.indptr[0])
        assert (batch.rows, batch.nnz, batch.longest) == (3, nnz, int(np.diff(part.indptr).max()))
        np.testing.assert_array_equal(views["indptr"], part.indptr)
        np.testing.assert_array_equal(views["indices"][:nnz], part.indices)
        np.testing.assert_array_equal(views["values"][:nnz], part.values)
        assert (views["values"][nnz:].view(np.uint8) == 0xAB).all()  # nothing past the rows written
    assert csr_batch(part.indptr, part.indices, part.values, 8).bits == 8
    assert padded_batch(*padded_host(part)).bits == 0


@contextlib.contextmanager
def graph_outcomes():
    """For each batch the tiled engine searches: whether it ran by a CUDA graph (True) or
    the general way (False), in order."""
    outcomes: list[bool] = []
    real = engine_mod.graphed_batch_search

    def counted(*a, **kw):
        out = real(*a, **kw)
        outcomes.append(out is not None)
        return out

    engine_mod.graphed_batch_search = counted
    try:
        yield outcomes
    finally:
        engine_mod.graphed_batch_search = real


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [None, 8])
def test_small_batches_through_the_graph_are_exact_pipelined_and_repeated(rng, quantize):
    """Batches of a few queries take the small-batch path (counted), pipelined two at a time
    by Index.search over the graphs' two slots, fresh queries of the same shapes each round:
    every row equals the float64 reference and the general path's results."""
    require_cuda_kernels()
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda", quantize=quantize)
    with graph_outcomes() as calls:
        for _ in range(3):
            queries = random_collection(rng, 9, 300, 10)
            if quantize:
                scores = dense_scores(docs_q(index, docs), quantize_queries(queries, quantize))
            else:
                scores = dense_scores(docs, queries)
            for k in (10, 100):
                res = index.search(queries, k, batch_size=2)  # five batches, the last of one query
                ref_s, ref_i = reference_topk(scores, k)
                np.testing.assert_array_equal(res.ids.numpy(), ref_i)
                np.testing.assert_array_equal(res.scores.numpy(), ref_s)
                n = len(calls)
                with override_config(graph_max_batch=0):  # the general path (not counted)
                    general = index.search(queries, k, batch_size=2)
                del calls[n:]
                assert torch.equal(general.ids, res.ids) and torch.equal(general.scores, res.scores)
    assert calls and all(calls)  # every small batch ran the graph, none fell back
    entries = [e for e in index.derived.graphs.values() if e]
    # the rows went in as they are: quantized in the graph, read from mapped host memory
    assert entries and all(e.bits == (quantize or 0) and e.dev_in is None for e in entries)


@pytest.mark.gpu
def test_unmapped_staging_is_copied_to_the_device_first(rng, monkeypatch):
    """Where the staging buffer has no device address, the graph copies it over before its
    first kernel: the same exact results."""
    require_cuda_kernels()
    from gpusparse.engines.tiled import graphs

    monkeypatch.setattr(graphs, "mapped_pointer", lambda host: None)
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda", quantize=8)
    queries = random_collection(rng, 6, 300, 10)
    scores = dense_scores(docs_q(index, docs), quantize_queries(queries, 8))
    with graph_outcomes() as calls:
        res = index.search(queries, 30, batch_size=2)
    assert calls == [True, True, True]
    entries = [e for e in index.derived.graphs.values() if e]
    assert entries and all(e.dev_in is not None and e.bits == 8 for e in entries)
    ref_s, ref_i = reference_topk(scores, 30)
    np.testing.assert_array_equal(res.ids.numpy(), ref_i)
    np.testing.assert_array_equal(res.scores.numpy(), ref_s)


@pytest.mark.gpu
def test_graphs_launch_through_the_runtime_or_by_replay_alike(rng, monkeypatch):
    """A slot launches its graph by PyTorch's executable graph and the runtime's cudaGraphLaunch
    where both exist (torch and CuPy here: they do), else by CUDAGraph.replay (forced): every
    launch counted, each way exact against the float64 reference."""
    require_cuda_kernels()
    import cupy

    assert hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec") and hasattr(cupy.cuda.runtime, "graphLaunch")
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda", quantize=8)
    replays = []
    real_replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or real_replay(self))
    slots: list = []
    for forced in (False, True):
        queries = random_collection(rng, 6, 300, 10)
        if forced:  # the slots captured so far, and those this round's new shapes capture
            for slot in slots:
                monkeypatch.setattr(slot.launch, "_exec", 0)
            monkeypatch.setattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec", None)
        with graph_outcomes() as calls:
            res = index.search(queries, 30, batch_size=2)
            if not forced:
                slots += [s for e in index.derived.graphs.values() if e for s in e.slots]
                assert slots and all(s.launch._exec for s in slots)
        assert calls and all(calls)
        ref_s, ref_i = reference_topk(dense_scores(docs_q(index, docs), quantize_queries(queries, 8)), 30)
        np.testing.assert_array_equal(res.ids.numpy(), ref_i)
        np.testing.assert_array_equal(res.scores.numpy(), ref_s)
        assert (len(replays) > 0) == forced  # the first round's graphs all went through the runtime
        replays.clear()


def docs_q(index: Index, docs):
    """The documents as the quantized index stores them (level times step)."""
    from gpusparse.quantize import quantize_collection

    return quantize_collection(docs, index.quantization.bits, index.quantization.step)[0]


@pytest.mark.gpu
def test_larger_batches_replay_a_graph_from_their_second_batch_on(rng):
    """A batch above graph_max_batch is searched the general way the first time its shape
    comes, by a captured graph from the second time on (graph_repeat_batch); a graph larger
    than graph_cache_bytes is never captured. Every row exact either way."""
    require_cuda_kernels()
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda")
    queries = _queries_of_width(rng, 12, m=10)  # one shape: random lengths could give batches two widths
    scores = dense_scores(docs, queries)
    ref_s, ref_i = reference_topk(scores, 50)
    with graph_outcomes() as outcomes:
        with override_config(graph_max_batch=2, graph_repeat_batch=16):
            res = index.search(queries, 50, batch_size=4)  # three batches of one shape
            assert outcomes == [False, True, True], (outcomes, list(index.derived.graph_shapes))
            np.testing.assert_array_equal(res.ids.numpy(), ref_i)
            np.testing.assert_array_equal(res.scores.numpy(), ref_s)
        outcomes.clear()
        index.derived.graphs.clear()
        with override_config(graph_max_batch=2, graph_repeat_batch=16, graph_cache_bytes=1 << 10):
            res = index.search(queries, 50, batch_size=4)
            assert outcomes == [False, False, False] and not any(index.derived.graphs.values())
            np.testing.assert_array_equal(res.ids.numpy(), ref_i)
            np.testing.assert_array_equal(res.scores.numpy(), ref_s)


def _queries_of_width(rng, n: int, m: int = 4, n_terms: int = 300):
    """``n`` queries of exactly ``m`` distinct terms each (one graph shape for any ``n``)."""
    import scipy.sparse as sp

    from gpusparse import SparseCollection

    cols = np.concatenate([rng.choice(n_terms, size=m, replace=False) for _ in range(n)])
    vals = rng.uniform(0.01, 3.0, size=n * m).astype(np.float32)
    mat = sp.csr_matrix((vals, cols, np.arange(0, n * m + 1, m)), shape=(n, n_terms))
    return SparseCollection.from_scipy(mat)


@pytest.mark.gpu
def test_results_delivered_to_the_host_survive_later_batches_of_the_same_shape(rng):
    """Three batches of one shape launched with their results delivered to the host before any
    is taken (two slots: the third copies the oldest's results out of its way first), then one
    of the same shape with device results: every batch equals the float64 reference, also when
    taken into poisoned page-locked buffers."""
    require_cuda_kernels()
    from gpusparse.engines import choose
    from gpusparse.engines.base import SearchPlan
    from gpusparse.layout.statistics import max_scores_host
    from gpusparse.queries import prepare_queries
    from gpusparse.search import complete_later

    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda")
    idx = index.resident_on(index.device)
    engine = choose("tiled", idx.device)
    k = 20
    batches = [_queries_of_width(rng, 3) for _ in range(4)]
    ready = [prepare_queries(q, idx.vocab, idx.quantization, max_scores_host(idx)) for q in batches]
    to_host = SearchPlan(doc_chunk=idx.n_docs, to_host=True)
    launched = [engine.search_batch(idx, q, k, to_host) for q in ready[:3]]
    on_device = engine.search_batch(idx, ready[3], k, SearchPlan(doc_chunk=idx.n_docs))
    assert all(r.host is not None and r.scores is None for r in launched) and on_device.host is None
    entries = [e for e in idx.derived.graphs.values() if e]
    assert len(entries) == 1 and len(entries[0].slots) == 2  # one shape, both slots used
    # the results (scores, ids, flags) in one page-locked buffer each slot: one copy in the graph
    assert all(len({h.untyped_storage().data_ptr() for h in s.host_out}) == 1 for s in entries[0].slots)
    into = (torch.full((3, k), -7.0).pin_memory(), torch.full((3, k), -7, dtype=torch.int64).pin_memory())
    got = [complete_later(launched[0], into)(), complete_later(launched[1])(), complete_later(launched[2])()]
    got.append(tuple(t.cpu() for t in on_device.resolved()))
    assert got[0][0].data_ptr() == into[0].data_ptr()  # written where asked
    for queries, (scores, ids) in zip(batches, got, strict=True):
        ref_s, ref_i = reference_topk(dense_scores(docs, queries), k)
        np.testing.assert_array_equal(ids.numpy(), ref_i)
        np.testing.assert_array_equal(scores.numpy(), ref_s)


@pytest.mark.gpu
def test_large_results_leave_the_graph_on_the_device(rng, monkeypatch):
    """Results above HOST_COPY_MAX_BYTES are not copied in the graph: a search that asks for them
    on the host gets device results (copied after the replay), pipelined and exact."""
    require_cuda_kernels()
    from gpusparse.engines.tiled import graphs

    monkeypatch.setattr(graphs, "HOST_COPY_MAX_BYTES", 0)
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda")
    queries = _queries_of_width(rng, 6)
    with graph_outcomes() as calls:
        res = index.search(queries, 30, batch_size=2)
    assert calls == [True, True, True]
    assert all(not s.host_out for e in index.derived.graphs.values() if e for s in e.slots)
    ref_s, ref_i = reference_topk(dense_scores(docs, queries), 30)
    np.testing.assert_array_equal(res.ids.numpy(), ref_i)
    np.testing.assert_array_equal(res.scores.numpy(), ref_s)


def test_outputs_of_one_buffer_are_copied_as_one():
    """Outputs that are contiguous views packed in one buffer (finish_rows's packed results) are
    found as such, and their host views sit at the same places in a host copy of those bytes;
    anything else (separate tensors, a strided view, views scattered over a larger buffer) is not."""
    from gpusparse.kernels.finish import _outputs

    outs = _outputs(3, 5, torch.device("cpu"), packed=True)
    scores, ids, flags = outs
    found = _packed(outs)
    assert found is not None and found[0].numel() == 3 * 5 * 12 + 3 and found[1] == [120, 0, 180]
    scores.copy_(torch.arange(15, dtype=torch.float32).view(3, 5))
    ids.copy_(-torch.arange(15).view(3, 5))
    flags.copy_(torch.tensor([True, False, True]))
    host = found[0].clone()  # what the graph's one copy does
    got = [_view_at(host, at, o) for at, o in zip(found[1], outs, strict=True)]
    assert all(torch.equal(g, o) and g.dtype == o.dtype for g, o in zip(got, outs, strict=True))
    assert _packed([scores, ids, flags.clone()]) is None
    assert _packed([scores.t(), ids]) is None
    assert _packed(list(_outputs(3, 5, torch.device("cpu"), packed=False))) is None
    big = torch.zeros(1000, dtype=torch.uint8)
    assert _packed([big[:8].view(torch.int64), big[992:].view(torch.int64)]) is None
    assert _packed([]) is None


def test_a_slot_waits_for_its_last_replay_before_its_buffers_go():
    """A slot's page-locked buffers are read and written by its graph's own copies, which PyTorch
    does not track: dropping the slot (evicted, reset) first waits for its last replay, and the
    buffers are still held while it waits."""
    import weakref

    from gpusparse.engines.tiled.graphs import _Slot

    seen = []
    staging = torch.zeros(16, dtype=torch.uint8)
    alive = weakref.ref(staging)

    class Event:
        def synchronize(self):
            seen.append(alive() is not None)

        def query(self):
            return True

    slot = _Slot(None, staging, {}, [], [], [], Event(), None)  # type: ignore[arg-type]
    del staging
    assert alive() is not None
    del slot
    assert seen == [True] and alive() is None


def test_results_taken_once_each_and_no_flags_as_none():
    """HostResults.take: one wait, a copy of each output of its own (later replays do not
    change them), the flags' output ``None`` when no flag is set and a copy when one is; ``into``
    filled where given; the slot freed; taken again (copied out of the way before), the same."""
    from gpusparse.engines.tiled.graphs import HostResults, _Slot

    waits = []

    class Event:
        def synchronize(self):
            waits.append(1)

        def query(self):
            return True

    for flagged in (False, True):
        host_out = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.arange(6).view(2, 3),
                    torch.tensor([False, flagged])]  # fmt: skip
        slot = _Slot(None, torch.zeros(1, dtype=torch.uint8), {}, [], host_out, [h.numpy() for h in host_out], Event(),
                     None)  # type: ignore[arg-type]  # fmt: skip
        slot.pending = HostResults(slot, flag=2)
        waits.clear()  # (the last loop's slot, dropped, waited for its replay)
        into = torch.full((2, 3), -1.0)
        scores, ids, redo = slot.pending.take((into,))
        assert scores is into and torch.equal(into, host_out[0]) and torch.equal(ids, host_out[1])
        assert (redo is None) == (not flagged) and (redo is None or torch.equal(redo, host_out[2]))
        assert slot.pending is None and waits == [1]
        for h in host_out:
            h.fill_(7)  # the next replay writes the buffers
        assert ids.tolist() == [[0, 1, 2], [3, 4, 5]] and (redo is None or redo.tolist() == [False, True])
    early = HostResults(slot, flag=2)
    slot.pending = early
    host_out[2].fill_(False)
    slot.make_free()  # both slots busy: this one's results copied out of the way
    assert slot.pending is None
    for h in host_out:
        h.fill_(9)
    scores, ids, redo = early.take()
    assert redo is None and (scores == 7).all() and (ids == 7).all()


@pytest.mark.gpu
def test_a_failed_second_capture_leaves_the_first_slot_serving(rng, monkeypatch):
    """When a shape's second capture fails (out of memory, say), its first slot goes on serving
    alone (copying the pending results out of its way): pipelined batches stay graphed and exact."""
    require_cuda_kernels()
    from gpusparse.engines.tiled import graphs

    real = graphs._capture
    calls = []

    def once(entry, *a, **kw):
        calls.append(len(entry.slots))
        return real(entry, *a, **kw) if not entry.slots else None

    monkeypatch.setattr(graphs, "_capture", once)
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda")
    queries = _queries_of_width(rng, 6)
    with graph_outcomes() as outcomes:
        res = index.search(queries, 30, batch_size=2)
    assert outcomes == [True, True, True] and 1 in calls
    entries = [e for e in index.derived.graphs.values() if e]
    assert len(entries) == 1 and len(entries[0].slots) == 1
    ref_s, ref_i = reference_topk(dense_scores(docs, queries), 30)
    np.testing.assert_array_equal(res.ids.numpy(), ref_i)
    np.testing.assert_array_equal(res.scores.numpy(), ref_s)


def test_collection_is_held_inside_the_block_and_restored_after():
    """collection_held (both CUDA graph captures run in it): no automatic collection inside,
    the collector enabled again after (also when the block raises), left off if it was off."""
    import gc

    from gpusparse.streams import collection_held

    assert gc.isenabled()
    with collection_held():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_held():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_held():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.gpu
def test_a_garbage_collection_due_during_a_capture_does_not_void_it(rng, monkeypatch):
    """A dropped index whose captured graphs sit in a reference cycle is freed by the next
    automatic garbage collection; one due while another index captures (forced here: the cycle
    made and the collector's threshold passed inside the capture) would destroy those graphs
    mid-capture and void it. The capture holds the collector off: the batch runs by its graph."""
    require_cuda_kernels()
    import gc

    from gpusparse.engines.tiled import graphs

    docs = random_collection(rng, 20_000, 300, 30)
    dropped = Index.build(docs, device="cuda")
    queries = _queries_of_width(rng, 2)
    with graph_outcomes() as outcomes:
        dropped.search(queries, 10)
    assert outcomes == [True] and any(e for e in dropped.derived.graphs.values())
    held = [dropped]
    del dropped
    real = graphs._capture

    def with_garbage(entry, steps, batch):
        def steps_then_collect(inputs):
            out = steps(inputs)
            if torch.cuda.is_current_stream_capturing() and held:
                cycle = [held.pop()]
                cycle.append(cycle)  # now only the cycle holds the dropped index
                del cycle
                _ = [[] for _ in range(10 * gc.get_threshold()[0])]  # tracked objects past the threshold
            return out

        return real(entry, steps_then_collect, batch)

    monkeypatch.setattr(graphs, "_capture", with_garbage)
    index = Index.build(docs, device="cuda")
    with graph_outcomes() as outcomes:
        res = index.search(queries, 20)
    assert not held and outcomes == [True]
    gc.collect()  # the dropped index goes now, outside any capture
    ref_s, ref_i = reference_topk(dense_scores(docs, queries), 20)
    np.testing.assert_array_equal(res.ids.numpy(), ref_i)
    np.testing.assert_array_equal(res.scores.numpy(), ref_s)


def _fake_entry(rows: int, width: int, launches: list, *, n_slots: int = 2):
    """A GraphEntry of ``rows`` x ``width`` with ``n_slots`` slots whose graphs are not run: a
    launch is recorded (with the rows its staging buffer holds then), its outputs are the
    packed host buffer's (scores, ids, flags) views, and its event has always completed."""
    from gpusparse.engines.tiled.graphs import GraphEntry, _Slot

    class Event:
        def record(self, stream):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

    fields, size = csr_fields(rows, rows * width)
    entry = GraphEntry(rows, width, 8, fields, size, torch.device("cuda", 0), 0, (0, 0))
    for _ in range(n_slots):
        staging = torch.full((size,), 0xAB, dtype=torch.uint8)
        views = {n: _numpy_view(staging.numpy(), spec) for n, spec in fields.items()}
        buf = torch.zeros(rows * 3 * 12 + rows, dtype=torch.uint8)
        host_out = [buf[: rows * 12].view(torch.float32).view(rows, 3), buf[rows * 12 : rows * 36].view(torch.int64)
                    .view(rows, 3), buf[rows * 36 :].view(torch.bool)]  # fmt: skip

        def launch(stream, views=views):
            launches.append((views["indptr"].copy(), views["indices"].copy(), views["values"].copy()))

        entry.slots.append(_Slot(None, staging, views, [], host_out, [h.numpy() for h in host_out], Event(), launch))  # type: ignore[arg-type]
    return entry


def test_a_repeat_replays_its_own_shape_only(rng, monkeypatch):
    """Repeat.launch stages a batch of its entry's rows and query width into an idle slot (over a
    poisoned buffer) and replays it, the entry moved to the cache's end; it declines (``None``,
    nothing launched) another number of rows, a longer query width, other settings in force, an
    entry no longer in its cache, and a shape whose second slot is still to be captured."""
    from collections import OrderedDict

    from gpusparse.engines.tiled import graphs
    from gpusparse.engines.tiled.graphs import HostResults, Repeat

    monkeypatch.setattr(graphs, "raw_stream", lambda device_index: 0)
    launches: list = []
    entry = _fake_entry(4, 16, launches)
    cache: OrderedDict = OrderedDict([("k", entry), ("other", None)])
    rep = Repeat(cache, "k", entry, 2)
    batch = _queries_of_width(rng, 4, m=9)  # pads to 16
    out = rep.launch(batch.indptr, batch.indices, batch.values)
    assert isinstance(out, HostResults) and len(launches) == 1 and list(cache) == ["other", "k"]
    indptr, indices, values = launches[0]
    np.testing.assert_array_equal(indptr, batch.indptr)
    np.testing.assert_array_equal(indices[:36], batch.indices)
    np.testing.assert_array_equal(values[:36], batch.values)
    assert (values[36:].view(np.uint8) == 0xAB).all()
    out.take()
    import scipy.sparse as sp

    from gpusparse import SparseCollection

    cols = np.concatenate([rng.choice(300, size=m, replace=False) for m in (20, 4, 4, 4)])
    long_first = sp.csr_matrix((np.ones(32, np.float32), cols, [0, 20, 24, 28, 32]), shape=(4, 300))
    one_long = SparseCollection.from_scipy(long_first)
    declined = [
        _queries_of_width(rng, 3, m=9),  # three rows
        _queries_of_width(rng, 4, m=17),  # pads to 32 (more terms than the buffer holds)
        one_long,  # pads to 32 (as many terms as the batch above)
        _queries_of_width(rng, 4, m=4),  # pads to 8
    ]
    for other in declined:
        assert rep.launch(other.indptr, other.indices, other.values) is None
    with override_config(graph_cache=7):  # other settings: the repeat was made under the others
        assert rep.launch(batch.indptr, batch.indices, batch.values) is None
    cache["k"] = _fake_entry(4, 16, [])  # the shape captured again (dropped, then a new entry)
    assert rep.launch(batch.indptr, batch.indices, batch.values) is None
    del cache["k"]
    assert rep.launch(batch.indptr, batch.indices, batch.values) is None
    cache["k"] = entry
    assert len(launches) == 1
    # an entry dropped from the cache is freed though its repeat is still held (its buffers with it)
    import gc
    import weakref

    gc.disable()  # freed by reference counting, not by a collection
    try:
        gone = weakref.ref(entry)
        entry.repeat = rep
        del cache["k"], entry, out
        assert gone() is None and rep.launch(batch.indptr, batch.indices, batch.values) is None
    finally:
        gc.enable()
    lone = _fake_entry(4, 16, launches, n_slots=1)  # room for a second slot, the first busy
    cache["lone"] = lone
    lone_rep = Repeat(cache, "lone", lone, 2)
    assert lone_rep.launch(batch.indptr, batch.indices, batch.values) is not None
    assert lone_rep.launch(batch.indptr, batch.indices, batch.values) is None  # its results not yet taken
    assert len(launches) == 2
    # outputs the graph does not copy out, one of them not contiguous: not one copy each after the replay
    strided = _fake_entry(4, 16, launches)
    for slot in strided.slots:
        slot.host_out, slot.out_views = [], [torch.zeros(3, 4), torch.zeros(4, 3).t()]
    cache["strided"] = strided
    assert Repeat(cache, "lone", lone, 2).serves and not Repeat(cache, "strided", strided, 2).serves
    assert Repeat(cache, "strided", strided, 2).launch(batch.indptr, batch.indices, batch.values) is None
    assert len(launches) == 2


def test_results_in_memory_of_their_own_taken_before_the_wait(monkeypatch):
    """HostResults(own=True) takes its outputs' memory when made (before the wait, while the
    device works) and fills it after: results equal the slot's buffers, do not alias them and
    keep their values through the next replay; the flags ``None`` when none is set, a copy when
    one is; ``into``, where given, is still written instead."""
    from gpusparse.engines.tiled.graphs import HostResults

    launches: list = []
    entry = _fake_entry(2, 8, launches, n_slots=1)
    slot = entry.slots[0]
    for flagged in (False, True):
        scores_h, ids_h, flags_h = slot.host_out
        scores_h.copy_(torch.arange(6, dtype=torch.float32).view(2, 3))
        ids_h.copy_(torch.arange(6).view(2, 3) - 3)
        flags_h.copy_(torch.tensor([flagged, False]))
        slot.pending = HostResults(slot, 2, own=True)
        scores, ids, redo = slot.pending.take()
        assert torch.equal(scores, scores_h) and torch.equal(ids, ids_h) and slot.pending is None
        assert scores.data_ptr() != scores_h.data_ptr() and ids.data_ptr() != ids_h.data_ptr()
        assert (redo is None) == (not flagged) and (redo is None or redo.tolist() == [True, False])
        for h in slot.host_out:
            h.fill_(1)  # the next replay
        assert scores.tolist() == [[0, 1, 2], [3, 4, 5]] and ids.tolist() == [[-3, -2, -1], [0, 1, 2]]
        assert redo is None or redo.tolist() == [True, False]
    slot.pending = HostResults(slot, 2, own=True)
    into = torch.full((2, 3), -1.0)
    scores, _, _ = slot.pending.take((into,))
    assert scores is into and (into == 1).all()


def test_results_delivered_into_tensors_of_their_own_are_taken_as_they_are():
    """HostResults(delivered=...): after the one wait, the tensors the replay's stream copied into
    are the results themselves (no copy), the flags' ``None`` where none is set; ``into``, where
    given, is written; the slot is freed."""
    from gpusparse.engines.tiled.graphs import HostResults

    waits: list = []
    for flagged in (False, True):
        slot = _fake_entry(2, 8, [], n_slots=1).slots[0]
        slot.done.synchronize = lambda: waits.append(1)  # type: ignore[method-assign]
        delivered = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.arange(6).view(2, 3),
                     torch.tensor([False, flagged])]  # fmt: skip
        slot.pending = HostResults(slot, 2, own=True, delivered=delivered)
        waits.clear()
        scores, ids, redo = slot.pending.take()
        assert scores is delivered[0] and ids is delivered[1] and waits == [1] and slot.pending is None
        assert (redo is None) == (not flagged) and (redo is None or redo is delivered[2])
    slot.pending = HostResults(slot, 2, delivered=delivered)
    into = torch.full((2, 3), -1.0)
    scores, _, _ = slot.pending.take((into,))
    assert scores is into and torch.equal(into, delivered[0])


def _served(monkeypatch) -> list[bool]:
    """For each batch offered to a graph's Repeat, in order: whether it served the batch."""
    from gpusparse.engines.tiled import graphs

    served: list[bool] = []
    real = graphs.Repeat.launch

    def counted(self, *a):
        out = real(self, *a)
        served.append(out is not None)
        return out

    monkeypatch.setattr(graphs.Repeat, "launch", counted)
    return served


@pytest.mark.gpu
@pytest.mark.parametrize(("quantize", "large"), [(None, False), (8, False), (8, True)])
def test_later_batches_of_one_shape_replay_by_its_repeat(rng, monkeypatch, quantize, large):
    """Index.search called batch after batch of one shape (3 queries, and 12 above graph_max_batch):
    from the second call on (the third for 12: its graph is captured at the second) the graph's
    Repeat stages and replays it (counted), its results in memory of their own (``large``: results
    above HOST_COPY_MAX_BYTES, copied after the replay into page-locked tensors); another query
    width, other settings or the index's derived state reset go the general way. Fresh queries
    each call, every row equal to the float64 reference; the results of earlier calls unchanged."""
    require_cuda_kernels()
    from gpusparse.engines.tiled import graphs

    if large:
        monkeypatch.setattr(graphs, "HOST_COPY_MAX_BYTES", 0)
    served = _served(monkeypatch)
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda", quantize=quantize)

    def reference(queries, k):
        if quantize:
            return reference_topk(dense_scores(docs_q(index, docs), quantize_queries(queries, quantize)), k)
        return reference_topk(dense_scores(docs, queries), k)

    kept = []
    with override_config(graph_max_batch=8, graph_repeat_batch=16):
        for n, m, expect in [(3, 5, []), (3, 6, [True]), (3, 7, [True]), (3, 12, [False]), (3, 13, [True]),
                             (12, 4, [False]), (12, 4, []), (12, 4, [True]), (12, 4, [True])]:  # fmt: skip
            queries = _queries_of_width(rng, n, m=m)
            served.clear()
            res = index.search(queries, 20)
            assert served == expect, (n, m, served)
            kept.append((queries, res, res.ids.clone(), res.scores.clone()))
            entries = [e for e in index.derived.graphs.values() if e]
            assert entries and all(bool(s.host_out) != large for e in entries for s in e.slots)
    with override_config(graph_max_batch=8, graph_repeat_batch=16, graph_cache=5):  # other settings
        served.clear()
        res = index.search(_queries_of_width(rng, 12, m=4), 20)
        assert served == []  # the Search itself is made again under other settings
    index.derived.reset()
    with override_config(graph_max_batch=8, graph_repeat_batch=16):
        queries = _queries_of_width(rng, 3, m=5)
        served.clear()
        res = index.search(queries, 20)
        assert served == []
        kept.append((queries, res, res.ids.clone(), res.scores.clone()))
    for queries, res, ids, scores in kept:
        ref_s, ref_i = reference(queries, 20)
        assert torch.equal(res.ids, ids) and torch.equal(res.scores, scores)  # not overwritten by later calls
        np.testing.assert_array_equal(ids.numpy(), ref_i)
        np.testing.assert_array_equal(scores.numpy(), ref_s)


@pytest.mark.gpu
@pytest.mark.parametrize("large", [False, True])
def test_a_repeat_searches_its_flagged_rows_again(rng, monkeypatch, large):
    """Rows a repeated graph flags (every row here: no margin allowed) are searched the general
    way after its one wait: the repeat served, and every row equals the float64 reference
    (``large``: results copied after the replay, as those above HOST_COPY_MAX_BYTES are)."""
    require_cuda_kernels()
    from gpusparse.engines.tiled import fixed_point as fpm
    from gpusparse.engines.tiled import graphs

    if large:
        monkeypatch.setattr(graphs, "HOST_COPY_MAX_BYTES", 0)
    monkeypatch.setattr(fpm, "FIXED_MAX_DELTA", 0)
    served = _served(monkeypatch)
    docs = random_collection(rng, 20_000, 300, 30)
    index = Index.build(docs, device="cuda")
    for _ in range(3):
        queries = _queries_of_width(rng, 4, m=6)
        res = index.search(queries, 20)
        ref_s, ref_i = reference_topk(dense_scores(docs, queries), 20)
        np.testing.assert_array_equal(res.ids.numpy(), ref_i)
        np.testing.assert_array_equal(res.scores.numpy(), ref_s)
    assert served == [True, True]
