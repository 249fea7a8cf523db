"""Loading the masked-language model of a SPLADE encoder: a local folder or a hub id (with the
offline cases handled before transformers would retry for a minute), the vocabulary of its
output layer, and a BERT-base-size model with random weights for timing.

``transformers`` is an optional dependency (``pip install 'gpusparse[encode]'``); it is
imported when a model is loaded, never when this module is.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from pathlib import Path
from typing import Any

import torch

from .errors import InputError
from .vocab import Vocabulary

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
_INSTALL_HINT = "the SPLADE encoder needs transformers: pip install 'gpusparse[encode]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return transformers


def _looks_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or "\\" in model or model.count("/") > 1


def check_model_folder(path: Path) -> None:
    """Refuse a local model folder that lacks a config, weights or a tokenizer."""
    if not path.is_dir():
        raise InputError("not a folder (expected a model folder or a hub id)", path=path)
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in _WEIGHT_FILES):
        missing.append("weights (model.safetensors or pytorch_model.bin)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json or vocab.txt)")
    if missing:
        raise InputError(f"model folder lacks {', '.join(missing)}", path=path)


def load_masked_lm(model: str | Path) -> tuple[Any, torch.nn.Module]:
    """Load ``(tokenizer, AutoModelForMaskedLM)`` from a local folder or a hub id.

    Raises:
        InputError: the folder is missing files, or loading fails (one line, with the cause).
    """
    transformers = _transformers()
    name = str(model)
    path = Path(name).expanduser()
    if path.exists():
        check_model_folder(path)
        source: str = str(path)
    elif isinstance(model, Path) or _looks_local(name):
        raise InputError("no such model folder", path=name)
    else:
        source = name
    # A hub id without a network: read the local cache only (transformers would retry for
    # about a minute before failing).
    offline = not path.exists() and (_env_true("HF_HUB_OFFLINE") or not hub_reachable())
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, local_files_only=offline)
        mlm = transformers.AutoModelForMaskedLM.from_pretrained(source, local_files_only=offline)
    except Exception as exc:  # transformers, safetensors and torch raise many kinds for a bad folder
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if path.exists():
            hint = ""
        elif offline:
            first = "the hub is offline (HF_HUB_OFFLINE=1) or unreachable, and the model is not in the local cache"
            hint = "; give the path of a downloaded model folder, or download it where there is a network"
        else:
            hint = " (without a network, set HF_HUB_OFFLINE=1 to use the local cache, or give a model folder's path)"
        raise InputError(f"cannot load a masked-LM model: {first}{hint}", path=name) from None
    return tokenizer, mlm


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub (``HF_ENDPOINT``, default huggingface.co) accepts a TCP
    connection within ``timeout`` seconds; ``True`` behind a proxy (not probed)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def model_vocabulary(tokenizer: Any, size: int) -> Vocabulary:
    """The vocabulary of the model's output layer: token of each logit index ``0 .. size-1``.

    BERT's WordPiece vocabulary (as used by SPLADE) comes back as :meth:`Vocabulary.bert`,
    so vectors from such models query indexes built from files written by other tools.
    """
    tokens = [f"[gpusparse:unnamed-{i}]" for i in range(size)]
    for tok, i in tokenizer.get_vocab().items():
        if 0 <= i < size:
            tokens[i] = tok
    bert = Vocabulary.bert()
    if size == len(bert) and tokens == bert.tokens():
        return bert
    return Vocabulary(tokens)


def random_bert_base(tokenizer_source: str | Path, *, seed: int = 0, **overrides: Any) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, BertForMaskedLM)``: BERT-base sizes (``transformers.BertConfig()`` defaults:
    12 layers, hidden 768, 12 heads) with random weights, and the tokenizer of a local folder.

    For timing a full-size SPLADE encoder where no checkpoint is available: the cost of a
    forward pass does not depend on the weights (its output's sparsity does). The output
    layer has the tokenizer's vocabulary size. ``overrides`` change config fields (the
    benchmark's dry run shrinks the model with them). Nothing is downloaded.
    """
    transformers = _transformers()
    path = Path(tokenizer_source).expanduser()
    if not path.is_dir() or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise InputError("no tokenizer here (tokenizer.json or vocab.txt)", path=path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    config = transformers.BertConfig(vocab_size=len(tokenizer), **overrides)
    torch.manual_seed(seed)
    return tokenizer, transformers.BertForMaskedLM(config)
