"""A plaintext client against a TLS daemon is told that TLS is required (it got only
"Socket closed", which reads as a daemon that is down)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable

import pytest

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import Unavailable

from ..certs import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize("mtls", [False, True])
def test_a_plaintext_client_against_a_tls_daemon_is_told_tls_is_required(
        daemon: Callable[..., Daemon], pki: Pki, monkeypatch: pytest.MonkeyPatch, mtls: bool) -> None:
    for k in ("KVPARK_TLS_CA", "KVPARK_TLS_CERT", "KVPARK_TLS_KEY"):
        monkeypatch.delenv(k, raising=False)
    tls = {"server.tls_cert": pki.server_cert, "server.tls_key": pki.server_key}
    if mtls:
        tls["server.tls_client_ca"] = pki.ca
    d = daemon(**tls)
    with pytest.raises(Unavailable) as e:
        Client(d.address, timeout=5)
    assert "requires TLS" in str(e.value) and "tls_ca" in str(e.value)


def test_a_daemon_that_is_not_there_is_not_said_to_want_tls(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the client dials it
    with pytest.raises(Unavailable) as e:
        Client(f"127.0.0.1:{port}", timeout=2)
    assert "TLS" not in str(e.value)
