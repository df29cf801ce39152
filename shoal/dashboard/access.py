"""Who may read the dashboard: a login with the cluster's secret, and what a viewer
who has not logged in sees of an open dashboard.

Theory of operation
-------------------
The dashboard's *token* is :func:`shoal.comm.security.dashboard_token` of the
cluster's secret (an HMAC of a fixed label): whoever holds the secret can make it, and
it does not give the secret away. A request presents it in one of three ways:

- ``?token=TOKEN`` in the URL: the link ``shoal scheduler`` prints and
  ``client.dashboard_link`` gives. On a page, the answer sets a cookie and sends the
  browser on to the same page without the token (a tiny page that replaces itself, so
  that the token leaves the address bar and the history; an HTTP redirect would lose
  a ``SameSite=Strict`` cookie when the link was clicked on another site);
- the cookie: ``shoal-dashboard-PORT`` (a name per port: browsers send a host's
  cookies to all its ports), ``HttpOnly; SameSite=Strict; Path=/``, holding an HMAC
  of the token (not the token itself);
- ``Authorization: Bearer TOKEN``, for scripts and Prometheus.

Every comparison is in constant time. A token that is not the cluster's is refused
(403) wherever it is presented, unless the request also presents a right one; a request with none gets a 401 (a short page saying
how to log in, or ``{"error": ...}`` for the API), the same whatever was asked, so
nothing of the cluster leaks through it. ``/health`` answers everybody.

Without login (``dashboard-open``, loopback only) a request is served *anonymously*:
the pages, the workers and the counts by key prefix, but no task key and no error
(the task-stream records come without keys; ``task`` and ``search`` need a login).
``/metrics`` is served without login only with ``metrics-public`` (an open dashboard
too): it shows counts, never a key or an error, either way.
A cluster without a secret (``--no-auth``) has nothing to log in with: every viewer
sees everything, and it is served on loopback only (any local user could run code
in that cluster anyway).
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse
from collections.abc import Collection

from aiohttp import web

from ..comm.security import dashboard_token

__all__ = ["ANONYMOUS", "FULL", "Access", "LOGGED_IN_ONLY"]

#: what a request may see: everything, or the anonymous view of an open dashboard
FULL = "full"
ANONYMOUS = "anonymous"
#: the endpoints an anonymous viewer is refused (they show task keys and errors)
LOGGED_IN_ONLY = frozenset({"/api/v1/task", "/api/v1/search"})

_COOKIE_LABEL = b"shoal-dashboard-cookie-1"
_NO_STORE = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}

_LOGIN_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>shoal: log in</title>
<link rel="icon" href="data:,">
<style>
body {{ font: 15px/1.5 system-ui, sans-serif; margin: 3em auto; max-width: 42em; padding: 0 1em; color: #1f2328; }}
code {{ background: #f0f2f4; padding: 0 0.25em; border-radius: 3px; }}
form {{ margin: 1.5em 0; display: flex; gap: 0.5em; }}
input {{ flex: 1; font: inherit; padding: 0.3em; }}
.wrong {{ color: #b42318; }}
</style>
</head>
<body data-page="login">
<main>
<h1 id="login-title">This dashboard needs the cluster's secret</h1>
{wrong}<p>Open the link with a token that <code>shoal scheduler</code> printed when it started
(<code>shoal dashboard at http://&hellip;/status?token=&hellip;</code>), or
<code>client.dashboard_link</code> of a client of this cluster. The token is
<code>shoal.comm.security.dashboard_token(secret)</code>; scripts send it as
<code>Authorization: Bearer TOKEN</code>.</p>
<form method="get" action="status" id="login">
<input type="password" name="token" id="login-token" placeholder="token" aria-label="token" autocomplete="off">
<button type="submit">Log in</button>
</form>
</main>
</body>
</html>
"""

_WRONG = '<p class="wrong" id="login-wrong">That token is not this cluster\'s.</p>\n'

