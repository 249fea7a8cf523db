"""MkDocs hook: show the docstrings' Sphinx cross-reference roles as plain code.

The package's docstrings use Sphinx roles (``:func:`exact_scores```, ``:class:`~a.b.C```);
mkdocstrings renders the role name literally. This drops the role and, as Sphinx does
for a leading ``~``, keeps only the last component of the name.
"""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:func|class|meth|data|mod|attr|exc|obj):<code>(~?)([^<]*)</code>")


def _code(m: re.Match) -> str:
    name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
    return f"<code>{name}</code>"


def on_page_content(html: str, **kwargs: object) -> str:
    return ROLE.sub(_code, html)
