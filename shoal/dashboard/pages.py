"""The dashboard's HTML and scripts, as the server and the offline report use them.

The four pages are one shell (``static/page.html``: head, nav bar, ``<main>``) around
each page's own part (``static/<page>.html``); the status page's part is also the body
of the report, so a chart added to the status page is in the report too. The
dashboard's code is a few plain scripts (:data:`SCRIPTS`) that the pages load in order
and the report inlines as one.

This module imports no aiohttp: writing a report needs only the files of the package.
"""

from __future__ import annotations

from pathlib import Path
from string import Template

__all__ = ["CHART_LIBRARY", "PAGES", "SCRIPTS", "STATIC", "render_page"]

#: where the pages and their scripts are
STATIC = Path(__file__).with_name("static")
PAGES = ("status", "workers", "task", "graph")
#: the dashboard's scripts, in the order they run (each uses what those before it define)
SCRIPTS = ("common.js", "stream.js", "charts.js", "pages.js")
#: the chart library, loaded by the pages that draw charts only
CHART_LIBRARY = "vendor/echarts.min.js"
_CHARTED = frozenset({"status", "graph"})


def render_page(name: str, static: Path = STATIC) -> str:
    """Page ``name`` (one of :data:`PAGES`) as an HTML document: the shell of ``static``
    with the page's own part in it, and the page's link in the nav bar marked as the
    current one. Raises ``OSError`` (``FileNotFoundError``) if the shell or the part
    is missing, and ``ValueError`` for a name not in :data:`PAGES`."""
    if name not in PAGES:
        raise ValueError(f"no dashboard page {name!r}")
    shell = Template((static / "page.html").read_text(encoding="utf-8"))
    main = (static / f"{name}.html").read_text(encoding="utf-8").rstrip("\n")
    scripts = ((CHART_LIBRARY,) if name in _CHARTED else ()) + SCRIPTS
    text = shell.substitute(
        page=name,
        scripts="\n".join(f'<script src="static/{script}" defer></script>' for script in scripts),
        main=main,
    )
    link = f'<a href="{name}">'
    return text.replace(link, f'<a href="{name}" aria-current="page">', 1)
