"""A transfer owns its lease: nothing ends a lease, or frees its slots, under a reader or
writer that is copying through it.

A real daemon serves the data channel; the test plays the client on a raw socket so it
controls exactly when bytes are read, and what the daemon does meanwhile (a Release,
the reaper, a drop and a park that would reuse freed slots).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Any, Callable

import lmdb
import pytest

import torch

from kvpark.client import Client
from kvpark.client.client import _header
from kvpark.daemon import datachannel
from kvpark.daemon.engine import Engine
from kvpark.daemon.leases import LeaseTable
from kvpark.daemon.mover import Mover
from kvpark.daemon.server import Daemon
from kvpark.daemon.servicer import _spec
from kvpark.proto.dataframe import CHUNK, GET, MAGIC, PUT, REQUEST, VERSION, parse_address, read_status, recv_exact
from kvpark.proto.errors import InvalidArgument, KVParkError, LeaseExpired, Unavailable
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.tiers.disk import DiskStore

from ..conftest import make_config, wait_until

MiB = 1 << 20


def filled(nbytes: int, byte: int) -> torch.Tensor:
    return torch.full((nbytes,), byte, dtype=torch.uint8)


def slow_reader(d: Daemon) -> socket.socket:
    """A raw data channel socket with a small receive buffer: the daemon's send blocks
    after a few MiB until the test reads, so the transfer is pinned mid-stream."""
    assert d.datachannel is not None
    family, addr = parse_address(d.datachannel.address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    s.settimeout(30)
    s.connect(addr)
    return s


def start_get(c: Client, d: Daemon, sid: str) -> tuple[pb.AcquireResponse, socket.socket]:
    a = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id=sid, tier="host", data_channel=True))
    s = slow_reader(d)
    s.sendall(REQUEST.pack(MAGIC, VERSION, GET, a.token, a.info.nbytes))
    assert read_status(s) is None
    return a, s


def reserve_dc(c: Client, sid: str, ts: list[torch.Tensor]) -> pb.ReserveResponse:
    return c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=_header(sid, ts), tier="host", data_channel=True))


def read_rest(s: socket.socket, nbytes: int) -> tuple[bytes, KVParkError | None]:
    """Every chunk until ``nbytes`` arrived or the daemon failed the transfer typed."""
    got = bytearray()
    while len(got) < nbytes:
        (n,) = CHUNK.unpack(recv_exact(s, CHUNK.size))
        if n == 0:
            return bytes(got), read_status(s)
        got += recv_exact(s, n)
    return bytes(got), read_status(s)


def waiting_in(fn: Callable[..., object]) -> bool:
    """Some thread is inside ``fn`` right now (a Release that waits out a transfer)."""
    code = fn.__code__
    for frame in sys._current_frames().values():
        f = frame
        while f is not None:
            if f.f_code is code:
                return True
            f = f.f_back
    return False


def settled(d: Daemon) -> None:
    assert d.engine is not None
    assert wait_until(lambda: d.engine.stat().leases == 0, timeout=10.0)
    d.engine.check_invariants()


def test_release_during_a_data_channel_get_never_streams_freed_slots(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.capacity": "32MiB"})
    n = 24 * MiB  # six outgoing chunks: the daemon is mid-stream once the socket fills
    a_bytes, b_bytes = filled(n, 0xA5), filled(n, 0x5B)
    with Client(d.address, transport="inline") as c:
        c.park("a", [a_bytes])
        acq, s = start_get(c, d, "a")
        # 1. The client releases the lease while its GET is streaming, from another thread.
        released: list[bool] = []
        t = threading.Thread(target=lambda: released.append(
            c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=acq.lease_id)).released))
        t.start()
        # 2. The Release returned (it ended the lease under the transfer), or it waits out the
        #    transfer's copy inside the lease table.
        assert wait_until(lambda: not t.is_alive() or waiting_in(LeaseTable.end), timeout=20.0)
        if not t.is_alive():
            # The lease is over: "a" dropped and "b" parked may take the slots "a" had.
            c.drop("a")
            c.park("b", [b_bytes])
        # 3. Whatever arrives is "a"'s bytes: all of them, or a prefix and a typed error.
        got, err = read_rest(s, n)
        s.close()
        t.join(30)
        assert not t.is_alive()
        assert err is None or isinstance(err, LeaseExpired), err
        assert got == bytes(memoryview(a_bytes.numpy())[: len(got)]), (
            f"{sum(1 for x in got if x != 0xA5)} of {len(got)} bytes streamed were not the leased sequence's")
        if err is None:
            assert len(got) == n
        c.drop("a")
        c.park("b", [b_bytes], overwrite=True)
        assert torch.equal(c.restore("b")[0], b_bytes)
    settled(d)


def test_a_data_channel_get_outlasting_the_lease_ttl_is_whole_and_keeps_its_slots(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.capacity": "32MiB", "leases.ttl_s": 0.5})
    n = 24 * MiB
    a_bytes, b_bytes = filled(n, 0xA5), filled(n, 0x5B)
    with Client(d.address, transport="inline") as c:
        c.park("a", [a_bytes])
        c.park("probe", [filled(2 * MiB, 1)])
        _, s = start_get(c, d, "a")
        # 1. A lease taken after the GET began, read by nobody: once the reaper has ended it,
        #    the reaper has run past the GET lease's own TTL too.
        probe = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="probe", tier="host"))
        assert wait_until(lambda: probe.lease_id not in d.engine.leases._leases, timeout=20.0)
        # 2. Drop "a" and park "b", which fits only in "a"'s slots: it lands there if the
        #    reaper freed them, else it waits for room until the GET has ended.
        c.drop("a")
        errors: list[BaseException] = []

        def park_b() -> None:
            try:
                c.park("b", [b_bytes])
            except BaseException as e:  # surfaced below
                errors.append(e)

        t = threading.Thread(target=park_b)
        t.start()
        assert wait_until(lambda: not t.is_alive() or waiting_in(Mover.await_room), timeout=20.0)
        # 3. The slow GET still returns exactly "a"'s bytes, whole.
        got, err = read_rest(s, n)
        s.close()
        t.join(30)
        assert not errors, errors
        assert err is None, err
        assert got == bytes(memoryview(a_bytes.numpy())), (
            f"{sum(1 for x in got if x != 0xA5)} of {n} bytes streamed were not the leased sequence's")
        assert torch.equal(c.restore("b")[0], b_bytes)
    settled(d)


def test_a_grpc_restore_stream_never_sends_slots_its_lease_no_longer_holds(daemon: Callable[..., Daemon]) -> None:
    """The sibling on the gRPC stream: its lease ends (here a Release naming it; at
    shutdown, ``close``) while the stream is suspended between chunks. The next chunk is
    a typed error, never bytes read from slots the lease no longer holds."""
    d = daemon(**{"tiers.host.capacity": "32MiB", "server.data_channel": False})
    a_ts = [filled(MiB, 0xA5) for _ in range(24)]
    b_bytes = filled(24 * MiB, 0x5B)
    with Client(d.address, transport="inline") as c:
        c.park("a", a_ts)
        it = c.restore("a", layerwise=True)
        i, first = next(it)
        assert i == 0 and torch.equal(first, a_ts[0])
        # 1. The stream's lease (its id is the daemon's alone; the test reads it there) is
        #    released, "a" dropped, and "b" parked where "a"'s slots were.
        ids = list(d.engine.leases._leases)
        assert len(ids) == 1
        assert c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=ids[0])).released
        c.drop("a")
        c.park("b", [b_bytes])
        # 2. Whatever the stream still delivers is "a"'s, or a typed LeaseExpired.
        try:
            for i, t in it:
                assert torch.equal(t, a_ts[i]), f"tensor {i} of the restore holds another sequence's bytes"
        except LeaseExpired:
            pass
        assert torch.equal(c.restore("b")[0], b_bytes)
    settled(d)


def test_a_put_whose_reservation_was_released_never_writes_into_freed_slots(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.capacity": "32MiB"})
    n = 24 * MiB
    a_bytes, b_bytes = filled(n, 0xA5), filled(n, 0x5B)
    with Client(d.address, transport="inline") as c:
        r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=_header("a", [a_bytes]), tier="host",
                                                         data_channel=True))
        s = slow_reader(d)
        data = memoryview(a_bytes.numpy())
        # 1. The first half arrives in its own frame; the client then releases the reservation.
        s.sendall(REQUEST.pack(MAGIC, VERSION, PUT, r.token, n) + CHUNK.pack(n // 2) + data[: n // 2])
        assert wait_until(lambda: d.engine.leases._leases[r.lease_id].received == n // 2)
        assert c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=r.lease_id)).released
        # 2. "b" takes the freed slots; the PUT's second half must not land in them.
        c.park("b", [b_bytes])
        try:
            s.sendall(CHUNK.pack(n - n // 2) + data[n // 2:])
            err: object = read_status(s)
        except OSError as e:
            err = e  # refused and closed with our bytes unread: the reset may beat the status
        assert isinstance(err, (LeaseExpired, ConnectionError)), err
        s.close()
        assert torch.equal(c.restore("b")[0], b_bytes)
        assert c.present(["a"]) == [False]
    settled(d)


def test_a_transfer_cannot_take_over_a_lease_past_its_deadline(tmp_path) -> None:
    """The reaper picks expired leases, then ends them: a GET that took one over in
    between would stream slots the reaper frees. So a lease past its deadline is never
    taken over, reaped or not; and the reaper ends only leases still expired when it
    gets to them. (A real engine whose maintenance thread is not started: the test is
    the reaper.)"""
    eng = Engine(make_config(tmp_path, **{"leases.ttl_s": 2.0}))
    try:
        spec = _spec(_header("x", [filled(3 * MiB, 7)]))
        r = eng.reserve(spec, inline=True)
        eng.write_chunk(r.lease_id, 0, memoryview(bytes(3 * MiB)))
        eng.commit(r.lease_id, expect_nbytes=3 * MiB)
        held = eng.acquire("x")
        assert held.lease is not None
        assert eng.leases.hold(held.lease_id) is held.lease  # taken over in time: no deadline now
        late = eng.acquire("x")
        assert late.lease is not None
        assert wait_until(lambda: time.monotonic() > late.lease.expires_at)  # type: ignore[union-attr, operator]
        assert eng.leases.hold(late.lease_id) is None
        eng.leases.reap()
        assert eng.stat().leases == 1  # the held one stays, with its reader
        eng.release(held.lease_id)
        eng.check_invariants()
    finally:
        eng.close(flush=False)


class AbortFailsOnce(DiskStore):
    """The first staged abort fails as LMDB does on a failing file system (EIO, EROFS):
    its write transaction cannot be opened. Every other call is the real store's."""

    failed = 0

    def stage_abort(self, m: Any) -> None:
        if self.failed:
            return super().stage_abort(m)
        self.failed += 1
        real = self.env
        self.env = _NoWrites(real)
        try:
            super().stage_abort(m)
        finally:
            self.env = real


