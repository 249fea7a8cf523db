"""GPUSparse: exact batched retrieval over learned sparse vectors on the GPU."""

from __future__ import annotations

from ._version import __version__
from .collection import SparseCollection
from .errors import GPUSparseError, IndexFormatError, InputError
from .formats import read_qrels, read_trec_run, read_vectors, write_jsonl, write_seismic_bin, write_trec_run
from .index import Index
from .search import SearchResults
from .vocab import Vocabulary

__all__ = [
    "GPUSparseError",
    "Index",
    "IndexFormatError",
    "InputError",
    "SearchResults",
    "SparseCollection",
    "Vocabulary",
    "__version__",
    "read_qrels",
    "read_trec_run",
    "read_vectors",
    "write_jsonl",
    "write_seismic_bin",
    "write_trec_run",
]
