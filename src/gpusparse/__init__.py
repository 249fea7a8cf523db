"""GPUSparse: exact batched retrieval over learned sparse vectors on the GPU."""

from __future__ import annotations

from ._version import __version__
from .collection import SparseCollection
from .errors import GPUSparseError, IndexFormatError, InputError
from .formats import read_vectors
from .index import Index
from .search import SearchResults
from .trec import read_qrels, read_trec_run, write_trec_run
from .vector_writers import write_jsonl, write_seismic_bin
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
