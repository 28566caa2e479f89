"""Where a daemon may listen, TLS and mTLS with generated certificates, and the modes of
the local data paths (unix socket, arena file)."""

from __future__ import annotations

import grp
import hashlib
import os
import stat
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.client.cli import main as cli_main
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import StartupError, Unauthenticated, Unavailable

from ..certs import Pki, make_pki
from ..conftest import make_config


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _token(t: str) -> str:
    return hashlib.sha256(t.encode()).hexdigest()


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "10.1.2.3:0", "example.com:0"])
def test_off_loopback_without_tenants_or_tls_refuses_to_start(tmp_path: Path, listen: str, pki: Pki) -> None:
    with pytest.raises(StartupError, match="no \\[tenants.\\*\\] are configured"):
        Daemon(make_config(tmp_path, **{"server.listen": listen})).start()
    with pytest.raises(StartupError, match="TLS is off"):
        Daemon(make_config(tmp_path, **{"server.listen": listen, "tenants.a.token_sha256": _token("x")})).start()


def test_a_data_channel_address_off_loopback_is_held_to_the_same_rule(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="server.data_channel_listen 0.0.0.0:0 is not loopback"):
        Daemon(make_config(tmp_path, **{"server.data_channel_listen": "0.0.0.0:0"})).start()


def test_insecure_opts_in_explicitly(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"server.listen": "0.0.0.0:0", "server.insecure": True})
    with Client(d.address.replace("0.0.0.0", "127.0.0.1")) as c:
        c.park("s", [torch.ones(3)])


def test_tls_round_trip_and_a_plaintext_client_is_refused(daemon: Callable[..., Daemon], pki: Pki,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon(**{"server.tls_cert": pki.server_cert, "server.tls_key": pki.server_key})
    x = torch.randn(2000)
    with Client(d.address, tls_ca=pki.ca) as c:
        c.park("s", [x])
        assert torch.equal(c.restore("s")[0], x)
    monkeypatch.setenv("KVPARK_TLS_CA", pki.ca)  # the default CA bundle
    with Client(d.address, transport="inline") as c:
        assert torch.equal(c.restore("s")[0], x)
    monkeypatch.delenv("KVPARK_TLS_CA")
    with pytest.raises(Unavailable):
        Client(d.address, timeout=5)  # plaintext against a TLS port
    with pytest.raises(Unavailable):
        Client(d.address, tls_ca=pki.other_ca, timeout=5)  # a server this CA did not sign


def test_mtls_with_tenants_off_loopback(daemon: Callable[..., Daemon], pki: Pki) -> None:
    # Tenants + TLS: the one way an exposed address starts without server.insecure.
    d = daemon(**{"server.listen": "0.0.0.0:0", "server.tls_cert": pki.server_cert,
                  "server.tls_key": pki.server_key, "server.tls_client_ca": pki.ca,
                  "tenants.alice.token_sha256": _token("tok")})
    addr = d.address.replace("0.0.0.0", "127.0.0.1")
    x = torch.randn(5000)
    with Client(addr, token="tok", tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as c:
        c.park("s", [x])
        assert torch.equal(c.restore("s")[0], x)
        assert c.transport == "inline"  # alice is not trusted_local
    with pytest.raises(Unavailable):
        Client(addr, token="tok", tls_ca=pki.ca, timeout=5)  # no client certificate
    with pytest.raises(Unauthenticated):
        Client(addr, token="wrong", tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)


def test_mtls_files_from_the_environment(daemon: Callable[..., Daemon], pki: Pki,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # What a client built for you (the vLLM connector, kvpark health) presents under mTLS.
    d = daemon(**{"server.tls_cert": pki.server_cert, "server.tls_key": pki.server_key,
                  "server.tls_client_ca": pki.ca})
    for k, v in {"KVPARK_TLS_CA": pki.ca, "KVPARK_TLS_CERT": pki.client_cert, "KVPARK_TLS_KEY": pki.client_key}.items():
        monkeypatch.setenv(k, v)
    with Client(d.address) as c:
        c.park("e", [torch.ones(4)])
    assert cli_main(["health", "--address", d.address]) == 0
    monkeypatch.delenv("KVPARK_TLS_CERT")
    monkeypatch.delenv("KVPARK_TLS_KEY")
    with pytest.raises(Unavailable):
        Client(d.address, timeout=5)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_unix_socket_and_arena_are_owner_only(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    old = os.umask(0)  # a permissive umask must not widen them
    try:
        d = daemon(**{"server.listen": f"unix://{sock}"})
    finally:
        os.umask(old)
    assert _mode(str(sock)) == 0o600 and _mode(f"{sock}.data") == 0o600  # gRPC's and the data channel's
    assert d.engine is not None and d.engine.arena.path and _mode(d.engine.arena.path) == 0o600
    with Client(d.address) as c:
        c.park("s", [torch.ones(3)])


def test_an_operator_group_opens_them_to_that_group(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    sock = tmp_path / "kv.sock"
    d = daemon(**{"server.listen": f"unix://{sock}", "server.socket_group": group, "tiers.host.group": group})
    assert d.engine is not None
    for path in (str(sock), f"{sock}.data", d.engine.arena.path):
        assert _mode(path) == 0o660 and os.stat(path).st_gid == os.getgid()
