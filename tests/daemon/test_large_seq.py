"""Sequences larger than the host tier: parked to disk and restored through one window of
slots at a time, on every path; refused only past the disk's capacity; nothing of an
unfinished park is ever visible (aborted, expired, client killed, daemon killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client, InvalidArgument, NotFound, ResourceExhausted
from kvpark.client.client import _header
from kvpark.daemon.model import ParkSpec
from kvpark.daemon.server import Daemon
from kvpark.proto.layout import TensorMeta
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import Proc, wait_until

MiB = 1 << 20
HOST = 8 * MiB
# auto window: a quarter, 2 MiB. Disk grants off: over shm, a sequence on disk only would
# be read from the files without windows (tests/client/test_disk_grants.py), and the
# windows are the path under test here.
SMALL = {"tiers.host.capacity": "8MiB", "tiers.disk.direct_reads": "false"}


def big(seed: int, total: int = 3 * HOST + 12345) -> list[torch.Tensor]:
    """Mixed dtypes, odd sizes: about ``total`` bytes, random so any misplaced byte shows."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(total // 3 // 4, generator=g)  # float32
    b = torch.randn(total // 3 // 2, generator=g).to(torch.bfloat16)
    n = total - a.numel() * 4 - b.numel() * 2
    return [a, b, torch.randint(-128, 128, (n,), dtype=torch.int8, generator=g), torch.empty(0)]


def same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.numel() else x,
                                                                          y.view(torch.uint8) if y.numel() else y)
                                      for x, y in zip(xs, ys))


def blocks_on_disk(d: Daemon) -> int:
    disk = d.engine.disk
    with disk.env.begin() as txn:
        return int(txn.stat(disk.env.open_db(b"blocks", txn=txn))["entries"])


def quiet_and_empty(d: Daemon) -> None:
    """Nothing visible, no bytes charged, no records left, accounting intact."""
    assert wait_until(lambda: d.engine.leases.count == 0)
    assert d.engine.list() == []
    assert d.engine.disk.used == 0 and d.engine.disk.staged == 0
    # A version dropped while a restore read its disk copy loses its records once the
    # read is over: at the next maintenance pass (daemon/deletes.py).
    assert wait_until(lambda: blocks_on_disk(d) == 0)
    assert d.engine.tiers["host"].alloc.used_bytes == 0
    d.engine.check_invariants()


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_three_times_the_host_tier_parks_and_restores_bit_exact(daemon: Callable[..., Daemon],
                                                               transport: str) -> None:
    # 1. An 8 MiB host tier; a sequence of three times that (four tensors, one empty).
    d = daemon(**SMALL)
    data = big(1)
    nbytes = sum(t.numel() * t.element_size() for t in data)
    with Client(d.address, transport=transport) as c:
        # 2. The park streams to disk: it lands there, and the host tier holds nothing after.
        info = c.park("big", data)
        assert (info.tier, info.nbytes) == ("disk", nbytes)
        st = c.stat()
        assert st.tiers["disk"].used_bytes == nbytes and st.tiers["host"].used_bytes == 0
        # 3. Restored bit-exact into fresh tensors and into the caller's own.
        assert same(c.restore("big"), data)
        into = [torch.empty_like(t) for t in data]
        got = c.restore("big", into=into)
        assert same(into, data) and all(g is i for g, i in zip(got, into))
        # 4. Never promoted into a tier it cannot fit: still on disk, host empty.
        assert c.info("big").tier == "disk" and c.stat().tiers["host"].used_bytes == 0
        # 5. Over shm the restore holds one window of slots at a time (not the whole
        #    sequence, and not a fallback to the inline stream).
        if transport == "shm":
            r = c.restore("big", layerwise=True)
            i, first = next(r)
            assert i == 0 and torch.equal(first, data[0])
            # Two windows of 2 MiB: the one being copied, the next one read ahead.
            assert d.engine.tiers["host"].alloc.used_bytes == 2 * d.engine.windows.size_for("host") == 4 * MiB
            assert c.stat().leases == 1
            assert same([first] + [t for _, t in r], data)
        assert c.stat().leases == 0
    d.engine.check_invariants()


def test_one_message_parks_and_gets_larger_than_the_host_tier(daemon: Callable[..., Daemon]) -> None:
    # A 256 KiB host tier of 64 KiB slots under 1 MiB messages: a 900 KB sequence goes in
    # one ParkSmall (windowed inside the daemon) and comes back in one Get.
    d = daemon(**{"tiers.host.capacity": "256KiB", "tiers.host.slot_size": "64KiB"})
    data = big(14, 900_000)
    with Client(d.address, transport="inline") as c:
        assert c.park("mid", data).tier == "disk"
        assert same(c.restore("mid"), data)
    with Client(d.address, transport="shm") as c:
        assert same(c.restore("mid"), data)
    d.engine.check_invariants()


