"""What the server searches: an index folder of any kind, behind the one interface the worker uses.

The worker and the routes read ``vocab``, ``n_docs``, ``ids`` (string id by result
number), ``device`` and ``search(queries, k, **kwargs) -> (scores, numbers)``. A plain or
sharded folder loads as an :class:`~gpusparse.index.Index`, which has them; a segmented
folder (updated by ``gpusparse add``/``delete``/``compact``) loads as a
:class:`~gpusparse.segments.SegmentedIndex` snapshot, wrapped by :class:`ServedSegments`
so that its results are global numbers and its ids those numbers' string ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import engines
from ..index import Index
from ..search import SearchResults
from ..segment_files import is_segmented
from ..segments import SegmentedIndex


class ServedSegments:
    """A :class:`SegmentedIndex` snapshot as the server searches it (see the module)."""

    def __init__(self, index: SegmentedIndex) -> None:
        self.index = index
        self.vocab = index.vocab
        self.n_docs = index.n_docs  # live documents
        self.ids = index.position_ids  # by global number, as search numbers its results
        self.device = index._opts.get("device", torch.device("cpu"))

    def search(self, queries: object, k: int, **kwargs: Any) -> SearchResults:
        """:meth:`SegmentedIndex.search`, as ``(scores, global numbers)``; ``engine`` is the one
        each segment's search chooses (:func:`gpusparse.engines.choose` of ``kernel`` on the
        snapshot's device)."""
        res = self.index.search(queries, k, **kwargs)
        engine = engines.choose(kwargs.get("kernel", "auto"), self.device).name
        return SearchResults(res.scores, res.positions, engine=engine)


def served(index: Any) -> Any:
    """``index`` as the server searches it: a :class:`SegmentedIndex` wrapped, anything else as is."""
    return ServedSegments(index) if isinstance(index, SegmentedIndex) else index


def load_served(path: str | Path, *, device: str | torch.device = "cpu", verify: bool = True) -> Any:
    """The index folder at ``path`` (plain, sharded or segmented) loaded for serving on ``device``."""
    if is_segmented(Path(path)):
        return ServedSegments(SegmentedIndex.load(path, device=device, verify=verify))
    return Index.load(path, device=device, verify=verify)
