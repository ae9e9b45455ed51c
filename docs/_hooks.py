"""Docs build helpers: a mkdocs hook and a griffe extension, so that docstrings written for
``help()`` and doctest (Google style, Sphinx roles, ``Example:`` sections) render well.

* ``on_page_content`` (mkdocs hook): ``:func:`jacobian``` becomes code, linked to the object's
  heading when the page has one (mkdocstrings leaves Sphinx roles as text).
* ``ExampleSections`` (griffe extension): a section titled ``Example:`` is read as griffe's
  ``Examples:`` section, so its doctest lines render as code rather than nested quotes; and a
  lone ``*`` in prose (shapes such as (B, *out), counts such as B*D) stays an asterisk instead of
  starting emphasis.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc):<code>~?([\w.]+)</code>")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)
_CODE_SPAN = re.compile(r"(`[^`]*`)")
_LONE_STAR = re.compile(r"(?<![*\\])\*(?!\*)")


def _escape_stars(text: str) -> str:
    lines = []
    for line in text.splitlines():
        body = line.lstrip()
        if not body.startswith((">>>", "...")):  # doctest lines are code
            lead = line[: len(line) - len(body) + body.startswith("*")]  # a bullet or *args stays
            parts = _CODE_SPAN.split(line[len(lead):])
            line = lead + "".join(p if i % 2 else _LONE_STAR.sub(r"\\*", p) for i, p in enumerate(parts))
        lines.append(line)
    return "\n".join(lines)


def on_page_content(html: str, **kwargs: Any) -> str:
    def link(match: "re.Match[str]") -> str:
        name = match.group(1)
        short = name.split(".")[-1]
        anchor = name if name.startswith("jacmode.") else f"jacmode.{short}"
        if f'id="{anchor}"' in html:
            return f'<a href="#{anchor}"><code>{short}</code></a>'
        return f"<code>{short}</code>"

    return _ROLE.sub(link, html)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _escape_stars(_EXAMPLE.sub(r"\1Examples:", obj.docstring.value))
