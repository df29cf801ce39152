"""Browser tests: the dashboard's pages and the offline report in a real headless
Chromium, driven by Playwright's sync API.

The browser is Debian's (``/usr/bin/chromium``, launched by path: no browser is ever
downloaded), started once per session. Each test gets a fresh context and page
(:class:`Tab`) that records the console's errors and the page's uncaught exceptions;
a test ends with :meth:`Tab.done`, which saves a screenshot and asserts there were
none. Without ``/usr/bin/chromium`` the tests are skipped, unless
``SHOAL_REQUIRE_BROWSER`` is set (as CI does), when they fail instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: milliseconds a page gets to show what a test waits for
WAIT_MS = 15_000


def _required() -> bool:
    return bool(os.environ.get("SHOAL_REQUIRE_BROWSER"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists() and not _required():
        pytest.skip(f"no {CHROMIUM} (apt-get install chromium; SHOAL_REQUIRE_BROWSER=1 makes this a failure)")
    if _required():
        from playwright.sync_api import sync_playwright
    else:
        sync_api = pytest.importorskip("playwright.sync_api")
        sync_playwright = sync_api.sync_playwright
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


class Tab:
    """A page of its own context, with what went wrong in it: ``errors`` holds the
    console's error messages and the page's uncaught exceptions, ``requests`` every
    URL the page asked for."""

    def __init__(self, browser: Any, shots: Path, name: str, offline: bool = False) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.shots = shots
        self.name = name
        if offline:
            # nothing but the file itself may load: every other request is refused
            self.context.route("**/*", self._only_files)
        self.context.on("request", lambda r: self.requests.append(r.url))
        self.page = self.context.new_page()
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))

    def login(self, link: str) -> None:
        """Open ``link``, a dashboard's link with its token (as ``shoal scheduler``
        prints it), and wait until the page it sends the browser on to has loaded:
        the tab's context then has the dashboard's cookie."""
        self.page.goto(link)
        page = link.partition("?")[0].rpartition("/")[2]
        self.page.wait_for_url(f"**/{page}", timeout=WAIT_MS)
        self.page.wait_for_load_state()

    def _only_files(self, route: Any) -> None:
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            route.abort()

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(f"console error: {message.text} ({message.location})")

    def wait(self, expression: str, arg: Any = None) -> Any:
        """The value of JavaScript ``expression`` (a function of ``arg``) once it is
        truthy; fails after ``WAIT_MS``."""
        return self.page.wait_for_function(expression, arg=arg, timeout=WAIT_MS).json_value()

    def js(self, expression: str, arg: Any = None) -> Any:
        return self.page.evaluate(expression, arg)

    def screenshot(self, label: str = "") -> Path:
        path = self.shots / f"{self.name}{'-' + label if label else ''}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path

    def done(self) -> None:
        """Screenshot, then: no console error and no page error happened."""
        self.screenshot()
        assert not self.errors, "\n".join(self.errors)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A function that opens a :class:`Tab` (``tab(offline=True)``: no network at all;
    ``tab(login=link)``: logged in to a dashboard with its link first); every tab
    opened is closed after the test, and none may have had an error."""
    opened: list[Tab] = []

    def open_tab(offline: bool = False, login: str | None = None) -> Tab:
        t = Tab(browser, tmp_path, f"{request.node.name}-{len(opened)}", offline=offline)
        opened.append(t)
        if login is not None:
            t.login(login)
        return t

    yield open_tab
    errors = [e for t in opened for e in t.errors]
    for t in opened:
        t.close()
    assert not errors, "\n".join(errors)