def test_restore_many_with_a_windowed_sequence(daemon: Callable[..., Daemon]) -> None:
    # Several ids under one lease, one of them larger than the host tier: the payload
    # cannot be staged in host, so the shm client streams it (as for any such payload).
    d = daemon(**SMALL)
    with Client(d.address, transport="shm") as c:
        c.park("big", big(13))
        c.park("small", [torch.arange(300_000)])
        info, got = c.restore_many(["small", "big"])
        assert info.nbytes == 300_000 * 8 + sum(t.numel() * t.element_size() for t in big(13))
        assert same(got, [torch.arange(300_000)] + big(13))
        assert c.stat().leases == 0
    d.engine.check_invariants()


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_larger_than_the_disk_is_refused_with_the_sizes(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon(**SMALL, **{"tiers.disk.capacity": "16MiB"})
    with Client(d.address, transport=transport) as c:
        with pytest.raises(ResourceExhausted, match=r"larger than the host tier \(8388608 bytes\) and than the disk "
                                                    r"tier \(16777216 bytes\)"):
            c.park("huge", big(2))
        # The daemon stays up and nothing of it is visible or charged.
        c.park("small", [torch.ones(1000)])
        c.drop("small")
    quiet_and_empty(d)


def test_a_disk_without_room_refuses_under_refuse(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**SMALL, **{"tiers.disk.capacity": "40MiB", "policy.disk_full": "refuse"})
    with Client(d.address, transport="shm") as c:
        c.park("one", big(3))
        with pytest.raises(ResourceExhausted, match="does not fit on disk"):
            c.park("two", big(4))
        assert [s.seq_id for s in c.list()] == ["one"]
        assert same(c.restore("one"), big(3))
    d.engine.check_invariants()


def test_drop_and_overwrite_free_the_disk_bytes(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**SMALL)
    with Client(d.address, transport="shm") as c:
        c.park("big", big(5))
        c.park("big", big(6, 2 * HOST + 7), overwrite=True)  # the old version's blocks go in the same commit
        assert c.stat().tiers["disk"].used_bytes == 2 * HOST + 7
        assert same(c.restore("big"), big(6, 2 * HOST + 7))
        c.park("big", [torch.ones(10)], overwrite=True)  # a small one replaces it
        assert c.stat().tiers["disk"].used_bytes == 0
        c.park("big", big(7), overwrite=True)
        assert c.drop("big")
        with pytest.raises(NotFound):
            c.restore("big")
    quiet_and_empty(d)


def _reserve(c: Client, seq_id: str, data: list[torch.Tensor]) -> pb.ReserveResponse:
    return c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=_header(seq_id, data), tier="host"))


def test_a_park_that_stops_midway_leaves_nothing(daemon: Callable[..., Daemon]) -> None:
    # A short lease TTL so that an abandoned park expires within the test.
    d = daemon(**SMALL, **{"leases.ttl_s": 1.0})
    data = big(8)
    with Client(d.address, transport="shm") as c:
        # 1. Windows must come in order, and a commit needs every window.
        r = _reserve(c, "half", data)
        assert r.window_size == 2 * MiB
        with pytest.raises(InvalidArgument, match="in order"):
            c.rpc.call(c.rpc.window, pb.WindowRequest(lease_id=r.lease_id, index=2))
        c.rpc.call(c.rpc.window, pb.WindowRequest(lease_id=r.lease_id, index=1))
        with pytest.raises(InvalidArgument, match="every window"):
            c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
        quiet_and_empty(d)
        # 2. A client that stops after two windows: its lease expires, what it staged goes.
        r = _reserve(c, "half", data)
        c.rpc.call(c.rpc.window, pb.WindowRequest(lease_id=r.lease_id, index=1))
        c.rpc.call(c.rpc.window, pb.WindowRequest(lease_id=r.lease_id, index=2))
        assert wait_until(lambda: blocks_on_disk(d) == 4) and d.engine.disk.staged > 0  # 2nd one in the background
        assert not c.present(["half"])[0]  # staged is not visible
        quiet_and_empty(d)
        # 3. A lease that is not windowed has no windows.
        small = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=_header("s", [torch.ones(MiB)]), tier="host"))
        with pytest.raises(InvalidArgument, match="not windowed"):
            c.rpc.call(c.rpc.window, pb.WindowRequest(lease_id=small.lease_id, index=1))
        c.rpc.release_quietly(small.lease_id)
    quiet_and_empty(d)


_KILLED_CLIENT = """
import sys, time, grpc, torch
from kvpark.client.client import _header
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import encode_chunk
data = [torch.ones(3 * 8 * 1024 * 1024 + 1, dtype=torch.uint8)]
def stream():
    yield pb.ParkRequest(header=_header("killed", data)).SerializeToString()
    view = memoryview(data[0].numpy())
    for off in range(0, 5 * 1024 * 1024, 1024 * 1024):  # two and a half windows, then hang
        yield encode_chunk(off, view[off:off + 1024 * 1024])
    print("sent", flush=True)
    time.sleep(600)
ch = grpc.insecure_channel(sys.argv[1])
ch.stream_unary("/kvpark.v1.KVPark/Park", request_serializer=lambda b: b,
                response_deserializer=pb.SeqInfo.FromString)(stream())
"""


