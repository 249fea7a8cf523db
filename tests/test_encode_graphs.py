"""The encoder's CUDA-graph layer: length buckets, the padded forward (eagerly on the CPU, the
same code minus the capture), the check of a capture and the loud fallback; on a GPU, graphs
on against graphs off."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch

from gpusparse import encode_graphs
from gpusparse.encode import SpladeEncoder, random_bert_base
from gpusparse.encode_graphs import BucketedForward, GraphsUnavailable, bucket_length
from gpusparse.encode_tokens import Tokenize, token_batches
from gpusparse.streams import capture_stream

from .shared_data import SPLADE_TINY, cranfield_slice, needs_shared

pytestmark = needs_shared
MAX_LEN = 100  # several cranfield documents are longer: truncated, in the bucket of MAX_LEN


@pytest.fixture(scope="module")
def texts() -> list[str]:
    docs, queries, _ = cranfield_slice(40)
    # Lengths over many buckets (queries ~10-30 tokens, documents up to MAX_LEN), empty texts,
    # and 45 non-empty texts: batches of 8 leave a last partial batch.
    out = [f"{d['title']} {d['text']}" for d in docs[:30]] + [q["text"] for q in queries[:13]] + ["wing", "a b"]
    return [*out[:5], "", *out[5:], "   "]


def dense(coll) -> np.ndarray:
    return coll.to_scipy().toarray()


def encoder(**kw) -> SpladeEncoder:
    """A fresh splade-tiny encoder on the CPU (the tests change its model's settings)."""
    return SpladeEncoder(SPLADE_TINY, device="cpu", doc_max_length=MAX_LEN, batch_size=8, **kw)


def assert_same_vectors(got: np.ndarray, want: np.ndarray, rtol: float, atol: float, clear: float) -> None:
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    # The same non-zeros wherever a weight is clearly above rounding.
    differ = (got > 0) != (want > 0)
    assert np.all(np.maximum(got, want)[differ] < clear)


def test_bucket_lengths():
    assert [bucket_length(n, 512) for n in (1, 8, 9, 127, 128, 129, 256, 257, 500)] == [
        8, 8, 16, 128, 128, 144, 256, 288, 512,
    ]  # fmt: skip
    assert bucket_length(37, 40) == 40 and bucket_length(40, 40) == 40  # never past the maximum length
    assert bucket_length(250, 256) == 256
    assert len({bucket_length(n, 512) for n in range(1, 513)}) == encode_graphs.DEFAULT_MAX_GRAPHS


def test_token_batches_pad_to_buckets(texts):
    enc = encoder(cuda_graphs=False)
    tok = Tokenize(enc.tokenizer, MAX_LEN)
    plain = list(token_batches(texts, tok, 8, window=16))
    padded = list(token_batches(texts, tok, 8, window=16, pad_to=lambda n: bucket_length(n, MAX_LEN)))
    assert [tuple(b.rows) for b in plain] == [tuple(b.rows) for b in padded]
    widths = set()
    for p, q in zip(plain, padded, strict=True):
        width = q.input_ids.shape[1]
        widths.add(width)
        assert width == bucket_length(int(p.lengths.max()), MAX_LEN) >= p.input_ids.shape[1]
        assert np.array_equal(p.lengths, q.lengths)
        assert torch.equal(q.input_ids[:, : p.input_ids.shape[1]], p.input_ids)
        assert bool((q.input_ids[:, p.input_ids.shape[1] :] == tok.pad_id).all())
    assert len(widths) >= 3
    with pytest.raises(ValueError, match="shorter"):
        list(token_batches(texts, tok, 8, pad_to=lambda n: n - 1))


@pytest.mark.parametrize(("pooling", "attention"), [("max", "sdpa"), ("sum", "sdpa"), ("max", "eager")])
def test_bucketed_forward_equals_eager(texts, pooling, attention):
    """Buckets, extra rows and the 4-D mask (and, for max pooling, padding as the first token's
    logits) change the vectors only by float rounding, for both attention implementations."""
    enc = encoder(pooling=pooling, cuda_graphs=False)
    enc.model.set_attn_implementation(attention)
    assert enc.model.config._attn_implementation == attention
    want = dense(enc.encode_documents(texts))
    enc._graphs = bucketed = enc._bucketed(capture=False)
    seen: list[tuple[int, int]] = []

    def spy(ids, mask, shortest):
        seen.append(tuple(ids.shape))
        return bucketed(ids, mask, shortest)

    enc._forward = spy  # type: ignore[method-assign]
    got = dense(enc.encode_documents(texts))
    assert_same_vectors(got, want, rtol=1e-5, atol=1e-5, clear=1e-5)
    assert len({w for _, w in seen}) >= 3 and all(w == bucket_length(w, MAX_LEN) for _, w in seen)
    assert any(b < 8 for b, _ in seen)  # the last, partial batch
    assert MAX_LEN in {w for _, w in seen}  # truncated documents
    assert (enc._graphs.hook_calls > 0) == (pooling == "max")
    assert enc.cuda_graph_stats is not None and enc.cuda_graph_stats["failed"] is None
    assert got[texts.index("")].sum() == 0 and got[-1].sum() == 0


def test_failure_falls_back_to_eager_loudly_once(texts, monkeypatch):
    enc = encoder(cuda_graphs=False)
    want = dense(enc.encode_documents(texts))
    enc._graphs = enc._bucketed(capture=False)

    def refuse(model, mask):
        raise GraphsUnavailable("attention implementation 'flex_attention' (graphs take 'sdpa' or 'eager')")

    monkeypatch.setattr(encode_graphs, "capturable_mask", refuse)
    with pytest.warns(RuntimeWarning, match="CUDA graphs are off.*flex_attention") as caught:
        got = dense(enc.encode_documents(texts))
        dense(enc.encode_documents(texts))
    assert len([w for w in caught if "CUDA graphs" in str(w.message)]) == 1
    assert_same_vectors(got, want, rtol=1e-5, atol=1e-5, clear=1e-5)
    assert "flex_attention" in enc.cuda_graph_stats["failed"]


class _FakeGraph:
    """A 'graph' whose replay runs the captured computation eagerly: the check on the CPU."""

    def __init__(self, fwd: BucketedForward, ids: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
        self.fwd, self.ids, self.mask, self.out = fwd, ids, mask, out

    def replay(self) -> None:
        self.out.copy_(self.fwd._run(self.ids, self.mask))


def test_check_of_a_capture_catches_a_wrong_mask(texts, monkeypatch):
    enc = encoder(cuda_graphs=False)
    fwd = enc._bucketed(capture=False)
    first = next(iter(token_batches(texts, Tokenize(enc.tokenizer, 64), 8, pad_to=lambda n: 64)))
    ids_v, mask_v, out = fwd._views(64)
    ids_v.copy_(first.input_ids.long())
    with torch.inference_mode():
        fwd._check(_FakeGraph(fwd, ids_v, mask_v, out), ids_v, mask_v, out)  # the right mask passes
        everything = lambda model, mask: torch.ones_like(mask).bool()[:, None, None]  # noqa: E731
        monkeypatch.setattr(encode_graphs, "capturable_mask", everything)
        with pytest.raises(GraphsUnavailable, match="differs from the eager one"):
            fwd._check(_FakeGraph(fwd, ids_v, mask_v, out), ids_v, mask_v, out)


class _FakeCuda:
    """Enough of ``torch.cuda`` for :meth:`BucketedForward._capture` on the CPU: a 'capture' notes
    the ``_run`` it saw, a replay runs it again into the static output."""

    def __init__(self, fwd: BucketedForward, fail_capture: bool = False) -> None:
        self.fwd, self.fail_capture, self.events = fwd, fail_capture, []
        self.stream = "default"
        capture_stream.cache_clear()  # a stream cached by another test's fake is no Stream of this one
        run = fwd._run

        def noted(ids, mask):
            self.last = (ids, mask)
            return run(ids, mask)

        fwd._run = noted  # type: ignore[method-assign]
        self.run = run
        fake = self

        class Stream:
            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def replay(self):
                fake.events.append("replay")
                fake.fwd._buffers[2].copy_(fake.run(*self.args))

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            # captured on the shared side stream (gpusparse.streams), never a fresh one
            assert capture_error_mode == "thread_local" and pool is not None and isinstance(stream, Stream)
            fake.stream = "capture"
            yield
            if fake.fail_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
            g.args = fake.last
            fake.stream = "default"
            fake.events.append("captured")

        self.patches = {
            "device": lambda d: contextlib.nullcontext(),
            "current_stream": lambda: Stream(),
            "Stream": Stream,
            "stream": lambda s: contextlib.nullcontext(),
            "get_sync_debug_mode": lambda: 0,
            "set_sync_debug_mode": lambda mode: self.events.append(f"sync debug {mode}"),
            "graph_pool_handle": lambda: "pool",
            "CUDAGraph": CUDAGraph,
            "graph": graph,
            "set_stream": lambda stream: setattr(self, "stream", "default"),
        }


@pytest.mark.parametrize("mode", ["capture", "fail", "bounded"])
def test_capture_path_on_a_fake_cuda(texts, monkeypatch, mode):
    """The Python side of capturing and replaying (static buffers shared by the buckets, a last
    partial batch, the check, the stream and sync mode put back after a failure) with a stand-in
    for the CUDA calls."""
    enc = encoder(cuda_graphs=False)
    want = dense(enc.encode_documents(texts))
    enc._graphs = fwd = enc._bucketed(capture=False)
    fwd.capture = True
    fake = _FakeCuda(fwd, fail_capture=mode == "fail")
    for name, value in fake.patches.items():
        monkeypatch.setattr(torch.cuda, name, value)
    if mode == "bounded":
        fwd.max_graphs = 2
        got = dense(enc.encode_documents(texts))
        stats = fwd.summary()
        assert stats["graphs"] == 2 and stats["eager_batches"] > 0 and stats["failed"] is None
    elif mode == "fail":
        with pytest.warns(RuntimeWarning, match="CUDA graphs are off.*not permitted"):
            got = dense(enc.encode_documents(texts))
        assert fake.stream == "default" and fake.events[-2:] == ["sync debug error", "sync debug 0"]
        assert fwd.summary()["graphs"] == 0
    else:
        got = dense(enc.encode_documents(texts))
        stats = fwd.summary()
        assert stats["graphs"] >= 3 and stats["failed"] is None and stats["eager_batches"] == 0
        assert fake.events.count("captured") == stats["graphs"]
        # a check replay per capture, and one replay per batch
        assert fake.events.count("replay") > 2 * stats["graphs"]
        again = dense(enc.encode_documents(texts[::-1]))[::-1]  # other batches (and maybe buckets)
        assert fake.events.count("captured") == fwd.summary()["graphs"] >= stats["graphs"]
        assert_same_vectors(again, want, rtol=1e-5, atol=1e-5, clear=1e-5)
    assert_same_vectors(got, want, rtol=1e-5, atol=1e-5, clear=1e-5)


def test_cuda_graphs_option():
    enc = encoder()
    assert enc.cuda_graphs is False and enc.cuda_graph_stats is None  # auto: off on the CPU
    with pytest.raises(ValueError, match="needs a CUDA device"):
        encoder(cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        encoder(cuda_graphs="on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CUDA device"):
        BucketedForward(enc.model, "max", None, 8, torch.device("cpu"), eager=enc._forward, capture=True)


# -- on a GPU -----------------------------------------------------------------------------------


def _pair(loaded=None, **kw) -> tuple[SpladeEncoder, SpladeEncoder]:
    """The same model on the GPU with graphs and without (one module, moved once)."""
    on = SpladeEncoder(SPLADE_TINY, loaded=loaded, device="cuda", doc_max_length=MAX_LEN, batch_size=8, **kw)
    off = SpladeEncoder(SPLADE_TINY, loaded=(on.tokenizer, on.model), device="cuda", doc_max_length=MAX_LEN,
                        batch_size=8, cuda_graphs=False, **kw)  # fmt: skip
    return on, off


@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graphs_equal_eager_splade_tiny(texts, pooling, dtype):
    on, off = _pair(pooling=pooling, dtype=dtype)
    assert on.cuda_graphs and not off.cuda_graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn: fail instead
        got = dense(on.encode_documents(texts))
        again = dense(on.encode_documents(texts))  # replays only
        queries = dense(on.encode_queries(texts[:20]))
    want = dense(off.encode_documents(texts))
    stats = on.cuda_graph_stats
    assert stats["failed"] is None and stats["eager_batches"] == 0
    assert 3 <= stats["graphs"] <= len({bucket_length(n, MAX_LEN) for n in range(1, MAX_LEN + 1)})
    assert MAX_LEN in stats["buckets"]
    np.testing.assert_array_equal(got, again)
    if dtype == "float32":
        assert_same_vectors(got, want, rtol=1e-4, atol=1e-4, clear=1e-4)
    else:  # half precision: other shapes round otherwise (see test_gpu_autocast_is_close_to_cpu_float32)
        assert_same_vectors(got, want, rtol=0.05, atol=0.06, clear=0.06)
    np.testing.assert_allclose(queries, dense(off.encode_queries(texts[:20])), rtol=0.05, atol=0.06)
    assert got[texts.index("")].sum() == 0 and got[-1].sum() == 0
    top = dense(on.encode_documents(texts, prune_top=7))
    assert ((top > 0).sum(axis=1) <= 7).all() and np.all((top == 0) | (top == got))


@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graphs_equal_eager_random_bert(texts, pooling):
    loaded = random_bert_base(SPLADE_TINY, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=128)  # fmt: skip
    on, off = _pair(loaded=loaded, pooling=pooling, dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = dense(on.encode_documents(texts))
    assert on.cuda_graph_stats["graphs"] >= 3
    assert_same_vectors(got, dense(off.encode_documents(texts)), rtol=1e-4, atol=1e-4, clear=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graphs_are_bounded(texts):
    on, off = _pair(dtype="float32")
    on._graphs.max_graphs = 2
    got = dense(on.encode_documents(texts))
    stats = on.cuda_graph_stats
    assert stats["graphs"] == 2 and stats["eager_batches"] > 0 and stats["failed"] is None
    assert_same_vectors(got, dense(off.encode_documents(texts)), rtol=1e-4, atol=1e-4, clear=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_host_sync_in_capture_falls_back_loudly(texts, monkeypatch):
    """transformers' own 2-D mask handling asks the device about padding (a host sync): captured,
    it raises, and the encoder says so once and runs eagerly."""
    on, off = _pair(dtype="float32")
    monkeypatch.setattr(encode_graphs, "capturable_mask", lambda model, mask: mask)
    with pytest.warns(RuntimeWarning, match="CUDA graphs are off") as caught:
        got = dense(on.encode_documents(texts))
    assert len([w for w in caught if "CUDA graphs" in str(w.message)]) == 1
    assert on.cuda_graph_stats["failed"] and on.cuda_graph_stats["graphs"] == 0
    assert_same_vectors(got, dense(off.encode_documents(texts)), rtol=1e-4, atol=1e-4, clear=1e-4)
    monkeypatch.undo()
    again = SpladeEncoder(SPLADE_TINY, device="cuda", doc_max_length=MAX_LEN, batch_size=8, dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the CUDA context still captures after a failed capture
        again.encode_documents(texts)
    assert again.cuda_graph_stats["graphs"] >= 3
