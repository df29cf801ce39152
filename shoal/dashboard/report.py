"""The offline performance report: one HTML file that opens with no network and no
server (``shoal.performance_report``).

The report is the status page's charts drawn once from data embedded in the file:
its body is the status page's own part (``static/status.html``), the chart library,
the dashboard's scripts (one after the other, as one) and its style sheet are inlined,
and the data sits in a ``<script type="application/json">`` element that the scripts
read when the page says it is a report (``<body data-page="report">``). So the charts
of the report and of the live page are the same markup and the same code.

This module imports no aiohttp: writing a report needs only the files of the
package.
"""

from __future__ import annotations

import html
import json
import math
import re
from functools import cache
from typing import Any

from .pages import CHART_LIBRARY, SCRIPTS, STATIC

__all__ = ["render_report"]

#: what may end a script element early: its end tag, or "<!--", after which a "<script"
#: would make the parser miss the end tag
_SCRIPT_END = re.compile(r"<(/script|!--)", re.IGNORECASE)


@cache
def _asset(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as ``None`` (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_for_script(data: Any) -> str:
    """``data`` as JSON that no key or text can break out of a ``<script>`` element
    with: ``<``, ``>`` and ``&`` are written as ``\\u`` escapes, which JSON reads as
    the same characters."""
    try:
        text = json.dumps(data, allow_nan=False, default=str, separators=(",", ":"))
    except ValueError:  # a NaN somewhere: walked only then (a report holds up to 100,000 records)
        text = json.dumps(_finite(data), allow_nan=False, default=str, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _inline_script(source: str) -> str:
    """A script's text made safe to sit inside ``<script>...</script>``: ``</script``
    or ``<!--`` in a string or a regular expression of it would confuse the HTML
    parser; ``<\\/script`` and ``<\\!--`` read the same in either."""
    return _SCRIPT_END.sub(lambda m: "<\\" + m.group(1), source)


def _inline_style(source: str) -> str:
    return re.sub(r"</(style)", r"<\\/\1", source, flags=re.IGNORECASE)


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; \
style-src 'unsafe-inline'; img-src data:">
<title>{title}</title>
<link rel="icon" href="data:,">
<style>
{style}
</style>
</head>
<body data-page="report">
<header class="report-header">
<h1>{title}</h1>
<p class="muted">{subtitle}</p>
</header>
<main>
{main}
</main>
<script type="application/json" id="shoal-data">{data}</script>
<script>
{echarts}
</script>
<script>
{dashboard}
</script>
</body>
</html>
"""


def render_report(data: dict[str, Any], title: str = "shoal performance report") -> str:
    """One self-contained HTML document (chart library, script, style and ``data``
    inlined; no request to any host when opened) showing the task stream, progress,
    memory and CPU per worker and bytes moved by path of ``data``: ``{"task_stream":
    [records], "progress": {...}, "workers": [...], "transfers": {"start": {...},
    "stop": {...}}, "summary": {...}, "duration": seconds}`` in the shapes of
    :class:`shoal.scheduler.diagnostics.Diagnostics`. Raises ``OSError`` if the
    package's static files are missing."""
    records = data.get("task_stream") or []
    duration = data.get("duration")
    erred = sum(1 for r in records if r.get("status") != "OK")
    subtitle = f"{len(records)} tasks ran" + (f", {erred} erred" if erred else "")
    if isinstance(duration, (int, float)) and math.isfinite(duration):
        subtitle += f" in {duration:.2f} s"
    return _PAGE.format(
        title=html.escape(title),
        subtitle=html.escape(subtitle),
        style=_inline_style(_asset("style.css")),
        data=_json_for_script(data),
        main=_asset("status.html").rstrip("\n"),
        echarts=_inline_script(_asset(CHART_LIBRARY)),
        dashboard=_inline_script("\n".join(_asset(name) for name in SCRIPTS)),
    )
