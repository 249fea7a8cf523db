"""An index searched on a GPU whose padded lists stay on the host: :class:`TiledResident`.

The tiled engine needs on the device only its tiled layout (:mod:`.tiled`) and the
per-term statistics it reads on the host; the paper's padded lists (8 bytes a posting plus
padding) and the document-major copy (8 more) are left off the device. A
:class:`TiledResident` is a view of an index for that: its arrays are the host index's own
tensors (no copy), while :attr:`~TiledResident.device` names the device searched, where
its derived layouts are built (:func:`~gpusparse.layout.tiled.build_tiled` copies the lists
over in slabs). The few rows the engine searches again with the reference path read the
lists on the host (:attr:`TiledResident.host`).
"""

from __future__ import annotations

import torch

from .derived import normalize_device
from .postings import PostingLists


class TiledResident(PostingLists):
    """``host`` (an index on the host) searched on ``device`` from the tiled layout alone."""

    def __init__(self, host: PostingLists, device: torch.device) -> None:
        if host.doc_ids.device.type != "cpu":
            raise ValueError("a TiledResident view needs an index whose arrays are on the host")
        PostingLists.__init__(
            self,
            host.arrays(),
            ids=host._ids,
            vocab=host.vocab,
            n_docs=host.n_docs,
            n_empty_docs=host._n_empty_docs,
            quantization=host.quantization,
        )
        self.derived.share_host_statistics(host.derived)
        self.host = host
        self._device = normalize_device(torch.device(device))

    @property
    def device(self) -> torch.device:
        """The device searched (the arrays themselves stay on the host)."""
        return self._device

    @property
    def lists_resident(self) -> bool:
        """Whether the padded lists are on :attr:`device` (never, for this view)."""
        return False


def tiled_resident(index: PostingLists, device: str | torch.device) -> TiledResident:
    """The view of host index ``index`` searched on ``device``, made once per (index, device)
    and kept in ``index.derived`` (its layouts are built there on the first search)."""
    device = normalize_device(torch.device(device))
    kept = index.derived.views.get(device)
    if kept is None:
        kept = index.derived.views[device] = TiledResident(index, device)
    return kept
