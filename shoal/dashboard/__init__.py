"""The live dashboard a scheduler serves over HTTP (``pip install 'shoal[dashboard]'``):
pages, a JSON API, server-sent events and ``/metrics``; see docs/dashboard.md.

This package stands above :mod:`shoal.scheduler` and nothing imports it at module
level: a scheduler asked for a dashboard imports it when it starts. Importing it
does not import aiohttp; :mod:`.server` does.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import TYPE_CHECKING

from ..comm.core import parse_address

if TYPE_CHECKING:
    from ..scheduler.server import Scheduler
    from .server import Dashboard

__all__ = ["DEFAULT_PORT", "check_exposure", "is_loopback", "parse_dashboard_address", "start_if_available"]

logger = logging.getLogger("shoal.dashboard")

#: the dashboard's port unless told (dask's is 8787: both run side by side)
DEFAULT_PORT = 8790


def parse_dashboard_address(address: str) -> tuple[str, int]:
    """``"host:port"``, ``":port"`` (no host: the scheduler's), ``"[::1]:port"`` or
    ``"host"`` (the default port) -> ``(host, port)``. Raises ``ValueError`` if it is
    none of these."""
    if not isinstance(address, str):
        raise ValueError(f"a dashboard address is a string like ':{DEFAULT_PORT}', got {address!r}")
    text = address.strip()
    if "://" in text:
        scheme, text = parse_address(text)
        if scheme not in ("http", "tcp"):
            raise ValueError(f"a dashboard is served over http, not {scheme}: {address!r}")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad dashboard address {address!r}")
        port_text = rest[1:] if rest else ""
    elif text.count(":") > 1:
        raise ValueError(f"an IPv6 dashboard host goes in brackets, as [::1]:{DEFAULT_PORT}: {address!r}")
    else:
        host, _, port_text = text.partition(":")
    if port_text == "":
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bad port in dashboard address {address!r}")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this host's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, secret: bool, open_: bool) -> None:
    """Raise ``ValueError`` when a dashboard served at ``host`` ("": all interfaces)
    would be readable without login from other hosts: ``open_`` (``--dashboard-open``)
    or a cluster without a ``secret`` (``--no-auth``) on an address that is not
    loopback. The message says what to do instead."""
    if is_loopback(host) or (secret and not open_):
        return
    why = "--dashboard-open (dashboard-open)" if secret else "a cluster without a secret (--no-auth)"
    raise ValueError(
        f"{why} serves the dashboard without login, on a loopback address only, not on "
        f"{host or 'all interfaces'}: use --dashboard-address 127.0.0.1:PORT (or dashboard_address="
        f"'127.0.0.1:PORT'), or no dashboard"
    )


async def start_if_available(scheduler: Scheduler, address: str) -> Dashboard | None:
    """:func:`.server.start_dashboard` if aiohttp is installed; without it, one info
    line in the log and ``None`` (the scheduler runs without a dashboard). Raises what
    ``start_dashboard`` raises."""
    try:
        from .server import start_dashboard
    except ImportError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "aiohttp":
            raise
        logger.info("no dashboard: it needs aiohttp (pip install 'shoal[dashboard]')")
        return None
    return await start_dashboard(scheduler, address)
