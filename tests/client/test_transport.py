"""Transport negotiation, the shared arena file, and leases that outlive their clients."""

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, InvalidArgument, TransportUnavailable
from kvpark.daemon.server import Daemon
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import wait_until

MiB = 1 << 20


def test_auto_picks_shm_on_the_same_host(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        assert c.transport == "shm"
    with Client(d.address, transport="inline") as c:
        assert c.transport == "inline"


def test_auto_falls_back_to_inline_and_forcing_shm_fails_clearly(daemon: Callable[..., Daemon],
                                                                 tmp_path: Path) -> None:
    d = daemon(**{"tiers.host.shm_dir": ""})  # private memory: the daemon runs without shm
    with Client(d.address) as c:
        assert c.transport == "inline"
        c.park("x", [torch.ones(3)])
        assert torch.equal(c.restore("x")[0], torch.ones(3))
    with pytest.raises(TransportUnavailable, match="no shared-memory arena"):
        Client(d.address, transport="shm")
    with pytest.raises(TransportUnavailable, match="cuda_ipc"):
        Client(d.address, transport="cuda_ipc")
    with pytest.raises(InvalidArgument, match="transport must be one of"):
        Client(d.address, transport="carrier-pigeon")


def test_arena_file_mode_and_removal(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        d = daemon()
    finally:
        os.umask(old)
    assert d.engine is not None
    path = Path(d.engine.arena.path)
    assert path.parent == tmp_path / "shm"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 16 * MiB
    d.stop()
    assert not path.exists()


CHILD = textwrap.dedent(
    """
    import signal, sys, torch
    from kvpark.client import Client
    from kvpark.proto.v1 import kvpark_pb2 as pb
    mode, address = sys.argv[1], sys.argv[2]
    c = Client(address, transport="shm")
    if mode == "park":
        h = pb.ParkHeader(seq_id="orphan", nbytes=4 << 20,
                          tensors=[pb.TensorMeta(dtype="uint8", shape=[4 << 20], nbytes=4 << 20)])
        r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=h))
        c._transport.pool[r.segments[0].offset : r.segments[0].offset + 100].fill_(7)  # a partial write
    elif mode == "restore":
        c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="held"))
    elif mode == "inline":
        c = Client(address, transport="inline")
        def slow():
            from kvpark.proto.wire import encode_chunk
            yield pb.ParkRequest(header=pb.ParkHeader(seq_id="orphan", nbytes=4 << 20, tensors=[
                pb.TensorMeta(dtype="uint8", shape=[4 << 20], nbytes=4 << 20)])).SerializeToString()
            yield encode_chunk(0, memoryview(b"x" * (1 << 20)))
            print("ready", flush=True)
            signal.pause()  # hold the stream open until the test kills this process
        c.rpc.park(slow(), timeout=600)
    print("ready", flush=True)
    signal.pause()  # hold the lease until the test kills this process
    """
)


@pytest.mark.parametrize("mode", ["park", "restore", "inline"])
def test_client_killed_mid_transfer_frees_everything(daemon: Callable[..., Daemon], mode: str) -> None:
    d = daemon(**{"leases.ttl_s": 1.0})
    with Client(d.address) as c:
        if mode == "restore":
            c.park("held", [torch.full((2 * MiB,), 3, dtype=torch.uint8)])
        base = c.stat().tiers["host"].used_bytes
        child = subprocess.Popen([sys.executable, "-c", CHILD, mode, d.address], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            # An inline child is "ready" once its chunk is sent, maybe before the server has
            # reserved: wait for the lease to exist, or "nothing held" below proves nothing.
            held = base + (0 if mode == "restore" else 4 * MiB)
            assert wait_until(lambda: c.stat().leases == 1 and c.stat().tiers["host"].used_bytes == held)
            child.kill()
            child.wait(30)
        finally:
            if child.poll() is None:
                child.kill()
        # Step: after the lease TTL (or the stream's cancellation) the daemon frees it all.
        assert wait_until(lambda: c.stat().leases == 0, timeout=15)
        assert c.stat().tiers["host"].used_bytes == base
        assert [s.seq_id for s in c.list()] == (["held"] if mode == "restore" else [])
        if mode == "restore":
            # The sequence that was leased is intact and can be demoted again.
            assert torch.equal(c.restore("held")[0], torch.full((2 * MiB,), 3, dtype=torch.uint8))


def test_leased_slots_survive_eviction_pressure(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        keep = torch.full((3 * MiB,), 9, dtype=torch.uint8)
        c.park("leased", [keep])
        lease = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="leased"))
        seg = lease.segments[0]
        for i in range(30):  # 30 MiB through a 16 MiB tier: everything else gets demoted
            c.park(f"p{i}", [torch.full((MiB,), i, dtype=torch.uint8)])
        assert c.info("leased").tier == "host"
        assert torch.equal(c._transport.pool[seg.offset : seg.offset + seg.length], keep[: seg.length])
        assert c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=lease.lease_id)).released
        assert not c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=lease.lease_id)).released
        for i in range(30, 45):
            c.park(f"p{i}", [torch.full((MiB,), i, dtype=torch.uint8)])
        assert c.info("leased").tier == "disk"
        assert torch.equal(c.restore("leased")[0], keep)


def test_expired_reservation_cannot_be_committed(daemon: Callable[..., Daemon]) -> None:
    from kvpark.client import LeaseExpired

    d = daemon(**{"leases.ttl_s": 0.2})
    with Client(d.address) as c:
        h = pb.ParkHeader(seq_id="late", nbytes=10, tensors=[pb.TensorMeta(dtype="uint8", shape=[10], nbytes=10)])
        r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=h))
        assert wait_until(lambda: c.stat().leases == 0)
        with pytest.raises(LeaseExpired):
            c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
        assert c.list() == []
