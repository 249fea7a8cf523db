"""The encoder's batching: token batches (sorted, padded, in a thread) and the device-side
extraction of non-zeros, against plain references."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gpusparse.encode_device import SparseBatch, assemble, prune, sparse_batches, splade_pool
from gpusparse.encode_tokens import TokenBatch, Tokenize, prefetched, token_batches

from .shared_data import cranfield_slice, needs_shared, tiny_encoder, tiny_transformers

V = 50


class WordTokenizer:
    """A slow (pure Python) tokenizer: one id per word, [CLS]=1 text [SEP]=2, pad 0."""

    is_fast = False
    pad_token_id = 0

    def __call__(self, texts, truncation=True, max_length=512):
        out = []
        for t in texts:
            ids = [3 + (sum(map(ord, w)) % (V - 3)) for w in t.split()]
            out.append([1, *ids[: max_length - 2], 2])
        return {"input_ids": out}


def test_token_batches_sort_pad_and_cover_the_nonempty_texts():
    texts = ["a b c d e f", "", "a", "  ", "a b", "x y z w", "q", "a b c d e f g h i j k"]
    tok = Tokenize(WordTokenizer(), max_length=6)
    batches = list(token_batches(texts, tok, batch_size=2, window=4))
    # Windows of 4 texts: [0..3] holds texts 0 and 2; [4..7] holds 4, 5, 6, 7; sorted by length in each.
    assert [b.rows.tolist() for b in batches] == [[2, 0], [6, 4], [5, 7]]
    ref = WordTokenizer()(texts, max_length=6)["input_ids"]
    for b in batches:
        assert b.input_ids.dtype == torch.int32 and b.input_ids.shape == (len(b.rows), b.lengths.max())
        assert b.lengths_t.tolist() == b.lengths.tolist() and list(b.lengths) == sorted(b.lengths)
        for j, row in enumerate(b.rows):
            n = int(b.lengths[j])
            assert b.input_ids[j, :n].tolist() == ref[row] and b.input_ids[j, n:].eq(0).all()
    assert sum(b.truncated for b in batches) == 2  # texts 0 and 7 have more than 4 words
    with pytest.raises(TypeError, match="text 1 is int"):
        list(token_batches(["a", 3], tok, 2))  # type: ignore[list-item]


@needs_shared
def test_fast_tokenize_equals_the_tokenizer_call():
    docs, queries, _ = cranfield_slice(20)
    texts = [f"{d['title']} {d['text']}" for d in docs] + [q["text"] for q in queries[:5]] + ["wing"]
    tok, _ = tiny_transformers()
    for max_length in (8, 40, 512):
        lengths, flat, truncated = Tokenize(tok, max_length)(texts)
        want = tok(texts, truncation=True, max_length=max_length)["input_ids"]
        assert lengths.tolist() == [len(x) for x in want]
        assert flat.tolist() == [i for x in want for i in x]
        full = [len(x) for x in tok(texts)["input_ids"]]
        assert truncated.tolist() == [n > max_length for n in full]
    assert tok.backend_tokenizer.truncation is None or tok.backend_tokenizer.truncation["max_length"] != 8


def test_prefetched_yields_in_order_raises_and_stops_early():
    assert list(prefetched(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("bad text")

    it = prefetched(failing())
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad text"):
        next(it)
    made = []

    def endless():
        i = 0
        while True:
            made.append(i)
            yield i
            i += 1

    it = prefetched(endless(), depth=2)
    assert next(it) == 0
    it.close()  # type: ignore[attr-defined]
    assert len(made) < 10 and not any(t.name == "gpusparse-tokenize" for t in threading.enumerate())


def test_max_pooling_with_a_shortest_prefix_is_bitwise_the_masked_one():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, 30, generator=g)
    lengths = torch.tensor([4, 4, 6, 9, 7])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
    want = splade_pool(logits.clone(), mask, "max")
    for shortest in (0, 1, 4):
        assert torch.equal(splade_pool(logits.clone(), mask, "max", shortest=shortest), want)
    full = torch.ones(5, 9, dtype=torch.long)
    assert torch.equal(splade_pool(logits.clone(), full, "max", shortest=9), splade_pool(logits.clone(), full, "max"))


def _fake_batches(reps: torch.Tensor, batch_size: int) -> tuple[list[TokenBatch], dict[int, torch.Tensor]]:
    """Token batches whose "model" (keyed by the first token id) returns rows of ``reps``."""
    n = reps.shape[0]
    order = np.random.default_rng(1).permutation(n)
    batches, table = [], {}
    for b0 in range(0, n, batch_size):
        rows = order[b0 : b0 + batch_size].astype(np.int64)
        ids = torch.full((len(rows), 3), 7, dtype=torch.int32)
        ids[:, 0] = torch.arange(b0, b0 + len(rows), dtype=torch.int32)
        table[b0] = reps[torch.from_numpy(rows)]
        lengths = np.full(len(rows), 3, dtype=np.int64)
        batches.append(TokenBatch(rows, lengths, ids, torch.from_numpy(lengths), truncated=1))
    return batches, table


@pytest.mark.parametrize(("top", "threshold"), [(None, None), (3, None), (None, 0.5), (2, 0.3), (V, None)])
@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_sparse_batches_and_assemble_equal_a_dense_reference(top, threshold, batch_size):
    g = torch.Generator().manual_seed(batch_size)
    reps = torch.relu(torch.randn(23, V, generator=g) - 1.0)
    reps[5] = 0  # an all-zero vector
    reps[7, :10] = 2.0  # ties at the top
    batches, table = _fake_batches(reps, batch_size)

    def forward(ids, mask, shortest):
        assert ids.dtype == torch.int64 and mask.shape == ids.shape and shortest == 3
        return table[int(ids[0, 0])].clone()

    n = reps.shape[0] + 2  # two rows no batch holds (empty texts)
    got = list(sparse_batches(batches, forward, torch.device("cpu"), prune_top=top, prune_threshold=threshold))
    assert [b.rows.tolist() for b in got] == [b.rows.tolist() for b in batches]
    indptr, terms, weights = assemble(got, n, chunk_postings=7)
    want = torch.cat([reps, torch.zeros(2, V)])
    before = (want > 0).sum(1)
    want = prune(want.clone(), top=top, threshold=threshold)
    dense = np.zeros((n, V), np.float32)
    for i in range(n):
        a, b = indptr[i], indptr[i + 1]
        assert np.all(np.diff(terms[a:b]) > 0)
        dense[i, terms[a:b]] = weights[a:b]
    assert terms.dtype == np.int32 and weights.dtype == np.float32 and indptr.dtype == np.int64
    np.testing.assert_array_equal(dense, want.numpy())  # bitwise: the same floats
    nnz_before = np.zeros(n, np.int64)
    for b in got:
        nnz_before[b.rows] = b.nnz_before
        assert isinstance(b, SparseBatch) and b.truncated == 1
    np.testing.assert_array_equal(nnz_before, before.numpy())


def test_assemble_of_nothing():
    indptr, terms, weights = assemble([], 3)
    assert indptr.tolist() == [0, 0, 0, 0] and terms.size == weights.size == 0


@needs_shared
def test_encode_batches_are_the_rows_of_encode():
    docs, _, _ = cranfield_slice(30)
    texts = [f"{d['title']} {d['text']}" for d in docs] + ["", "wing"]
    enc = tiny_encoder(doc_max_length=40, batch_size=8)
    coll = enc.encode_documents(texts)
    seen = []
    for b in enc.encode_batches(texts, prune_top=None):
        for j, row in enumerate(b.rows):
            a, e = coll.indptr[row], coll.indptr[row + 1]
            assert b.terms[b.indptr[j] : b.indptr[j + 1]].tolist() == coll.indices[a:e].tolist()
            np.testing.assert_array_equal(b.weights[b.indptr[j] : b.indptr[j + 1]], coll.values[a:e])
        seen.extend(b.rows.tolist())
    assert sorted(seen) == [i for i in range(len(texts)) if texts[i]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("top", [None, 5])
def test_gpu_sparse_batches_equal_a_dense_reference(top):
    """The asynchronous path (pinned copies, events, deferred extraction) on a CUDA device."""
    g = torch.Generator().manual_seed(3)
    reps = torch.relu(torch.randn(300, V, generator=g) - 1.0)
    batches, table = _fake_batches(reps, 16)
    for b in batches:
        b.input_ids, b.lengths_t = b.input_ids.pin_memory(), b.lengths_t.pin_memory()
    table = {k: v.cuda() for k, v in table.items()}

    def forward(ids, mask, shortest):
        out = table[int(ids[0, 0])].clone()  # the int() is this fake's own sync, not the pipeline's
        torch.cuda._sleep(2_000_000)  # a slow "model": the host runs ahead
        return out

    got = list(sparse_batches(batches, forward, torch.device("cuda"), prune_top=top))
    indptr, terms, weights = assemble(got, reps.shape[0])
    dense = np.zeros(reps.shape, np.float32)
    for i in range(reps.shape[0]):
        dense[i, terms[indptr[i] : indptr[i + 1]]] = weights[indptr[i] : indptr[i + 1]]
    np.testing.assert_array_equal(dense, prune(reps.clone().cuda(), top=top).cpu().numpy())


@needs_shared
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_encoder_pipeline_matches_cpu_float32():
    """The whole GPU path (tokenising thread, pinned ids, deferred extraction, several windows) in
    float32 against the CPU encoder, and its batches against its own collection."""
    from gpusparse.encode import SpladeEncoder

    from .shared_data import SPLADE_TINY

    docs, _, _ = cranfield_slice(120)
    texts = [f"{d['title']} {d['text']}" for d in docs] + ["", "wing"]
    gpu = SpladeEncoder(SPLADE_TINY, device="cuda", dtype="float32", batch_size=8, doc_max_length=40, sort_window=32)
    cpu = tiny_encoder(doc_max_length=40, batch_size=8)
    for top in (None, 20):
        got = gpu.encode_documents(texts, prune_top=top)
        want = cpu.encode_documents(texts, prune_top=top)
        np.testing.assert_allclose(got.to_scipy().toarray(), want.to_scipy().toarray(), rtol=1e-4, atol=1e-4)
        for b in gpu.encode_batches(texts, prune_top=top):
            for j, row in enumerate(b.rows):
                a, e = got.indptr[row], got.indptr[row + 1]
                assert b.terms[b.indptr[j] : b.indptr[j + 1]].tolist() == got.indices[a:e].tolist()
    # Indexed on the GPU straight from the encoder = indexed on the CPU from its exact JSONL.
    import tempfile

    from gpusparse import Index, read_vectors, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        write_jsonl(got, f"{tmp}/v.jsonl.gz")
        via_file = Index.build(read_vectors(f"{tmp}/v.jsonl.gz", progress=False))
    direct = Index.build(got, device="cuda")
    for name in ("doc_ids", "scores", "offsets", "lengths", "padded_lengths", "max_scores"):
        assert torch.equal(getattr(direct, name).cpu(), getattr(via_file, name)), name
