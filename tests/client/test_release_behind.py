"""A shm restore's Release, not waited for (``client/releases.py``).

A restore whose copies out of the arena landed well within its lease's life hands the
lease id over instead of waiting for a Release round trip. These tests pin where it then
ends: carried by the next Acquire or Reserve, sent before any other call, sent by the
background thread once it has waited, sent at close; and that a copy that did not land
in time still waits for the answer. The daemon side: a carried id is only ever the
caller's own lease, and a flood of them is refused.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any, Callable

import grpc
import pytest
import torch

from kvpark.client import Client, InvalidArgument, NotFound
from kvpark.client import releases
from kvpark.client import transport as tr
from kvpark.daemon import servicer as sv
from kvpark.daemon.server import Daemon
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import wait_until
from ..daemon.test_tenants import TOKENS, tenants

MiB = 1 << 20


def _leases(d: Daemon) -> int:
    assert d.engine is not None
    with d.engine.catalog.lock:
        return d.engine.leases.count


def _blob(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The background thread never gets to a release: only calls end them."""
    monkeypatch.setattr(releases, "DELAY_S", 3600.0)


def test_the_next_restore_carries_the_last_ones_release(daemon: Callable[..., Daemon], no_thread: None) -> None:
    d = daemon()
    data = [_blob(MiB, 1), _blob(2 * MiB, 2)]
    with Client(d.address, transport="shm") as c:
        c.park("a", data)
        c.park("b", [_blob(MiB, 3)])
        got = c.restore("a")
        assert all(torch.equal(x, y) for x, y in zip(got, data))
        # Not waited for: the lease is still held, its id pending on the client.
        assert (c.rpc.releases.pending, _leases(d)) == (1, 1)
        for sid in ("b", "a", "b"):
            c.restore(sid)
            # The Acquire ended the previous lease first: one lease at a time, never more.
            assert (c.rpc.releases.pending, _leases(d)) == (1, 1)


def test_any_other_call_finds_the_lease_ended(daemon: Callable[..., Daemon], no_thread: None) -> None:
    d = daemon()
    with Client(d.address, transport="shm") as c:
        c.park("a", [_blob(MiB, 1)])
        c.restore("a")
        assert _leases(d) == 1
        # What a caller asks right after a restore sees it ended, as if it had waited.
        assert c.stat().leases == 0
        assert c.rpc.releases.pending == 0
        c.restore("a")
        c.drop("a")
        assert _leases(d) == 0
        # A park's Reserve carries it.
        c.park("b", [_blob(MiB, 2)])
        c.restore("b")
        assert _leases(d) == 1
        c.park("c", [_blob(MiB, 3)])
        assert _leases(d) == 0


def test_an_idle_clients_lease_ends_without_another_call(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address, transport="shm") as c:
        c.park("a", [_blob(MiB, 1)])
        c.restore("a")
        assert wait_until(lambda: _leases(d) == 0, timeout=30)
        assert c.rpc.releases.pending == 0


def test_close_sends_what_is_pending(daemon: Callable[..., Daemon], no_thread: None) -> None:
    d = daemon()
    c = Client(d.address, transport="shm")
    c.park("a", [_blob(MiB, 1)])
    c.restore("a")
    assert _leases(d) == 1
    c.close()
    assert _leases(d) == 0


def test_a_carrying_call_that_fails_still_ends_the_lease(daemon: Callable[..., Daemon], no_thread: None) -> None:
    d = daemon()
    with Client(d.address, transport="shm") as c:
        c.park("a", [_blob(MiB, 1)])
        c.restore("a")
        with pytest.raises(NotFound):
            c.restore("missing")
        assert _leases(d) == 0
        # Handed back for sending again: harmless (the daemon finds it gone), and it goes.
        assert c.stat().leases == 0
        assert c.rpc.releases.pending == 0


class _LateCopy(tr.Shm):
    """A reader whose copy lands past the point where it may skip the Release's answer."""

    def _usable_until(self, sent: float, expires_in_s: float) -> float | None:
        return sent  # passed before the copy even starts


