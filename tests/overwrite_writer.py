"""A child process for the overwrite crash-point test: it replaces an index and SIGKILLs
itself just before its ``crash_at``-th file-changing step (1-based)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import numpy as np

from gpusparse import Index
from gpusparse import storage as storage_mod

from .segment_writer import docs_for


def _counted(fn, state: dict):
    def step(*args, **kwargs):
        state["n"] += 1
        if state["n"] == state["crash_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)

    return step


def overwrite(path: str, ids: list[str], crash_at: int, exchange: bool) -> None:
    """``Index.build(docs_for(ids)).save(path, overwrite=True)``, killed at step ``crash_at``."""
    index = Index.build(docs_for(ids))
    state = {"n": 0, "crash_at": crash_at}
    if not exchange:  # a system without renameat2: the two-rename path
        storage_mod._exchange = lambda a, b: False
    storage_mod._exchange = getattr(storage_mod, "_exchange", lambda a, b: False)
    plain_open = Path.open

    def open_(self, mode="r", *args, **kwargs):
        if "w" in mode or "a" in mode:
            return _counted(plain_open, state)(self, mode, *args, **kwargs)
        return plain_open(self, mode, *args, **kwargs)

    # The steps that change files (a kill does not lose written data, so fsyncs are not
    # crash points of their own): folders made, files written, renames, swaps and removals.
    Path.open = open_  # ids.txt, vocab.txt, manifest.json
    Path.mkdir = _counted(Path.mkdir, state)
    Path.rename = _counted(Path.rename, state)
    np.save = _counted(np.save, state)
    shutil.rmtree = _counted(shutil.rmtree, state)
    storage_mod._exchange = _counted(storage_mod._exchange, state)
    index.save(path, overwrite=True)
