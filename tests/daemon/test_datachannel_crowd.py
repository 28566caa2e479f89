"""A crowd on the data channel: more clients at once than its limits admit.

The channel bounds connections that have not yet shown a request
(``MAX_UNAUTHENTICATED``, against clients that connect and say nothing) and all
connections (``MAX_CONNECTIONS``). A burst of honest clients past either bound must
still get every park and restore right: a connection the daemon turns away before it
has read the request falls back to gRPC for that call, and a connection whose request
is already waiting is not the one evicted for a newcomer. A real daemon on port 0, real
clients in threads; the limits are lowered in this process so that a handful of
threads crowd them.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon import datachannel
from kvpark.daemon.server import Daemon
from kvpark.proto.dataframe import parse_address

from ..conftest import wait_until

THREADS = 12
ROUNDS = 4


def payload(i: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return [torch.randn(300_000, generator=g), torch.randint(0, 9, (77_777,), dtype=torch.int8, generator=g)]


def crowd(d: Daemon, park: bool) -> tuple[list[BaseException], int]:
    """THREADS clients at once, each parking (or restoring) ROUNDS sequences over the
    channel; returns the errors and how many restores came back wrong."""
    errors: list[BaseException] = []
    wrong = [0]
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        try:
            with Client(d.address, transport="inline") as c:
                assert c._transport.channel is not None  # type: ignore[attr-defined]
                start.wait(timeout=30)
                for r in range(ROUNDS):
                    i = t * ROUNDS + r
                    if park:
                        c.park(f"s{i}", payload(i))
                    else:
                        got = c.restore(f"s{i}")
                        if not all(torch.equal(a, b) for a, b in zip(got, payload(i))):
                            wrong[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads)
    return errors, wrong[0]


def settled(d: Daemon) -> None:
    assert d.engine is not None
    assert wait_until(lambda: d.engine.stat().leases == 0, timeout=15.0)
    d.engine.check_invariants()


@pytest.mark.parametrize("limit", ["unauthenticated", "connections"])
def test_a_crowd_past_the_channels_limits_gets_every_byte_right(daemon: Callable[..., Daemon],
                                                                monkeypatch: pytest.MonkeyPatch, limit: str) -> None:
    if limit == "unauthenticated":
        monkeypatch.setattr(datachannel, "MAX_UNAUTHENTICATED", 1)
    else:
        monkeypatch.setattr(datachannel, "MAX_CONNECTIONS", 2)
    d = daemon(**{"tiers.host.capacity": "256MiB"})
    assert d.datachannel is not None
    errors, _ = crowd(d, park=True)
    assert errors == []
    errors, wrong = crowd(d, park=False)
    assert errors == [] and wrong == 0
    assert d.datachannel.transfers > 0  # the channel still carried some of it
    settled(d)


def test_silent_connections_still_cannot_hold_the_channel(daemon: Callable[..., Daemon],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound the eviction exists for: clients that connect and never speak are
    evicted for newcomers, so an honest restore still goes over the channel."""
    monkeypatch.setattr(datachannel, "MAX_UNAUTHENTICATED", 2)
    d = daemon(**{"tiers.host.capacity": "64MiB"})
    assert d.datachannel is not None
    family, addr = parse_address(d.datachannel.address)
    silent = []
    for _ in range(6):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(addr)
        silent.append(s)
    try:
        with Client(d.address, transport="inline") as c:
            c.park("x", payload(1))
            before = d.datachannel.transfers
            got = c.restore("x")
            assert all(torch.equal(a, b) for a, b in zip(got, payload(1)))
            assert d.datachannel.transfers > before
        # At most the bound's worth of the silent ones are still open on the daemon's side.
        closed = 0
        for s in silent:
            s.settimeout(2)
            try:
                closed += s.recv(1) == b""
            except (socket.timeout, OSError):
                pass
        assert closed >= len(silent) - 2
    finally:
        for s in silent:
            s.close()
    settled(d)
