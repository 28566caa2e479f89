"""Daemon addresses: one rule for the client, the CLI and the vLLM connector
(client/address.py), checked as written and against a real daemon."""

from __future__ import annotations

from typing import Callable

import pytest

from kvpark.client import Client, InvalidArgument
from kvpark.client.address import normalize
from kvpark.client.cli import main
from kvpark.daemon.server import Daemon


@pytest.mark.parametrize("given, want", [
    ("127.0.0.1:50600", "127.0.0.1:50600"),
    ("localhost", "localhost:50551"),
    (" localhost ", "localhost:50551"),
    ("kv-host.example", "kv-host.example:50551"),
    ("[::1]", "[::1]:50551"),
    ("[::1]:7000", "[::1]:7000"),
    ("::1", "[::1]:50551"),
    ("unix:/run/kvpark.sock", "unix:/run/kvpark.sock"),
    ("unix:///run/kvpark.sock", "unix:///run/kvpark.sock"),
    ("dns:///kv-host:50551", "dns:///kv-host:50551"),
])
def test_addresses_as_a_user_writes_them(given: str, want: str) -> None:
    assert normalize(given) == want


@pytest.mark.parametrize("given, words", [
    ("http://127.0.0.1:50551", "not http://; expected HOST:PORT"),
    ("grpc://kv-host:50551", "did you mean kv-host:50551?"),
    ("https://kv-host", "not https://"),
    ("", "empty daemon address"),
    ("host:port", "port 'port' is not a number"),
    ("host:0", "from 1 to 65535"),
    ("host:70000", "from 1 to 65535"),
    ("[::1", "closing ']'"),
    ("host/path:1", "expected HOST:PORT"),
])
def test_bad_addresses_are_refused_in_words(given: str, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words.replace("?", r"\?").replace("[", r"\[")):
        normalize(given)


def test_the_client_dials_a_bare_host_on_its_given_port_and_refuses_a_url(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    port = d.address.rsplit(":", 1)[1]
    with Client(f"localhost:{port}") as c:
        assert c.stat().sequences == 0
    with pytest.raises(InvalidArgument, match="not http://"):
        Client(f"http://127.0.0.1:{port}")


def test_the_cli_refuses_a_url_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in (["health"], ["stat"]):
        assert main([*cmd, "--address", "http://127.0.0.1:1"]) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "not http://" in err, err


def test_no_daemon_is_said_in_words_with_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for cmd in (["stat"], ["info", "x"], ["drop", "x"], ["flush"]):
        assert main([*cmd, "--address", f"127.0.0.1:{port}", "--timeout", "5"]) == 1
        err = capsys.readouterr().err.strip()
        assert err == (f"kvpark: no daemon answers at 127.0.0.1:{port}: is `kvpark serve` running there? "
                       "(another address: --address HOST:PORT or $KVPARK_ADDRESS)"), err
