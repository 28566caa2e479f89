"""Regression tests, each named after the bug it guards."""

import logging
import threading
from typing import Callable, Iterator

import grpc
import pytest
import torch

from kvpark.client import Client, FailedPrecondition, InvalidArgument, ResourceExhausted
from kvpark.daemon.model import ParkSpec
from kvpark.daemon.server import Daemon
from kvpark.proto import GRPC_OPTIONS
from kvpark.proto.errors import ERROR_KEY
from kvpark.proto.layout import TensorMeta
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import encode_chunk

from ..conftest import wait_until

MiB = 1 << 20


def spec(seq_id: str, n: int, **kw: object) -> ParkSpec:
    return ParkSpec(seq_id, (TensorMeta("uint8", (n,), n),), n, **kw)  # type: ignore[arg-type]


def test_aborted_park_frees_the_slots_of_its_new_blocks(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with grpc.insecure_channel(d.address, options=GRPC_OPTIONS) as ch:
        small = ch.unary_unary("/kvpark.v1.KVPark/ParkSmall", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.SeqInfo.FromString)
        block = pb.ParkHeader(seq_id="b", nbytes=MiB, tensors=[pb.TensorMeta(dtype="uint8", shape=[MiB], nbytes=MiB)])
        for _ in range(20):  # more than the tier holds, if any of it leaked
            with pytest.raises(grpc.RpcError) as e:
                small(pb.ParkSmallRequest(header=pb.ParkHeader(seq_id="", blocks=[block]), data=b"x" * (MiB + 1)),
                      timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(d.address) as c:
        assert c.stat().tiers["host"].used_bytes == 0
        # An explicit abort of a reservation that carries new blocks frees them too.
        header = pb.ParkHeader(seq_id="s", refs=["blk"], blocks=[pb.ParkHeader(
            seq_id="blk", shared=True, nbytes=MiB, tensors=[pb.TensorMeta(dtype="uint8", shape=[MiB], nbytes=MiB)])])
        r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=header))
        assert c.stat().tiers["host"].used_bytes == MiB
        c.rpc.release_quietly(r.lease_id)
        assert c.stat().tiers["host"].used_bytes == 0 and c.stat().leases == 0
    d.engine.check_invariants()


