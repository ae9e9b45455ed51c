"""mkdocs hook: Sphinx roles in docstrings (:func:`jacobian`) become code, linked on the API page.

The docstrings stay readable in ``help()`` and plain text; mkdocstrings leaves the roles as text,
so this turns ``:func:<code>name</code>`` into a link to the object's heading when the page has one.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc):<code>~?([\w.]+)</code>")


def on_page_content(html: str, **kwargs: Any) -> str:
    def link(match: "re.Match[str]") -> str:
        name = match.group(1)
        short = name.split(".")[-1]
        anchor = name if name.startswith("jacmode.") else f"jacmode.{short}"
        if f'id="{anchor}"' in html:
            return f'<a href="#{anchor}"><code>{short}</code></a>'
        return f"<code>{short}</code>"

    return _ROLE.sub(link, html)