def test_a_killed_inline_client_leaves_nothing(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**SMALL)
    p = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, d.address], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "sent"
        # Two windows reached the disk (staged), invisible.
        assert wait_until(lambda: blocks_on_disk(d) == 4)
        assert d.engine.list() == [] and d.engine.leases.count == 1
    finally:
        p.kill()
        p.wait(30)
    quiet_and_empty(d)


def test_the_lease_protects_a_windowed_restore(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**SMALL)
    data = big(9)
    with Client(d.address, transport="shm") as c:
        c.park("big", data)
        r = c.restore("big", layerwise=True)
        first = next(r)[1]
        # Disk eviction skips it while a reader holds it; a drop meanwhile takes it from
        # the index, yet the restore finishes from the version it leased.
        assert not d.engine.mover.evict_disk(d.engine.disk.capacity)
        assert c.info("big").tier == "disk"
        assert c.drop("big")
        assert same([first] + [t for _, t in r], data)
        with pytest.raises(NotFound):
            c.restore("big")
    quiet_and_empty(d)


def test_prefetch_leaves_it_on_disk(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**SMALL)
    with Client(d.address, transport="inline") as c:
        c.park("big", big(10))
        assert c.prefetch("big", tier="host") == "disk"
        with pytest.raises(ResourceExhausted, match=r"larger than the host tier \(8388608 bytes\): it stays on disk"):
            c.prefetch("big", tier="host", wait=True)
        assert c.stat().tiers["host"].used_bytes == 0
    d.engine.check_invariants()


def test_windows_through_the_device_pool(daemon: Callable[..., Daemon]) -> None:
    # The cuda_ipc path's logic on the CPU stand-in pool: a payload larger than the device
    # tier goes through device windows to disk, and reads back through them.
    d = daemon(**{"tiers.device.enabled": "true", "tiers.device.device": "cpu", "tiers.device.capacity": "4MiB"})
    e, n = d.engine, 10 * MiB + 3
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
    res = e.reserve(ParkSpec("dev", (TensorMeta("uint8", (n,), n),), n), tier="device")
    assert res.tier == "device" and res.window_size == MiB  # two windows of a quarter of the pool
    segs, k = res.segments, 0
    dev = e.tiers["device"]
    while True:
        pos = k * MiB
        for off, ln in segs:
            dev.write(off, memoryview(payload[pos:pos + ln].numpy()))
            pos += ln
        k += 1
        if k * MiB >= n:
            break
        segs = e.window(res.lease_id, k)
    assert e.commit(res.lease_id).tier == "disk"
    h = e.acquire("dev", need="device")
    g = e.grant(h)
    assert g.window_size == MiB
    out, segs, k = bytearray(), g.segments, 0
    while True:
        for off, ln in segs:
            out += dev.pool[off:off + ln].numpy().tobytes()
        k += 1
        if k * MiB >= n:
            break
        segs = e.window(g.lease_id, k)
    e.release(g.lease_id)
    assert bytes(out) == payload.numpy().tobytes()
    e.check_invariants()


def test_the_maintenance_thread_wakes_for_the_disk(daemon: Callable[..., Daemon]) -> None:
    # 1. Pinned sequences hold the disk past its high mark (0.9), every memory tier below
    #    its own: the maintenance thread's wake-up condition must still say "work to do".
    d = daemon(**{"tiers.disk.capacity": "8MiB", "policy.write": "write_through"})
    with Client(d.address, transport="inline") as c:
        for i in range(4):
            c.park(f"s{i}", [torch.full((2 * MiB - 100_000,), i, dtype=torch.uint8)], pinned=True)
        e = d.engine
        with e.catalog.lock:
            assert all(t.alloc.used_bytes <= 0.9 * t.alloc.capacity for t in e.tiers.values())
            assert e.disk.used > 0.9 * e.disk.capacity
            assert e.catalog.over_high()
        # 2. Unpinned, and no longer in memory, they are evicted from disk down to its low mark.
        for i in range(4):
            c.pin(f"s{i}", False)
        e.flush()
        assert wait_until(lambda: e.disk.used <= 0.8 * e.disk.capacity)
    e.check_invariants()


@pytest.mark.slow
def test_a_daemon_killed_midpark_shows_nothing_after_restart(tmp_path: Path) -> None:
    p = Proc.start(tmp_path, "--set", "tiers.host.capacity=8MiB")
    try:
        with Client(p.address, transport="shm") as c:
            r = _reserve(c, "crash", big(12))
            for k in (1, 2):  # two windows staged on disk
                c.rpc.call(c.rpc.window, pb.WindowRequest(lease_id=r.lease_id, index=k))
    finally:
        os.kill(p.popen.pid, signal.SIGKILL)
        p.popen.wait(30)
    p2 = Proc.start(tmp_path, "--set", "tiers.host.capacity=8MiB")
    with Client(p2.address) as c:
        assert c.list() == [] and c.stat().tiers["disk"].used_bytes == 0
    assert p2.terminate() == 0
    assert "unfinished windowed park" in p2.output()
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4)
    with env.begin() as txn:
        for name in (b"blocks", b"staging", b"manifests"):
            assert txn.stat(env.open_db(name, txn=txn))["entries"] == 0, name
    env.close()