class _NoWrites:
    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, *args: Any, write: bool = False, **kw: Any) -> Any:
        if write:
            raise lmdb.ReadonlyError("mdb_txn_begin: Read-only file system")
        return self._env.begin(*args, **kw)


def test_a_windowed_park_whose_abort_fails_still_frees_its_slots(daemon: Callable[..., Daemon]) -> None:
    """Aborting a windowed park deletes what it staged on disk; when that delete fails,
    the lease still ends and its window slots go back to the tier (the staged records
    are deleted at the next start), so the tier is not short of them until a restart."""
    d = daemon(disk_factory=AbortFailsOnce, **{"tiers.host.capacity": "16MiB"})
    assert d.engine is not None
    host = d.engine.tiers["host"].alloc
    big = filled(24 * MiB, 3)  # larger than the host tier: parked through windows
    with Client(d.address, transport="inline") as c:
        # 1. A shm-style windowed reservation holds its window slots; the client gives up.
        r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=_header("w", [big]), tier="host"))
        assert r.window_size > 0 and host.free_bytes < host.capacity
        try:
            c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=r.lease_id))
        except Unavailable:
            pass  # the failed delete may be reported; the lease must end either way
        assert d.engine.disk.failed == 1  # type: ignore[attr-defined]
        # 2. The lease is over and every window slot is free again.
        assert d.engine.stat().leases == 0
        assert host.free_bytes == host.capacity
        # 3. A park that needs the whole tier lands at once, and the accounting is exact.
        c.park("full", [filled(16 * MiB, 9)])
        assert torch.equal(c.restore("full")[0], filled(16 * MiB, 9))
        assert c.present(["w"]) == [False]
    settled(d)