def test_failed_commit_after_a_deduplicated_block_frees_each_slot_once(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    e = d.engine
    assert e is not None
    blk = torch.ones(3000, dtype=torch.uint8)
    with Client(d.address) as c:
        c.park("s0", [torch.ones(1)], refs=["B"], new_blocks={"B": [blk]})  # B exists, shared
        c.park("p2", [torch.ones(3000, dtype=torch.uint8)])  # a plain sequence
        before = c.stat().tiers["host"].used_bytes
        with pytest.raises(FailedPrecondition, match="plain sequence"):
            c.park("x", [torch.ones(1)], refs=["B", "p2"], new_blocks={"B": [blk], "p2": [blk]})
        assert c.stat().tiers["host"].used_bytes == before
    e.check_invariants()  # the allocator charges exactly what the parked sequences hold


def test_a_sequence_cannot_reference_itself(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        with pytest.raises(InvalidArgument, match="itself"):
            c.park("X", [torch.ones(100, dtype=torch.uint8)], refs=["X"],
                   new_blocks={"X": [torch.ones(3000, dtype=torch.uint8)]})
        assert c.list() == [] and c.stat().tiers["host"].used_bytes == 0
    d.engine.check_invariants()


def test_restore_from_disk_racing_a_drop_reads_the_version_it_leased_not_data_loss(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"policy.promote_on_restore": False})
    e = d.engine
    assert e is not None
    with Client(d.address) as c:
        c.park("gone", [torch.ones(2 * MiB, dtype=torch.uint8)])
        for i in range(20):  # push it to disk
            c.park(f"f{i}", [torch.zeros(MiB, dtype=torch.uint8)])
        assert c.info("gone").tier == "disk"
    handle = e.acquire("gone", stream=True)
    assert handle.parts[0].tier == "disk"
    assert e.drop("gone")
    # The drop retired it; its disk records stay until the lease that reads them ends.
    got = b"".join(bytes(v) for _, views in e.iter_chunks(handle, MiB) for v in views)
    assert got == b"\x01" * (2 * MiB)
    assert handle.lease is not None
    e.release(handle.lease.lease_id)
    assert wait_until(lambda: e.deletes.pending == 0)  # deleted by the next maintenance pass
    e.check_invariants()


def test_stalled_inline_park_stream_expires(daemon: Callable[..., Daemon], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvpark.leases")
    # A TTL long enough to see the lease appear (polling under load), short enough to wait out.
    d = daemon(**{"leases.ttl_s": 1.5})
    sent, release = threading.Event(), threading.Event()

    def messages() -> Iterator[bytes]:
        yield pb.ParkRequest(header=pb.ParkHeader(seq_id="slow", nbytes=4 * MiB, tensors=[
            pb.TensorMeta(dtype="uint8", shape=[4 * MiB], nbytes=4 * MiB)])).SerializeToString()
        yield encode_chunk(0, memoryview(b"\x01" * MiB))
        sent.set()
        release.wait(30)  # stalls without closing the stream
        yield encode_chunk(MiB, memoryview(b"\x02" * MiB))

    ch = grpc.insecure_channel(d.address, options=GRPC_OPTIONS)
    call = ch.stream_unary("/kvpark.v1.KVPark/Park", request_serializer=lambda b: b,
                           response_deserializer=pb.SeqInfo.FromString)
    fut = call.future(messages(), timeout=60)
    try:
        assert sent.wait(10)
        with Client(d.address) as c:
            # Step: the server has reserved (nothing is held before it does), then the lease expires.
            assert wait_until(lambda: c.stat().leases == 1 and c.stat().tiers["host"].used_bytes == 4 * MiB)
            # The reaper says so: "no leases" alone also holds before the server has reserved.
            assert wait_until(lambda: any("write lease" in r.getMessage() and "expired" in r.getMessage()
                                          for r in caplog.records))
            assert wait_until(lambda: c.stat().leases == 0 and c.stat().tiers["host"].used_bytes == 0)
        release.set()
        with pytest.raises(grpc.RpcError) as err:
            fut.result(timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(err.value.trailing_metadata() or ())[ERROR_KEY] == "LeaseExpired"
    finally:
        release.set()
        ch.close()
    d.engine.check_invariants()


def test_pinned_full_host_tier_refuses_to_stage_a_disk_sequence(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"policy.promote_on_restore": False})
    e = d.engine
    assert e is not None
    with Client(d.address) as c:
        c.park("cold", [torch.ones(MiB, dtype=torch.uint8)])
        for i in range(30):
            c.park(f"f{i}", [torch.zeros(MiB, dtype=torch.uint8)])
        assert c.info("cold").tier == "disk"
        for s in c.list():
            if s.tier == "host":
                c.drop(s.seq_id)
        for i in range(16):
            c.park(f"pin{i}", [torch.zeros(MiB, dtype=torch.uint8)], pinned=True)
        with pytest.raises(ResourceExhausted):
            e.acquire("cold", need="host")
        # The client falls back to streaming it from disk.
        assert torch.equal(c.restore("cold")[0], torch.ones(MiB, dtype=torch.uint8))
    e.check_invariants()


def test_get_never_builds_more_than_one_message(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        c.park("big", [torch.zeros(3 * MiB, dtype=torch.uint8)])
        r = c.rpc.call(c.rpc.get, pb.GetRequest(seq_id="big", max_bytes=1 << 40))
        assert r.too_large and not r.data
        a = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="big", inline_max=1 << 40))
        assert not a.inlined and a.lease_id
        c.rpc.release_quietly(a.lease_id)
    d.engine.check_invariants()


def test_a_read_lease_past_its_deadline_is_never_taken_over_by_a_transfer(daemon: Callable[..., Daemon]) -> None:
    """The data channel takes a read lease over for its GET (``LeaseTable.hold``); a lease
    already past its deadline may be ending in the reaper right now, its slots about to be
    freed: it must be refused, never revived (a GET would then stream freed slots)."""
    import time as _time

    d = daemon(**{"leases.ttl_s": 60.0})
    e = d.engine
    assert e is not None
    with Client(d.address) as c:
        c.park("x", [torch.ones(1024)])
    h = e.acquire(["x"], need="host")
    assert h.lease_id
    live = e.leases.hold(h.lease_id)
    assert live is not None and live.expires_at is None  # taken over: no longer expires under the reader
    h2 = e.acquire(["x"], need="host")
    lease = e.leases._leases[h2.lease_id]
    lease.expires_at = _time.monotonic() - 1.0  # past its deadline, not yet reaped
    assert e.leases.hold(h2.lease_id) is None
    assert lease.expires_at is not None  # not revived
    e.release(h.lease_id)
    e.release(h2.lease_id)
