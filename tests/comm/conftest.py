"""What the transport tests share: the ``address`` fixture, one per transport (a
listener address to pass to ``listen``), with TLS certificates for ``tls://``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shoal.comm.security import Security

TRANSPORTS = ["inproc://", "tcp://127.0.0.1:0", "tls://127.0.0.1:0"]


@pytest.fixture(scope="module")
def tls_files() -> Iterator[Security]:
    sec = Security.temporary()
    yield sec


@pytest.fixture(params=TRANSPORTS, ids=["inproc", "tcp", "tls"])
def address(request: pytest.FixtureRequest, tls_files: Security, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param.startswith("tls"):
        # listeners and connections of this process take their certificates from here
        for var, path in tls_files.to_env().items():
            if var.startswith("SHOAL_TLS"):
                monkeypatch.setenv(var, path)
    return request.param
