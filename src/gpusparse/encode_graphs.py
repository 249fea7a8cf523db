"""CUDA graphs for the SPLADE encoder's forward: one replay a batch instead of hundreds of launches.

A BERT-base forward in eager PyTorch is several hundred kernel launches (and autocast's weight
casts); on a fast GPU the host takes about as long to launch them as the device takes to run
them, so the device waits. Here the forward (model, SPLADE pooling) is captured once per
*bucket* as a CUDA graph and replayed for every batch of that bucket: one launch a batch.

Buckets. A graph has fixed shapes, so batches are padded: to the encoder's batch size (the last,
smaller batch gets extra rows, whose results are dropped) and to a bucket length
(:func:`bucket_length`: multiples of 8 up to 128 tokens, of 16 up to 256, of 32 above, and never
past the encoder's maximum length). That is at most 32 buckets up to 512 tokens and pads ~5 %
of the tokens on 60-word passages (against ~0.5 % for batches padded to their longest text):
coarser steps pad more, finer ones capture more graphs. The tokenising thread pads the batches
(:func:`~gpusparse.encode_tokens.token_batches`' ``pad_to``); padding changes a vector only by
float rounding, as a different batch shape does.

What a graph runs: the token ids and attention mask are copied into static buffers shared by
all graphs (replays run one after the other on one stream); the model gets a 4-D mask, which
transformers (5.x) passes to the attention as it is, instead of the 2-D mask whose preparation
asks the device whether there is any padding (a host sync, which a capture cannot contain);
max pooling is one ``amax`` over the positions, because a hook on the output layer gives every
padding position the features of the row's first token (``[CLS]``), so padding repeats a real
token's logits instead of being masked (sum pooling masks, as without graphs); the vectors
land in a static output that the caller copies before the next replay. The graphs share one
memory pool, so their temporaries take about one forward's worth of memory.

Safety. The warm-up before a capture runs with PyTorch's sync debug mode at ``"error"``, so a
model that asks the device anything fails there, before the capture. Each capture is checked
before use: the graph is replayed on the batch with rows of lengths spread over ``1 .. bucket``
and compared with the eager forward (2-D mask) on the same input. If any of this raises (a host
sync in the model, an attention implementation other than ``sdpa`` or ``eager``, another
transformers version's mask handling) or the check fails, the encoder warns once, saying why,
and runs eagerly from then on. Captures are lazy (a bucket's first batch), at most
``max_graphs``; batches of other lengths run eagerly.

On the CPU the same padding and model call run without capture (``capture=False``), so the
logic above is tested without a GPU.
"""

from __future__ import annotations

import threading
import time
import warnings
from contextlib import nullcontext
from typing import Any

import torch

from .encode_device import Forward, Pooling, splade_pool
from .streams import capture_stream, collection_held

DEFAULT_MAX_GRAPHS = 32  # every bucket up to 512 tokens
CHECK_TOLERANCE = 0.05  # of the largest weight: a wrong mask changes vectors far more


class GraphsUnavailable(Exception):
    """The forward cannot be captured (or its capture does not match the eager forward)."""