def test_a_copy_that_landed_late_waits_for_the_answer(daemon: Callable[..., Daemon], no_thread: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon()
    monkeypatch.setitem(tr.TRANSPORTS, "shm", _LateCopy)
    data = _blob(MiB, 1)
    with Client(d.address, transport="shm") as c:
        c.park("a", [data])
        assert torch.equal(c.restore("a")[0], data)
        # Released, and answered, before restore returned.
        assert (c.rpc.releases.pending, _leases(d)) == (0, 0)


def test_a_grant_always_waits_for_the_answer(daemon: Callable[..., Daemon], no_thread: None) -> None:
    # Its lease's clock started before the lookup's reply was sent, and a grant may be read
    # in another process: the client cannot reckon its deadline, so it asks.
    d = daemon()
    data = _blob(MiB, 1)
    with Client(d.address, transport="shm") as c:
        c.park("a", [data])
        n, g = c.lookup_acquire(["a"])
        assert n == 1 and g is not None and not g.inlined
        out = torch.empty(MiB, dtype=torch.uint8)
        c.restore_grant(g, into_flat=out)
        assert torch.equal(out, data)
        assert (c.rpc.releases.pending, _leases(d)) == (0, 0)


@pytest.mark.parametrize("then", ["restore", "park"])
def test_a_carrying_call_never_overtakes_a_release_on_its_way(daemon: Callable[..., Daemon],
                                                            monkeypatch: pytest.MonkeyPatch, then: str) -> None:
    # A slow Release (a tenant's settles its quota, which may demote): the thread has sent
    # it, and the next call must not reach the daemon before it has ended the lease (a park
    # would find the tier full of a lease its own client is done with).
    slow = threading.Event()
    release = sv.Servicer.Release

    def slow_release(self: Any, req: Any, context: Any) -> Any:
        if slow.is_set():
            time.sleep(0.3)
        return release(self, req, context)

    monkeypatch.setattr(sv.Servicer, "Release", slow_release)
    d = daemon(**{"tiers.host.capacity": "8MiB"})
    with Client(d.address, transport="shm") as c:
        c.park("a", [_blob(5 * MiB, 1)])
        slow.set()
        c.restore("a")
        assert wait_until(lambda: c.rpc.releases.sending == 1, timeout=30)
        if then == "restore":
            c.restore("a")
            assert _leases(d) == 1  # only this restore's own
        else:
            assert c.park("b", [_blob(5 * MiB, 2)]).tier == "host"


def test_an_older_daemon_gets_its_releases_sent(daemon: Callable[..., Daemon], no_thread: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A daemon that does not list "carry_release" would drop the field: the client sends
    # the releases before its next call instead, and no lease waits for its TTL.
    monkeypatch.setattr(sv, "FEATURES", ("packed",))
    monkeypatch.setattr(sv.Servicer, "_carried", lambda self, eng, ids: None)  # as it would: the field unread
    d = daemon()
    with Client(d.address, transport="shm") as c:
        c.park("a", [_blob(MiB, 1)])
        for _ in range(4):
            c.restore("a")
            assert _leases(d) == 1
        c.park("b", [_blob(MiB, 2)])
        assert _leases(d) == 0


def test_the_thread_ends_when_idle_and_an_unclosed_client_is_collected(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(releases, "IDLE_EXIT_S", 0.05)
    d = daemon()
    c = Client(d.address, transport="shm")
    c.park("a", [_blob(MiB, 1)])
    c.restore("a")
    assert wait_until(lambda: _leases(d) == 0, timeout=30)
    assert wait_until(lambda: c.rpc.releases._thread is None, timeout=30)
    gone = weakref.ref(c.rpc)
    del c
    gc.collect()
    assert gone() is None


def test_windows_and_cuda_ipc_always_wait() -> None:
    assert tr.Shm.releases_behind and not tr.CudaIpc.releases_behind


def _unary(ch: grpc.Channel, name: str, resp: Any) -> Callable[..., Any]:
    return ch.unary_unary(f"/kvpark.v1.KVPark/{name}", request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=resp.FromString)


def test_a_tenant_cannot_end_anothers_lease_by_carrying_it(daemon: Callable[..., Daemon], no_thread: None) -> None:
    d = daemon(**tenants())
    carol = [("authorization", f"Bearer {TOKENS['carol']}")]  # trusted_local, as alice is
    bob = [("authorization", f"Bearer {TOKENS['bob']}")]  # not: no leased restores at all
    with Client(d.address, token=TOKENS["alice"], transport="shm") as a, grpc.insecure_channel(d.address) as ch:
        a.park("a", [_blob(MiB, 1)])
        a.restore("a")
        (stolen,) = a.rpc.releases.take()
        a.rpc.releases.put_back([stolen])
        assert _leases(d) == 1
        hdr = pb.ParkHeader(seq_id="b", nbytes=16, tensors=[pb.TensorMeta(dtype="uint8", shape=[16], nbytes=16)])
        _unary(ch, "ParkSmall", pb.SeqInfo)(pb.ParkSmallRequest(header=hdr, data=bytes(16)), metadata=carol,
                                            timeout=30)
        g = _unary(ch, "Acquire", pb.AcquireResponse)(pb.AcquireRequest(seq_id="b", release=[stolen, "nonsense"]),
                                                      metadata=carol, timeout=30)
        _unary(ch, "Release", pb.ReleaseResponse)(pb.ReleaseRequest(lease_id=g.lease_id), metadata=carol, timeout=30)
        r = _unary(ch, "Reserve", pb.ReserveResponse)(pb.ReserveRequest(header=pb.ParkHeader(seq_id="c", nbytes=16, tensors=hdr.tensors), tier="host",
                                                                      release=[stolen]),
                                                      metadata=carol, timeout=30)
        _unary(ch, "Release", pb.ReleaseResponse)(pb.ReleaseRequest(lease_id=r.lease_id), metadata=carol, timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            _unary(ch, "Acquire", pb.AcquireResponse)(pb.AcquireRequest(seq_id="b", release=[stolen]),
                                                      metadata=bob, timeout=30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _leases(d) == 1  # alice's lease stands
        with pytest.raises(grpc.RpcError) as e:
            _unary(ch, "Acquire", pb.AcquireResponse)(pb.AcquireRequest(seq_id="b", release=["x"] * 65),
                                                      metadata=carol, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert a.stat().leases == 0  # alice's own next call ends it


def test_a_flood_of_carried_ids_is_refused_typed(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address, transport="shm") as c:
        c.park("a", [_blob(MiB, 1)])
        with pytest.raises(InvalidArgument, match="at most 64"):
            c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="a", release=["x"] * 65))
        assert torch.equal(c.restore("a")[0], _blob(MiB, 1))  # and the daemon serves on