_ONWARD_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>shoal: logged in</title>
<link rel="icon" href="data:,">
<meta http-equiv="refresh" content="0; url={attr}">
<script>location.replace({script});</script>
</head>
<body><p>Logged in: <a href="{attr}">on to the dashboard</a>.</p></body>
</html>
"""


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode("ascii"))


class Access:
    """The login of one dashboard. ``secret``: the cluster's (None: it has none, and
    everybody sees everything); ``port``: where the dashboard listens (names its
    cookie); ``open_``: serve anonymous viewers; ``metrics_public``: serve
    ``/metrics`` without login."""

    def __init__(self, secret: bytes | None, port: int, open_: bool = False, metrics_public: bool = False) -> None:
        self.token = dashboard_token(secret) if secret is not None else None
        self.cookie_name = f"shoal-dashboard-{port}"
        self._cookie = (hmac.new(self.token.encode("ascii"), _COOKIE_LABEL, hashlib.sha256).hexdigest()
                        if self.token is not None else None)
        self.open = open_
        self.metrics_public = metrics_public

    def login_link(self, link: str) -> str:
        """``link`` with the token that logs its opener in (``link`` itself without a secret)."""
        if self.token is None:
            return link
        return f"{link}{'&' if '?' in link else '?'}token={self.token}"

    def presented(self, request: web.BaseRequest) -> bool | None:
        """True when ``request`` presents this dashboard's token (``?token=``, a bearer)
        or its cookie; False when it presents tokens and none is it; None when it
        presents none (a cookie that is not this dashboard's counts as none: a login of
        an earlier cluster). Always None without a secret. (One right credential is
        enough: a proxy in front may add a bearer of its own.)"""
        if self.token is None or self._cookie is None:
            return None
        given = list(request.query.getall("token", []))
        for header in request.headers.getall("Authorization", []):
            scheme, _, value = header.strip().partition(" ")
            if scheme.lower() == "bearer":  # (another scheme is a proxy's own)
                given.append(value.strip())
        cookie = request.cookies.get(self.cookie_name)
        right = [_same(g, self.token) for g in given]
        if cookie is not None:
            right.append(_same(cookie, self._cookie))
        if any(right):
            return True
        return False if given else None

    def viewer(self, request: web.BaseRequest) -> tuple[str | None, bool | None]:
        """``(view, presented)``: what ``request`` may see (FULL, ANONYMOUS, or None:
        it is refused) and what it presented (see :meth:`presented`)."""
        presented = self.presented(request)
        if presented is False:
            return None, False
        if presented or self.token is None:
            return FULL, presented
        if request.path == "/metrics":  # (open by its own choice only, even on an open dashboard)
            return (ANONYMOUS, None) if self.metrics_public else (None, None)
        return (ANONYMOUS, None) if self.open else (None, None)

    def refusal(self, presented: bool | None, page: bool) -> web.Response:
        """The answer to a request refused: 401 (no login) or 403 (a wrong token), a
        login page for a ``page`` and ``{"error": ...}`` for the rest. It says nothing
        of the cluster."""
        wrong = presented is False
        status = 403 if wrong else 401
        headers = dict(_NO_STORE)
        if not wrong:
            headers["WWW-Authenticate"] = 'Bearer realm="shoal dashboard"'
        if page:
            return web.Response(status=status, text=_LOGIN_PAGE.format(wrong=_WRONG if wrong else ""),
                                content_type="text/html", headers=headers)
        text = ("this token is not the cluster's" if wrong else
                "log in: this dashboard needs the cluster's token (Authorization: Bearer TOKEN, or open the "
                "link with ?token= that 'shoal scheduler' printed or client.dashboard_link gives)")
        return web.json_response({"error": text}, status=status, headers=headers)

    def anonymous_refusal(self) -> web.Response:
        """The answer of an endpoint that shows task keys or errors to an anonymous viewer."""
        return web.json_response({"error": "log in to see tasks: their keys and errors need the cluster's token"},
                                 status=401, headers={**_NO_STORE,
                                                      "WWW-Authenticate": 'Bearer realm="shoal dashboard"'})

    def onward(self, request: web.BaseRequest, page: str) -> web.Response:
        """The answer to page ``page`` asked for with the right ``?token=``: the cookie,
        and a page that replaces itself with ``page`` (the request's other parameters
        kept, the token dropped)."""
        assert self._cookie is not None
        query = [(k, v) for k, v in request.query.items() if k != "token"]
        target = page + ("?" + urllib.parse.urlencode(query) if query else "")
        # (urlencode leaves letters, digits and "%+=&-._~" only: nothing a script's
        # string needs escaped, and in the attribute only the ampersands)
        body = _ONWARD_PAGE.format(attr=target.replace("&", "&amp;"), script='"' + target + '"')
        response = web.Response(text=body, content_type="text/html", headers=dict(_NO_STORE))
        response.set_cookie(self.cookie_name, self._cookie, path="/", httponly=True, samesite="Strict")
        return response


def page_name(path: str, pages: Collection[str]) -> str | None:
    """The page ``path`` asks for (``/`` is the status page), or None if it is no page."""
    if path == "/":
        return "status"
    name = path[1:]
    return name if name in pages else None