def bucket_length(longest: int, max_length: int) -> int:
    """The padded length of a batch whose longest text has ``longest`` tokens: rounded up to a
    multiple of 8 (``<= 128``), 16 (``<= 256``) or 32, and at most ``max(max_length, longest)``."""
    step = 8 if longest <= 128 else 16 if longest <= 256 else 32
    return min(-(-longest // step) * step, max(max_length, longest))


def capturable_mask(model: torch.nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """``[b, L]`` 0/1 attention mask → the ``[b, 1, 1, L]`` mask that ``model``'s attention
    takes as it is: boolean for ``sdpa``, additive (0 / the dtype's minimum) for ``eager``,
    as transformers would prepare it, but without asking the device anything."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    keep = mask[:, None, None, :].bool()
    if impl == "sdpa":
        return keep
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill_(~keep, torch.finfo(dtype).min)
    raise GraphsUnavailable(f"attention implementation {impl!r} (graphs take 'sdpa' or 'eager')")


class BucketedForward:
    """The encoder's forward on batches padded to ``(batch_size, bucket length)``: with
    ``capture``, one CUDA graph per bucket; without, the same computation eagerly.

    Called as a :data:`~gpusparse.encode_device.Forward`: ``(ids, mask, shortest)`` of a batch
    already padded to a bucket length → its ``[b, V]`` float32 vectors. ``eager`` is the
    encoder's own forward: the reference of the checks and the fallback.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pooling: Pooling,
        autocast_dtype: torch.dtype | None,
        batch_size: int,
        device: torch.device,
        *,
        eager: Forward,
        capture: bool,
        pad_id: int = 0,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model, self.pooling, self.autocast_dtype = model, pooling, autocast_dtype
        self.batch_size, self.device, self.eager, self.capture = batch_size, device, eager, capture
        self.pad_id, self.max_graphs = pad_id, max_graphs
        self.capacity = int(getattr(getattr(model, "config", None), "max_position_embeddings", None) or 512)
        self.graphs: dict[int, Any] = {}  # bucket length -> torch.cuda.CUDAGraph
        self.failed: str | None = None
        self.capture_seconds = 0.0
        self.eager_batches = 0  # run without a graph: more buckets than max_graphs, or longer than capacity
        self.hook_calls = 0
        self._pad: torch.Tensor | None = None
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._pool: Any = None
        self._lock = threading.Lock()  # the static buffers are shared: one batch at a time, whatever the thread
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self._hook = (
            head.register_forward_pre_hook(self._padding_as_first)
            if pooling == "max" and isinstance(head, torch.nn.Module)
            else None
        )

    def summary(self) -> dict[str, Any]:
        """Graphs captured, seconds spent capturing (checks included), batches run eagerly, and
        why graphs are off (``None`` while they are on)."""
        return {
            "graphs": len(self.graphs),
            "buckets": sorted(self.graphs),
            "capture_s": round(self.capture_seconds, 3),
            "eager_batches": self.eager_batches,
            "failed": self.failed,
        }

    def close(self) -> None:
        """Drop the graphs and the output-layer hook."""
        self.graphs.clear()
        self._buffers = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, shortest: int) -> torch.Tensor:
        b, length = ids.shape
        if self.failed is not None:
            return self.eager(ids, mask, shortest)
        if b > self.batch_size or length > self.capacity:
            self.eager_batches += 1
            return self.eager(ids, mask, shortest)
        if not self.capture:
            full_ids, full_mask = self._rows(ids, mask)
            try:
                return self._run(full_ids, full_mask)[:b].clone()
            except Exception as exc:  # the same failures a capture would meet, on the CPU
                self._fail(exc)
                return self.eager(ids, mask, shortest)
        with self._lock:
            graph = self.graphs.get(length)
            if graph is None and len(self.graphs) < self.max_graphs and self.failed is None:
                try:
                    graph = self._capture(ids, mask)
                except Exception as exc:  # whatever the model does under capture: eager from now on, loudly
                    self._fail(exc)
            if graph is not None:
                ids_v, mask_v, out = self._views(length)
                self._fill(ids_v, mask_v, ids, mask)
                graph.replay()
                return out[:b].clone()
        if self.failed is None:
            self.eager_batches += 1  # more buckets than max_graphs
        return self.eager(ids, mask, shortest)

    # -- internals ----------------------------------------------------------------------

    def _rows(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids``, ``mask`` with rows up to the batch size (pad tokens, a one-token mask)."""
        extra = self.batch_size - ids.shape[0]
        if extra == 0:
            return ids, mask
        pad_ids = torch.full((extra, ids.shape[1]), self.pad_id, dtype=ids.dtype, device=ids.device)
        pad_mask = torch.zeros((extra, ids.shape[1]), dtype=mask.dtype, device=mask.device)
        pad_mask[:, 0] = 1
        return torch.cat([ids, pad_ids]), torch.cat([mask, pad_mask])

    def _run(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The captured computation: ``[B, L]`` ids and mask → ``[B, V]`` float32 vectors."""
        ctx = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)
            if self.autocast_dtype is not None
            else nullcontext()
        )
        calls = self.hook_calls
        self._pad = (mask == 0) if self._hook is not None else None
        try:
            with ctx:
                logits = self.model(input_ids=ids, attention_mask=capturable_mask(self.model, mask)).logits
        finally:
            self._pad = None
        if self.pooling == "max" and self.hook_calls == calls + 1:
            # Padding positions carry their row's first token's logits: the plain maximum is the masked one.
            return torch.log1p_(torch.relu_(logits.amax(dim=1).float()))
        return splade_pool(logits, mask, self.pooling)

    def _padding_as_first(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook of the output layer: padding positions get position 0's features."""
        pad = self._pad
        if pad is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if x.dim() != 3 or tuple(x.shape[:2]) != tuple(pad.shape):
            return None
        self.hook_calls += 1
        return (torch.where(pad[..., None], x[:, :1], x), *args[1:])

    def _views(self, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static ids, mask (``[B, length]`` views of buffers shared by every graph) and output."""
        if self._buffers is None:
            n = self.batch_size * self.capacity
            ids = torch.full((n,), self.pad_id, dtype=torch.long, device=self.device)
            mask = torch.ones((n,), dtype=torch.long, device=self.device)
            vocab = int(self.model.config.vocab_size)  # type: ignore[union-attr]
            out = torch.zeros((self.batch_size, vocab), dtype=torch.float32, device=self.device)
            self._buffers = (ids, mask, out)
        ids, mask, out = self._buffers
        n = self.batch_size * length
        return ids[:n].view(self.batch_size, length), mask[:n].view(self.batch_size, length), out

    @staticmethod
    def _fill(ids_v: torch.Tensor, mask_v: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
        b = ids.shape[0]
        ids_v[:b].copy_(ids)
        mask_v[:b].copy_(mask)
        if b < ids_v.shape[0]:  # rows past the batch: whatever ids were there, all of them attended
            mask_v[b:].fill_(1)

    def _capture(self, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        t0 = time.perf_counter()
        length = ids.shape[1]
        ids_v, mask_v, out = self._views(length)
        self._fill(ids_v, mask_v, ids, mask)
        with torch.cuda.device(self.device), collection_held():  # a collection mid-capture may void it
            current = torch.cuda.current_stream()
            try:
                side = capture_stream(self.device)
                side.wait_stream(current)
                # Warm up (lazy initialisations) off the capturing stream, with PyTorch refusing any
                # host sync: a model that syncs fails here, before a capture that would leave the
                # allocator's capture state behind when it fails.
                debug = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with torch.cuda.stream(side):
                        out.copy_(self._run(ids_v, mask_v))
                finally:
                    torch.cuda.set_sync_debug_mode(debug)
                current.wait_stream(side)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # thread_local: the tokenising thread allocates pinned memory meanwhile, which is
                # no part of the capture.
                with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                    out.copy_(self._run(ids_v, mask_v))
            finally:
                torch.cuda.set_stream(current)  # a failed capture_end leaves its stream current
            self._check(graph, ids_v, mask_v, out)
        self._fill(ids_v, mask_v, ids, mask)
        self.graphs[length] = graph
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def _check(self, graph: Any, ids_v: torch.Tensor, mask_v: torch.Tensor, out: torch.Tensor) -> None:
        """Replay ``graph`` on rows of lengths ``1 .. L`` and compare with the eager forward."""
        rows, length = mask_v.shape
        lengths = torch.linspace(1, length, rows, device=self.device).round().long()
        probe = (torch.arange(length, device=self.device)[None, :] < lengths[:, None]).long()
        mask_v.copy_(probe)
        graph.replay()
        got = out.clone()
        want = self.eager(ids_v.clone(), probe, 1)
        err = float((got - want).abs().max())
        scale = float(want.abs().max())
        if not bool(torch.isfinite(got).all()) or err > CHECK_TOLERANCE * scale + 1e-6:
            raise GraphsUnavailable(
                f"the captured forward differs from the eager one by {err:.3g} (largest weight {scale:.3g}) "
                f"on a batch of {rows} x {length} tokens"
            )

    def _fail(self, exc: BaseException) -> None:
        while exc.__context__ is not None:  # a failed capture's own error hides the first one: report that
            exc = exc.__context__
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.failed = f"{type(exc).__name__}: {why}" if why else type(exc).__name__
        self.graphs.clear()
        warnings.warn(
            f"CUDA graphs are off for this encoder ({self.failed}); the model runs eagerly, which is slower on a "
            "GPU. Pass cuda_graphs=False (--cuda-graphs off) to choose that without this warning.",
            RuntimeWarning,
            stacklevel=4,
        )
