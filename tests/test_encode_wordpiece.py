"""The word-cache tokenisation of ASCII texts (gpusparse.encode_wordpiece) against the Rust
tokenizer it stands in for: the same ids, lengths and truncation flags, text by text."""

from __future__ import annotations

import itertools
import random
import string

import numpy as np
import pytest
import torch

from gpusparse import encode_wordpiece
from gpusparse.encode import EncodeStats
from gpusparse.encode_tokens import Tokenize, token_batches, windows

from .shared_data import cranfield_slice, needs_shared, tiny_encoder, tiny_transformers

tokenizers = pytest.importorskip("tokenizers")

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["wing", "flow", "air", "un", "##ing", "##s", "##ed", "##able", "want", "##want", "boundary", "layer"]
WORDS += ["1", "##0"]


class FastTokenizer:
    """What :class:`Tokenize` reads of a Hugging Face fast tokenizer."""

    is_fast = True
    pad_token_id = 0

    def __init__(self, backend, truncation_side: str = "right") -> None:
        self.backend_tokenizer, self.truncation_side = backend, truncation_side


def small_bert(*, lowercase: bool = True, pre_tokenizer=None):
    """A BERT-like Rust tokenizer over a small WordPiece vocabulary (no download)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    chars = list(string.ascii_lowercase + string.digits + string.punctuation + "AW")
    vocab = {t: i for i, t in enumerate(dict.fromkeys(SPECIAL + chars + [f"##{c}" for c in chars] + WORDS))}
    tk = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=20))
    tk.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tk.pre_tokenizer = pre_tokenizer or pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tk.add_special_tokens(SPECIAL)
    return tk


def random_texts(n: int, seed: int = 0) -> list[str]:
    """ASCII of every kind (controls, whitespace, punctuation, long words, special tokens in
    any case), some non-ASCII characters, and plain word salad."""
    rng = random.Random(seed)
    pieces = [chr(i) for i in range(128)] + ["[MASK]", "[cls]", "[SeP]", "é", "\u00a0", "’", "中", "a" * 25]
    pieces += ["Wing", "WANTABLE", "unwanted", "boundary", "layers", "10", "100"]
    plain = string.ascii_letters + string.digits + string.punctuation + " \t\n\r"
    out = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))) for _ in range(n)]
    out += ["".join(rng.choice(plain) for _ in range(rng.randint(0, 60))) for _ in range(n)]
    salad = [*WORDS, "Wing", "air-flow", "un.want"]
    out += [" ".join(rng.choice(salad) for _ in range(rng.randint(1, 30))) for _ in range(n)]
    return out


def assert_same(tokenizer, texts: list[str], max_length: int) -> Tokenize:
    fast = Tokenize(tokenizer, max_length, word_cache=True)
    want = Tokenize(tokenizer, max_length, word_cache=False)(texts)
    got = fast(texts)
    for name, w, g in zip(("lengths", "ids", "truncated"), want, got, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=f"{name} at max_length {max_length}")
        assert g.dtype == w.dtype
    return fast


@pytest.mark.parametrize("lowercase", [True, False])
@pytest.mark.parametrize("side", ["right", "left"])
def test_word_cache_equals_the_rust_tokenizer(lowercase, side):
    tok = FastTokenizer(small_bert(lowercase=lowercase), truncation_side=side)
    texts = random_texts(300)
    for max_length in (3, 4, 9, 64):
        fast = assert_same(tok, texts, max_length)
        assert fast.words is not None
    covered = sum(map(fast.words.covers, texts))
    assert 300 < covered < len(texts)  # both paths ran, interleaved
    assert not fast.words.covers("wing [mask]") and not fast.words.covers("a\x0bb") and not fast.words.covers("é")


def test_word_cache_starts_afresh_when_full(monkeypatch):
    tok = FastTokenizer(small_bert())
    texts = random_texts(60, seed=1)
    everything = len(assert_same(tok, texts, 16).words._codes)
    monkeypatch.setattr(encode_wordpiece, "_MAX_CACHED_WORDS", 20)
    monkeypatch.setattr(encode_wordpiece, "_CHUNK", 7)  # and texts go in several chunks
    fast = assert_same(tok, texts, 16)
    assert len(fast.words._codes) < everything / 2
    assert_same(tok, texts, 16)


def test_other_tokenizers_take_the_rust_path():
    from tokenizers import pre_tokenizers

    assert (
        Tokenize(FastTokenizer(small_bert(pre_tokenizer=pre_tokenizers.Whitespace())), 16, word_cache=True).words
        is None
    )
    assert Tokenize(FastTokenizer(small_bert()), 2, word_cache=True).words is None  # no room beside [CLS] [SEP]
    assert Tokenize(FastTokenizer(small_bert()), 16, word_cache=False).words is None
    assert Tokenize(FastTokenizer(small_bert()), 16, word_cache=True).words is not None
    assert Tokenize(FastTokenizer(small_bert()), 16).words is None  # off by default (measured slower in the encoder)


def test_windows_start_small_and_cover_the_texts():
    assert list(windows(10, 4, 2)) == [(0, 4), (4, 8), (8, 10)]
    got = list(windows(100_000, 16384, 512))
    assert got[:4] == [(0, 2048), (2048, 6144), (6144, 14336), (14336, 30720)]
    assert got[-1][1] == 100_000 and all(a[1] == b[0] for a, b in itertools.pairwise(got))
    assert list(windows(0, 4, 2)) == []


@needs_shared
def test_word_cache_on_real_text_and_splade_tiny():
    docs, queries, _ = cranfield_slice(200)
    texts = [f"{d['title']} {d['text']}" for d in docs] + [q["text"] for q in queries] + random_texts(100, seed=2)
    tok, _ = tiny_transformers()
    for max_length in (8, 40, 256):
        assert_same(tok, texts, max_length)
    fast = Tokenize(tok, 40, word_cache=True)
    timer: dict[str, float] = {}
    batches = list(token_batches(texts, fast, 16, window=64, timer=timer))
    assert set(timer) == {"tokenize", "pad"}
    assert sum(len(b.rows) for b in batches) == sum(bool(t.strip()) for t in texts)


@needs_shared
def test_encoder_vectors_do_not_depend_on_the_word_cache():
    docs, _, _ = cranfield_slice(40)
    texts = [f"{d['title']} {d['text']}" for d in docs] + ["", "wing [MASK] é"]
    cached = tiny_encoder(doc_max_length=40, batch_size=8, word_cache=True)
    rust = tiny_encoder(doc_max_length=40, batch_size=8, word_cache=False)
    a, b = cached.encode_documents(texts), rust.encode_documents(texts)
    assert a.indptr.tolist() == b.indptr.tolist() and a.indices.tolist() == b.indices.tolist()
    np.testing.assert_array_equal(a.values, b.values)
    with pytest.raises(ValueError, match="prefetch must be a positive integer"):
        type(cached)("unused", loaded=(cached.tokenizer, cached.model), device="cpu", prefetch=0)


@needs_shared
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_encoder_word_cache_and_prefetch_do_not_change_vectors():
    """On the device: the word cache against the Rust tokenizer, a window ahead against 2
    batches ahead (several windows, the first ones small), float32."""
    from gpusparse.encode import SpladeEncoder

    from .shared_data import SPLADE_TINY

    docs, _, _ = cranfield_slice(150)
    texts = [f"{d['title']} {d['text']}" for d in docs] + ["", "wing [MASK] é"]
    settings = {"device": "cuda", "dtype": "float32", "batch_size": 8, "doc_max_length": 40, "sort_window": 64}
    new = SpladeEncoder(SPLADE_TINY, word_cache=True, **settings)
    old = SpladeEncoder(SPLADE_TINY, word_cache=False, prefetch=2, **settings)
    for top in (None, 20):
        a, b = new.encode_documents(texts, prune_top=top), old.encode_documents(texts, prune_top=top)
        np.testing.assert_allclose(a.to_scipy().toarray(), b.to_scipy().toarray(), rtol=1e-5, atol=1e-6)
    stats = EncodeStats()
    new.encode_documents(texts, stats=stats)
    assert stats.stages["launch"] > 0 and stats.stages["tokenize"] > 0 and stats.stages["wait_device"] >= 0
