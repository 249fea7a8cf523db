"""Import an optional package, or say in one line which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``; an :class:`ImportError` naming ``pip install 'gpusparse[extra]'`` if absent.

    Args:
        module: the package to import (``"pyterrier"``).
        extra: the gpusparse extra that installs it (``"pyterrier"``).
        what: the feature that needs it, for the message (``"GPUSparseRetriever"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} needs the package {module!r}: pip install 'gpusparse[{extra}]'") from exc