def test_a_trickled_put_frame_neither_stalls_the_reaper_nor_holds_its_lease_forever(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    """A PUT frame that arrives a byte at a time (each recv well inside the idle limit)
    holds its lease's copy lock while it lands. The reaper must not wait on it (every
    other lease would stop expiring, and no demotion would run), and the frame as a whole
    gets the idle limit, not each recv."""
    monkeypatch.setattr(datachannel, "IDLE_S", 3.0)  # the channel's stall limit, shorter for the test
    d = daemon(**{"tiers.host.capacity": "32MiB", "leases.ttl_s": 0.5})
    small = filled(2 * MiB, 4)
    with Client(d.address, transport="inline") as c:
        c.park("probe", [small])
        r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=_header("t", [small]), tier="host",
                                                         data_channel=True))
        s = slow_reader(d)
        s.sendall(REQUEST.pack(MAGIC, VERSION, PUT, r.token, 2 * MiB) + CHUNK.pack(2 * MiB) + b"\1")
        assert wait_until(lambda: d.engine.leases._leases[r.lease_id].lock.locked())
        # 1. A lease nobody uses expires meanwhile: the reaper is not stuck behind the frame.
        probe = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="probe", tier="host"))
        sent = [0]

        def trickle() -> bool:
            try:
                s.sendall(b"\1")
                sent[0] += 1
            except OSError:
                return True  # the daemon gave up on the frame and closed
            return False

        assert wait_until(lambda: trickle() or probe.lease_id not in d.engine.leases._leases,
                          timeout=30.0, interval=0.25)
        assert probe.lease_id not in d.engine.leases._leases
        # 2. The frame itself is bounded: the daemon ends the transfer, aborts the
        #    reservation, and the trickle finds the connection closed.
        assert wait_until(trickle, timeout=60.0, interval=0.25)
        s.close()
        assert wait_until(lambda: r.lease_id not in d.engine.leases._leases)
        assert c.present(["t"]) == [False]
    settled(d)


