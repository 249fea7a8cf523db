"""The public index: build it, save and load it, search it.

:class:`Index` is the front end over :class:`~gpusparse.layout.postings.PostingLists` (the
paper's padded posting lists, the data that layouts, kernels and engines read): it adds
the builders, persistence (:mod:`gpusparse.storage`, :mod:`gpusparse.shards`) and search
(:mod:`gpusparse.search`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import engines
from .collection import SparseCollection, is_torch_sparse
from .config import engine_config, override_config
from .device_memory import available_memory, is_out_of_memory, out_of_memory_error, search_plan, surely_fits
from .engines.tiled.waves import search_bytes
from .footprint import IndexShape, predict
from .layout.derived import normalize_device, same_device
from .layout.postings import DEFAULT_BUILD_CHUNK, PostingLists, build_inverted_index
from .layout.resident import tiled_resident
from .layout.tiled import default_layout
from .quantize import quantize_collection, quantize_csr
from .queries import as_queries
from .search import Search, SearchResults, search
from .shards import is_sharded, load_sharded
from .storage import load_index, readable_folder, save_index
from .vocab import Vocabulary

PREDICTED = ("lists", "tiled", "scatter")  # the modes Index.memory() predicts


class Index(PostingLists):
    """An exact inverted index over sparse document vectors.

    Build with :meth:`build`, persist with :meth:`save` / :meth:`load`, query with
    :meth:`search`. The arrays are public (see the module docstring for the layout).
    With an encoder attached (:meth:`attach_encoder`), :meth:`search` and :meth:`retrieve`
    also take query texts.
    """

    encoder: Any = None
    """What turns query texts into vectors for :meth:`search` (see :meth:`attach_encoder`)."""

    def attach_encoder(self, encoder: Any) -> Index:
        """Let :meth:`search` and :meth:`retrieve` take texts, encoded by ``encoder``: a
        :class:`~gpusparse.encode.SpladeEncoder`, or any object with ``vocab`` and
        ``encode_queries(texts, ids)`` returning a :class:`SparseCollection` (its vocabulary
        is checked against the index's at search time). ``None`` detaches. Returns ``self``."""
        if encoder is not None and not callable(getattr(encoder, "encode_queries", None)):
            raise TypeError(f"an encoder needs an encode_queries(texts, ids) method; got {type(encoder).__name__}")
        self.encoder = encoder
        return self

    def doc_ids_of(self, results: SearchResults) -> list[list[str]]:
        """The document ids of ``results`` (from :meth:`search`), query by query: the string
        ids the collection gave, in rank order, padding left out. ``results.ids`` are row
        numbers; ``self.ids[row]`` is what this returns for each."""
        names = self.ids
        return [[names[d] for d in row if d >= 0] for row in results.ids.tolist()]

    def _encoded(self, queries: object) -> object:
        """``queries`` as vectors: texts (a string, a list of strings or ``{query id: text}``)
        go through the attached encoder; anything else is returned as it is."""
        if isinstance(queries, SparseCollection):  # first: the ABC checks below cost a search ~1 µs
            return queries
        if isinstance(queries, str):
            queries = [queries]
        if isinstance(queries, Mapping) and queries and all(isinstance(t, str) for t in queries.values()):
            ids, texts = list(queries), list(queries.values())
        elif isinstance(queries, Sequence) and queries and all(isinstance(t, str) for t in queries):
            ids, texts = [str(i) for i in range(len(queries))], list(queries)
        else:
            return queries
        if self.encoder is None:
            raise TypeError(
                "these are query texts: attach an encoder first, e.g. "
                "index.attach_encoder(gpusparse.encode.SpladeEncoder(MODEL))"
            )
        return self.encoder.encode_queries(texts, ids)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_postings(cls, lists: PostingLists) -> Index:
        """``lists`` as an :class:`Index`: the same arrays and derived state, not copied."""
        if isinstance(lists, cls):
            return lists
        out = cls.__new__(cls)
        out.__dict__.update(lists.__dict__)
        return out

    @classmethod
    def build(
        cls,
        collection: SparseCollection,
        *,
        device: str | torch.device = "cpu",
        progress: bool = False,
        chunk_postings: int = DEFAULT_BUILD_CHUNK,
        quantize: int | None = None,
    ) -> Index:
        """Index ``collection`` (row ``i`` becomes internal document ``i``).

        Also accepts a scipy sparse matrix or a torch sparse tensor, COO or CSR, such as
        sentence-transformers' ``SparseEncoder`` returns (columns are term ids). ``quantize=8`` stores
        8-bit impacts (see :mod:`gpusparse.quantize`): weights become ``level · step``
        (weights below half a step are dropped) and queries are quantized the same way at
        search time; the result is exact for the quantized vectors.
        """
        if is_torch_sparse(collection):
            collection = SparseCollection.from_torch_sparse(collection)  # type: ignore[arg-type]
        elif not isinstance(collection, SparseCollection):
            collection = SparseCollection.from_scipy(collection)
        quantization = None
        if quantize is not None:
            collection, report = quantize_collection(collection, quantize)
            quantization = report.quantization
        arrays = build_inverted_index(collection, device=device, progress=progress, chunk_postings=chunk_postings)
        n_empty = int(np.count_nonzero(collection.row_lengths == 0))
        return cls(
            arrays, ids=list(collection.ids), vocab=collection.vocab, n_empty_docs=n_empty, quantization=quantization
        )

    @classmethod
    def from_csr(
        cls,
        indptr: torch.Tensor | np.ndarray,
        indices: torch.Tensor | np.ndarray,
        values: torch.Tensor | np.ndarray,
        vocab: Vocabulary,
        *,
        ids: list[str] | None = None,
        device: str | torch.device = "cpu",
        chunk_postings: int = DEFAULT_BUILD_CHUNK,
        quantize: int | None = None,
    ) -> Index:
        """Index canonical CSR arrays directly (e.g. a collection generated on the GPU).

        Rows must have sorted, unique term ids ``< len(vocab)`` and positive weights; they
        are not copied into a :class:`SparseCollection` first. Without ``ids`` documents are
        named ``"0"``, ``"1"``, ... ``quantize``: as in :meth:`build`.
        """
        n = int(indptr.shape[0]) - 1
        quantization = None
        if quantize is not None:
            (indptr, indices, values), report = quantize_csr(
                torch.as_tensor(indptr), torch.as_tensor(indices), torch.as_tensor(values), quantize
            )
            quantization = report.quantization
        arrays = build_inverted_index(
            (indptr, indices, values, len(vocab)), device=device, chunk_postings=chunk_postings
        )
        return cls(arrays, ids=ids, vocab=vocab, n_docs=n, quantization=quantization)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        mmap: bool = True,
        verify: bool = True,
    ) -> Index:
        """Load an index folder written by :meth:`save`.

        Args:
            path: the folder.
            device: where to search by default. The arrays go there too, except for a CUDA
                device while :attr:`~gpusparse.config.EngineConfig.resident` is ``"tiled"``
                (not the default): they stay on the host and the tiled engine builds only its
                layout on the GPU (:meth:`search`); or while
                :attr:`~gpusparse.config.EngineConfig.device_memory_limit` is set: they stay on
                the host until the first search has decided what fits.
            mmap: map the files instead of reading them (CPU only; they are copied to a
                GPU anyway).
            verify: check every file's SHA-256 against the manifest (reads all bytes).

        A sharded folder (``gpusparse index --shards N``) loads whole: its shards joined into
        one index, the same as one build of all their documents
        (:func:`gpusparse.shards.load_sharded` loads some shards only).

        Raises:
            IndexFormatError: missing, truncated, corrupted, or written by a newer version.
        """
        path = readable_folder(Path(path))  # an overwrite killed midway left the old index beside it
        device = torch.device(device)
        # The tiled engine keeps only its layout on a GPU: the lists stay on the host
        # (EngineConfig.resident), and searches go to ``device`` by default.
        config = engine_config()
        on_host = config.resident == "tiled" or config.device_memory_limit is not None
        home = torch.device("cpu") if device.type == "cuda" and on_host else device
        if is_sharded(path):
            index = cls.from_postings(load_sharded(path, device=home, mmap=mmap, verify=verify)[0])
        else:
            index = cls.from_postings(load_index(path, device=home, mmap=mmap, verify=verify))
        if home != device:
            index.search_device = device
        return index

    def save(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the index to folder ``path`` atomically (temporary folder, then rename).

        Refuses an existing ``path`` unless ``overwrite``; even then a failure leaves the
        old index in place.
        """
        save_index(self, path, overwrite=overwrite)

    def search(
        self,
        queries: SparseCollection | object,
        k: int = 1000,
        *,
        batch_size: int | None = None,
        device: str | torch.device | None = None,
        kernel: str = "auto",
        memory_budget: int | None = None,
        progress: bool = False,
        device_memory_limit: int | None = None,
    ) -> SearchResults:
        """Exact top-``k`` documents for each query.

        Args:
            queries: a :class:`SparseCollection`, a scipy sparse matrix or a torch sparse
                tensor, COO or CSR (columns are term ids), or a list of ``{token: weight}``
                dicts; with an encoder attached (:meth:`attach_encoder`) also a text, a list of
                texts or ``{query id: text}``.
            k: results per query (``k > n_docs`` is allowed and costs no more than
                ``k = n_docs``; see below for the width of the results).
            batch_size: queries scored together (default: chosen from the memory budget).
            device: where to compute (default: :attr:`search_device` if set, else where the
                index is). On a CUDA device the tiled engine, while
                :attr:`~gpusparse.config.EngineConfig.resident` is ``"tiled"`` (not the default),
                holds only its tiled layout there: an index on that GPU first moves its
                lists to the host (page-locked; :attr:`search_device` then remembers the
                GPU), and a host index's lists are never copied over.
            kernel: ``"auto"`` or a kernel name (see :func:`gpusparse.engines.names`).
            memory_budget: bytes of temporaries allowed (default 1 GiB).
            progress: show a progress bar over query batches.
            device_memory_limit: bytes of GPU memory the search may take, over every
                allocator (default: :attr:`~gpusparse.config.EngineConfig.device_memory_limit`;
                ``None``: no limit). Before the first search on a GPU the need is predicted
                (:mod:`gpusparse.footprint`): a faster mode that does not fit gives way to one
                that does, with a :class:`~gpusparse.device_memory.DeviceMemoryWarning`, or the
                search is refused; then the limit is enforced on PyTorch and CuPy
                (:mod:`gpusparse.device_memory`). Without a limit, an index whose default
                layouts might not fit the GPU is planned the same way within what the GPU has
                available (nothing enforced).

        Without a device memory limit, what the arguments resolve to (their checks, the engine,
        the statistics queries are checked against) is kept per arguments and settings
        (:class:`~gpusparse.search.Search`): repeated searches of batches spend their host time
        on the batch; the queries are checked every time. On a GPU, a call of one batch of the
        shape the last one had replays that shape's CUDA graph directly
        (:attr:`~gpusparse.engines.base.BatchResult.repeat`).

        Returns:
            :class:`~gpusparse.search.SearchResults` ``(scores, ids)``, both ``[n_queries, w]``
            CPU tensors: float32 scores, descending, and int64 internal document numbers,
            ties broken by the lower document number. Only documents sharing a term with
            the query (score > 0) are results; the remaining slots hold id ``-1`` and
            score ``0``. The width ``w`` is ``k``, padded beyond ``n_docs``, as long as
            ``k <= max(n_docs, 10_000)`` (:data:`~gpusparse.search.MAX_PADDED_K`); a larger
            ``k`` gets ``w = n_docs`` (every document has its slot; padding to ``k = 10**11``
            would take terabytes). See :func:`~gpusparse.search.result_width`. The ids are
            **row numbers**, not the collection's document ids: :meth:`doc_ids_of` gives those
            (or :meth:`retrieve`). ``results.engine`` names the engine that ran.

        Raises:
            InputError: a query in another vocabulary, or whose weights are so large that a
                score could overflow float32 (``Σ_t w[t] · max_t`` over the index's largest
                weight of each term, in float64, reaches float32's largest value). The
                message names the query's id.
            DeviceMemoryError: the search does not fit ``device_memory_limit`` in any mode
                (refused before allocating), or PyTorch or CuPy ran out of GPU memory (with the
                figures and what to change).
        """
        config = engine_config()
        # the arguments resolved before (and the settings then in force): straight to the batch
        try:
            key = (id(self), type(k), k, batch_size, device, kernel, memory_budget, device_memory_limit,
                   self.search_device)  # fmt: skip
            kept = self.derived.searches.get(key)
        except TypeError:  # an argument that cannot be a key: resolved below, not kept
            key, kept = None, None
        if kept is not None and kept[0] is config:
            try:
                return kept[1](self._encoded(queries), progress=progress)
            except Exception as exc:
                if is_out_of_memory(exc):
                    raise out_of_memory_error(kept[1].device, batch_size=batch_size, k=k) from exc
                raise
        dev = torch.device(device) if device is not None else (self.search_device or self.device)
        limit = config.device_memory_limit if device_memory_limit is None else device_memory_limit
        plan, implicit = None, False
        cuda = dev.type == "cuda"
        if cuda and limit is None and config.resident == "lists":
            # No limit set: when the default layouts may not fit the device, plan within what it
            # has (once per device), so that a search that fits another way takes it and says so
            # instead of running out of memory.
            known = self.__dict__.setdefault("_available", {})
            name = str(dev)
            if name not in known:
                avail = available_memory(dev)
                lists_bytes = sum(t.numel() * t.element_size() for t in self.arrays().values())
                known[name] = None if surely_fits(lists_bytes, avail) else avail
            limit = known[name]
            implicit = limit is not None
        if cuda and limit is not None:
            plan = search_plan(self, dev, limit, kernel=kernel, batch_size=batch_size, k=k, memory_budget=memory_budget,
                               implicit=implicit)  # fmt: skip
            kernel = plan.kernel if plan.chosen.mode == "scatter" else kernel
        scope = override_config(resident=plan.chosen.mode) if plan and plan.chosen.mode in ("lists", "tiled") else None
        try:
            with scope or contextlib.nullcontext():
                target: Index | object = self
                resident = cuda and engine_config().resident == "tiled"
                if resident and engines.choose(kernel, dev).name == "tiled":
                    if self.device.type == "cuda":
                        self.release_to_host()
                    target = tiled_resident(self, dev)
                if target is self and plan is None and key is not None:
                    # resolved once and kept, where nothing of it depends on the device's memory
                    # (no limit) and the lists are searched where they are (no copy to keep up)
                    resolved = Search(self, k, batch_size=batch_size, device=dev, kernel=kernel,
                                      memory_budget=memory_budget)  # fmt: skip
                    # (a bare "cuda" names whichever device is current at each call: not kept)
                    named = resolved.device.type != "cuda" or resolved.device.index is not None
                    if named and same_device(resolved.device, self.device):
                        self.derived.keep_search(key, config, resolved)
                    return resolved(self._encoded(queries), progress=progress)
                return search(
                    target,  # type: ignore[arg-type]
                    self._encoded(queries),
                    k,
                    batch_size=batch_size,
                    device=dev,
                    kernel=kernel,
                    memory_budget=memory_budget,
                    progress=progress,
                )
        except Exception as exc:
            if is_out_of_memory(exc):
                raise out_of_memory_error(dev, batch_size=batch_size, k=k, decision=plan) from exc
            raise

    # -- residency ----------------------------------------------------------------------

    search_device: torch.device | None = None  # where searches go by default, if not self.device

    def release_to_host(self) -> None:
        """Move the arrays to page-locked host memory, dropping what was built on the device
        (layouts, forward copy, graphs); later searches still default to that device
        (:attr:`search_device`). Host statistics are kept."""
        if self.device.type == "cpu":
            return
        was = normalize_device(self.device)
        pin = torch.cuda.is_available()
        for name, array in self.arrays().items():
            host = array.cpu()
            setattr(self, name, host.pin_memory() if pin else host)
        self.derived.reset()
        self.search_device = was

    def memory(self, batch_size: int = 256, k: int = 1000, *, n_sm: int = 132) -> dict:
        """Bytes of each component held for searching, by device, and a search's peak.

        Returns ``{"components": [{"name", "device", "bytes"}...], "by_device": {device: bytes},
        "search_bytes": ..., "peak": {device: bytes}, "predicted": {mode: ...}}``: the padded lists where they are,
        what was built from them (forward copy, tiled layouts, the copy searched on another
        device, the tiled engine's views of a host index), the tiled engine's temporaries for a
        batch of ``batch_size`` at ``k`` (:func:`~gpusparse.engines.tiled.waves.search_bytes`,
        ``n_sm`` multiprocessors: 132 on an H100) and, per device holding a tiled layout,
        its resident bytes plus those temporaries. Only what was built so far is counted:
        search once first (the layouts are built on the first search). ``predicted`` needs
        nothing built: per way of searching on a GPU (``"lists"``, ``"tiled"``, ``"scatter"``:
        :func:`gpusparse.footprint.predict` with the settings in force) the bytes of each
        component, the temporaries and the peak a search of ``batch_size`` at ``k`` will take.
        """
        out: list[dict] = []

        def add(name: str, device: torch.device, tensors) -> None:
            n = sum(t.numel() * t.element_size() for t in tensors if t is not None)
            if n:
                out.append({"name": name, "device": str(normalize_device(device)), "bytes": n})

        def derived_parts(prefix: str, lists) -> None:
            d = lists.derived
            add(f"{prefix}forward copy", lists.device, d.forward or ())
            fwd = {t.data_ptr() for t in d.forward or ()}
            for key, layout in d.layouts.items():
                add(f"{prefix}tiled layout {key}", lists.device, layout.arrays(forward=False))
                extra = [t for t in layout.forward or () if t.data_ptr() not in fwd]
                add(f"{prefix}forward copy", lists.device, extra)

        add("padded lists", self.device, self.arrays().values())
        derived_parts("", self)
        if self.derived.copy is not None:
            copy = self.derived.copy[1]
            add("padded lists (copy)", copy.device, copy.arrays().values())
            derived_parts("copy: ", copy)
        for view in self.derived.views.values():
            derived_parts("", view)
        by_device: dict[str, int] = {}
        for c in out:
            by_device[c["device"]] = by_device.get(c["device"], 0) + c["bytes"]
        # the tiles of a layout built so far, else those the engine would build
        built = [key[0] for d in (self.derived, *(v.derived for v in self.derived.views.values())) for key in d.layouts]
        bits = built[0] if built else default_layout(self, engine_config().fixed_point)[0]
        n_tiles = max(1, -(-self.n_docs >> bits))
        temp = search_bytes(n_tiles, batch_size, k, n_sm, levels=self.quantization is not None)
        peak = {dev: n + temp for dev, n in by_device.items() if dev != "cpu"}
        shape = self.__dict__.get("_memory_shape")
        if shape is None:
            shape = self.__dict__["_memory_shape"] = IndexShape(self)
        predicted = {m: predict(shape, m, batch_size=batch_size, k=k, n_sm=n_sm).as_dict() for m in PREDICTED}
        return {"components": out, "by_device": by_device, "search_bytes": temp, "peak": peak, "predicted": predicted}

    def retrieve(
        self, queries: SparseCollection | object, k: int = 1000, **kwargs: object
    ) -> dict[str, list[tuple[str, float]]]:
        """Like :meth:`search`, but ``{query id: [(document id, score), ...]}`` with string ids
        (texts in a list are named ``"0"``, ``"1"``, ...; pass ``{query id: text}`` to name them)."""
        queries = as_queries(self._encoded(queries), self.vocab)
        res = self.search(queries, k, **kwargs)  # type: ignore[arg-type]
        out: dict[str, list[tuple[str, float]]] = {}
        for qi, qid in enumerate(queries.ids):
            row = [
                (self.ids[d], float(s))
                for d, s in zip(res.ids[qi].tolist(), res.scores[qi].tolist(), strict=True)
                if d >= 0
            ]
            out[qid] = row
        return out
