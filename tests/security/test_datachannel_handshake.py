"""Attack: token-less sockets that trickle the data channel's request header (issue F8).
They held every data-channel slot for as long as they kept trickling; now each gets a
short handshake deadline, a few at most are held at once, and transfers go on."""

from __future__ import annotations

import select
import socket
import threading
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.client.client import _header
from kvpark.daemon import datachannel
from kvpark.daemon.server import Daemon
from kvpark.proto.dataframe import CHUNK, MAGIC, PUT, REQUEST, VERSION, parse_address, read_status
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import wait_until

ATTACKERS = 64  # as many as the channel takes connections


class Trickler:
    """A socket that sends a request header one byte at a time, never all of it; notes
    when the daemon closes it."""

    def __init__(self, address: str, stop: threading.Event) -> None:
        family, addr = parse_address(address)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(addr)
        self.closed = threading.Event()
        self.head = REQUEST.pack(MAGIC, VERSION, PUT, b"\0" * 16, 1 << 20)
        self.thread = threading.Thread(target=self._run, args=(stop,), daemon=True)
        self.thread.start()

    def _run(self, stop: threading.Event) -> None:
        sent = 0
        try:
            # One byte every 2 s: well inside the daemon's per-recv idle limit, and the
            # header (30 bytes) is never finished within the test.
            while not stop.is_set() and sent < len(self.head) - 1:
                self.sock.send(self.head[sent:sent + 1])
                sent += 1
                readable, _, _ = select.select([self.sock], [], [], 2.0)
                if readable and not self.sock.recv(64):
                    break
            while not stop.is_set():  # all but one byte sent: wait for the close
                readable, _, _ = select.select([self.sock], [], [], 0.5)
                if readable and not self.sock.recv(64):
                    break
            else:
                return
        except OSError:
            pass
        self.closed.set()

    def close(self) -> None:
        self.sock.close()


def test_token_less_trickling_sockets_do_not_block_a_data_channel_transfer(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    dc = d.datachannel
    assert dc is not None
    stop = threading.Event()
    attackers = [Trickler(dc.address, stop) for _ in range(ATTACKERS)]
    try:
        # Every attacker is held by the daemon or already closed by it.
        assert wait_until(lambda: dc.connections + sum(a.closed.is_set() for a in attackers) >= ATTACKERS,
                          timeout=30)
        before = dc.transfers
        data = torch.arange(4 << 20, dtype=torch.uint8)
        with Client(d.address, transport="inline") as c:
            c.park("legit", [data])
            assert torch.equal(c.restore("legit")[0], data)
        assert dc.transfers == before + 2  # both on the data channel, not the gRPC fallback
        # And the daemon closes every trickler by its handshake deadline, not when it gives up.
        assert wait_until(lambda: all(a.closed.is_set() for a in attackers), timeout=40)
        assert wait_until(lambda: dc.connections == 0, timeout=10)
    finally:
        stop.set()
        for a in attackers:
            a.close()


def test_a_connection_silent_until_its_header_outlives_a_trickler(daemon: Callable[..., Daemon],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A client connects, makes its Reserve call, then sends its header at once: the
    silence before the header is the idle limit's, not the handshake deadline's."""
    monkeypatch.setattr(datachannel, "HANDSHAKE_S", 0.5)  # read at start and by the acceptor
    d = daemon()
    dc = d.datachannel
    assert dc is not None
    stop = threading.Event()
    family, addr = parse_address(dc.address)
    with socket.socket(family, socket.SOCK_STREAM) as silent:
        silent.settimeout(30)
        silent.connect(addr)
        trickler = Trickler(dc.address, stop)
        try:
            assert wait_until(trickler.closed.is_set, timeout=30)  # its header began, and ran out
            data = torch.arange(1 << 20, dtype=torch.uint8)
            with Client(d.address, transport="inline") as c:
                r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=_header("late", [data]), tier="host",
                                                                data_channel=True))
                n = data.numel()
                silent.sendall(REQUEST.pack(MAGIC, VERSION, PUT, r.token, n) + CHUNK.pack(n)
                               + data.numpy().tobytes())
                assert read_status(silent) is None
                c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
                assert torch.equal(c.restore("late")[0], data)
        finally:
            stop.set()
            trickler.close()