def test_a_data_channel_park_commits_only_whole_however_many_tokens_were_issued(
        daemon: Callable[..., Daemon]) -> None:
    """Frames keep a reservation alive past its token's deadline; once more than a few
    hundred other tokens have been issued, the token table forgets expired entries. The
    commit's "every byte arrived" check must not forget with it: 24 KiB of 2 MiB is never
    published."""
    d = daemon(**{"tiers.host.capacity": "32MiB", "leases.ttl_s": 2.0})
    x = filled(2 * MiB, 6)
    with Client(d.address, transport="inline") as c:
        r = reserve_dc(c, "x", [x])
        token_deadline = time.monotonic() + 2.0
        s = slow_reader(d)
        s.sendall(REQUEST.pack(MAGIC, VERSION, PUT, r.token, 2 * MiB))

        def frame() -> bool:  # 8 KiB, which also pushes the reservation's deadline back
            s.sendall(CHUNK.pack(8 << 10) + bytes(8 << 10))
            return time.monotonic() > token_deadline + 0.5

        # 1. The reservation outlives its token: three frames, and time passes.
        assert wait_until(frame, timeout=30.0, interval=0.25)
        assert wait_until(lambda: frame() and d.engine.leases._leases[r.lease_id].received >= 24 << 10,
                          interval=0.25)
        # 2. 257 more reservations' tokens, then the commit of the partial park.
        tiny = [filled(1000, 1)]
        for i in range(257):
            assert reserve_dc(c, f"tiny-{i}", tiny).token
        frame()
        with pytest.raises(InvalidArgument, match="commit after"):
            c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
        s.close()
        assert c.present(["x"]) == [False]
    settled(d)
