"""The safety net under the engine: each test here fails on a bug the rest of the suite
could not see (docs/testing.md lists the mutation each one catches).

Everything goes through the client, the raw RPCs, or the engine's public methods
(``flush``, ``check_invariants``, ``disk``), so the tests hold across a split of the engine.
Faults and syncs are observed through the ``disk_factory`` seam: ``DiskStore`` subclasses,
never mocks; syncs by ``SyncObserver``, which overrides only ``sync()`` (``disk_seams.py``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import grpc
import pytest
import torch

from kvpark.client import AlreadyExists, Client, NotFound, ResourceExhausted
from kvpark.client.transport import Shm
from kvpark.daemon.model import ParkSpec
from kvpark.daemon.server import Daemon
from kvpark.proto import GRPC_OPTIONS
from kvpark.proto.errors import Internal
from kvpark.proto.layout import TensorMeta
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import decode_chunk
from kvpark.tiers.disk import DiskStore, Write

from ..conftest import run_threads, wait_until
from .disk_seams import SyncObserver

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def check(d: Daemon) -> None:
    assert d.engine is not None
    d.engine.check_invariants()


class FailsFor(SyncObserver):
    """Writes of the sequence named ``fail_id`` raise ``fail_with`` (set by the test)."""

    fail_id = "boom"
    fail_with: type[BaseException] = RuntimeError

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        if any(w.manifest.seq_id == self.fail_id for w in writes):  # the whole transaction fails
            raise self.fail_with(f"injected fault writing {self.fail_id!r}")
        return super().write_many(writes, sync=sync)


class ResourceFault(FailsFor):
    fail_id = "s"
    fail_with = ResourceExhausted


# ------------------------------------------------------------------ shared blocks


@pytest.mark.parametrize("resend", [False, True], ids=["refs-only", "resends-block"])
def test_overwrite_that_keeps_its_shared_block(daemon: Callable[..., Daemon], resend: bool) -> None:
    d = daemon()
    b, c_ = full(3000, 5), full(5000, 6)
    with Client(d.address) as c:
        c.park("s", [full(100, 1)], refs=["B"], new_blocks={"B": [b]})
        # Step: overwrite with a version that references the same block.
        c.park("s", [full(100, 2)], refs=["B"], new_blocks={"B": [b]} if resend else None, overwrite=True)
        assert c.info("B").refcount == 1
        out = c.restore("s")
        assert torch.equal(out[0], b) and torch.equal(out[1], full(100, 2))
        check(d)
        # Step: overwrite with a version that references another block: B goes with its last user.
        c.park("s", [full(100, 3)], refs=["C"], new_blocks={"C": [c_]}, overwrite=True)
        assert c.present(["B", "C"]) == [False, True]
        assert c.info("C").refcount == 1
        out = c.restore("s")
        assert torch.equal(out[0], c_) and torch.equal(out[1], full(100, 3))
        check(d)
        # Step: two sequences share C; dropping one keeps C, dropping both frees everything.
        c.park("t", [full(10, 4)], refs=["C"])
        assert c.info("C").refcount == 2
        c.drop("s")
        assert c.info("C").refcount == 1 and torch.equal(c.restore("t")[0], c_)
        c.drop("t")
        assert c.list() == [] and c.stat().tiers["host"].used_bytes == 0
        check(d)


class _FailsNextWrite(DiskStore):
    """The next ``write_many`` fails as an LMDB I/O error does (nothing written)."""

    armed = False

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        if _FailsNextWrite.armed:
            _FailsNextWrite.armed = False
            import lmdb

            raise self._write_error(lmdb.Error("mdb_txn_commit: Input/output error"))
        return super().write_many(writes, sync=sync)


def test_a_park_that_fails_after_taking_its_refs_gives_back_exactly_its_own(daemon: Callable[..., Daemon]) -> None:
    # A commit takes a reference on each shared block it names before its disk write;
    # when the write fails it gives back exactly those. Giving back more let the block go
    # with its last real user still parked: that user's restore then lost its prefix.
    _FailsNextWrite.armed = False
    d = daemon(disk_factory=_FailsNextWrite, **{"policy.write": "write_through"})
    b = full(3000, 5)
    with Client(d.address) as c:
        c.park("s1", [full(100, 1)], refs=["B"], new_blocks={"B": [b]})
        c.park("s2", [full(100, 2)], refs=["B"])
        assert c.info("B").refcount == 2
        _FailsNextWrite.armed = True
        with pytest.raises(Exception):  # the disk refused the write: Unavailable or ResourceExhausted
            c.park("s3", [full(100, 3)], refs=["B"])
        assert c.info("B").refcount == 2
        c.drop("s2")
        assert c.info("B").refcount == 1
        out = c.restore("s1")
        assert torch.equal(out[0], b) and torch.equal(out[1], full(100, 1))
        check(d)


# ------------------------------------------------------------------ read leases


def fill(c: Client, n: int, tag: int) -> None:
    for i in range(n):
        c.park(f"fill{tag}-{i}", [full(MiB, (i + 10) % 256)])


@pytest.mark.parametrize("action", ["drop", "overwrite"])
def test_shm_reader_keeps_its_bytes_until_release(daemon: Callable[..., Daemon], action: str) -> None:
    d = daemon()
    data = full(3 * MiB, 9)
    with Client(d.address, transport="shm") as c:
        assert isinstance(c._transport, Shm)
        c.park("s", [data])
        lease = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="s"))
        segs = [(s.offset, s.length) for s in lease.segments]

        def leased_bytes() -> torch.Tensor:
            assert isinstance(c._transport, Shm)
            return torch.cat([c._transport.arena.tensor[o : o + n] for o, n in segs])

        # Step: drop or overwrite it, then push more than the tier holds through it.
        if action == "drop":
            assert c.drop("s")
        else:
            c.park("s", [full(3 * MiB, 1)], overwrite=True)
        fill(c, 20, 0)
        assert torch.equal(leased_bytes(), data), "a leased copy was freed and reused under its reader"
        check(d)
        used = c.stat().tiers["host"].used_bytes
        # Step: the release frees the old copy, and only now can its slots be reused.
        assert c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=lease.lease_id)).released
        assert c.stat().tiers["host"].used_bytes <= used - 3 * MiB  # (background demotion may free more)
        check(d)
        if action == "overwrite":
            assert torch.equal(c.restore("s")[0], full(3 * MiB, 1))


@pytest.mark.parametrize("action", ["drop", "overwrite"])
def test_inline_reader_keeps_its_bytes_until_release(daemon: Callable[..., Daemon], action: str) -> None:
    # A payload larger than gRPC buffers ahead, so most chunks are read after the drop.
    d = daemon(**{"tiers.host.capacity": "64MiB"})
    data = torch.arange(24 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8)
    with Client(d.address, transport="inline") as c:
        c.park("s", [data])
        ch = grpc.insecure_channel(d.address, options=GRPC_OPTIONS)
        try:
            stream = ch.unary_stream("/kvpark.v1.KVPark/Restore", request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=lambda b: b)(pb.RestoreRequest(seq_id="s"), timeout=120)
            parts = [next(stream), next(stream)]  # the header, then the first chunk
            assert wait_until(lambda: c.stat().leases == 1)
            if action == "drop":
                assert c.drop("s")
            else:
                c.park("s", [full(MiB, 1)], overwrite=True)
            fill(c, 60, 0)  # more than the tier holds: freed slots would be reused
            parts.extend(stream)
        finally:
            ch.close()
        got = bytearray()
        for raw in parts[1:]:
            chunk = decode_chunk(raw)
            assert chunk is not None and chunk[0] == len(got)
            got += chunk[1]
        assert bytes(got) == data.numpy().tobytes(), "restored bytes changed under the stream"
        assert wait_until(lambda: c.stat().leases == 0)
        check(d)


# ------------------------------------------------------------------ disk accounting


def test_write_back_overwrite_frees_the_old_disk_copy(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    assert d.engine is not None
    with Client(d.address) as c:
        c.park("s", [full(MiB, 0)])
        d.engine.flush()
        assert c.stat().tiers["disk"].used_bytes == MiB
        # Step: churn: overwrite a sequence that has a disk copy, flush, again and again.
        for i in range(1, 40):
            c.park("s", [full(MiB, i)], overwrite=True)
            assert c.stat().tiers["disk"].used_bytes == 0  # the old copy went with the old version
            d.engine.flush()
            assert c.stat().tiers["disk"].used_bytes == MiB
        check(d)
        assert torch.equal(c.restore("s")[0], full(MiB, 39))
        # Step: an overwrite with a smaller sequence: disk usage follows the new size.
        c.park("s", [full(1000, 1)], overwrite=True)
        d.engine.flush()
        assert c.stat().tiers["disk"].used_bytes == 1000
        check(d)


# ------------------------------------------------------------------ two-phase commit


def test_two_reservations_of_one_id_exactly_one_commit_wins(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    n = 2 * MiB
    header = pb.ParkHeader(seq_id="s", nbytes=n, tensors=[pb.TensorMeta(dtype="uint8", shape=[n], nbytes=n)])
    with Client(d.address, transport="shm") as c:
        assert isinstance(c._transport, Shm)
        leases = [c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=header)) for _ in range(2)]
        for v, r in enumerate(leases, start=1):
            for s in r.segments:
                c._transport.arena.tensor[s.offset : s.offset + s.length].fill_(v)
        won: list[int] = []
        lost: list[BaseException] = []

        def commit(i: int) -> None:
            try:
                c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=leases[i].lease_id))
                won.append(i)
            except AlreadyExists as e:
                lost.append(e)

        assert run_threads([lambda: commit(0), lambda: commit(1)]) == []
        assert len(won) == 1 and len(lost) == 1
        assert torch.equal(c.restore("s")[0], full(n, won[0] + 1))
        assert c.stat().leases == 0 and c.stat().tiers["host"].used_bytes == n
        check(d)


# ------------------------------------------------------------------ write_through durability


def test_write_through_syncs_before_acknowledging(daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=SyncObserver, **{"policy.write": "write_through",
                                             "policy.flush_on_shutdown": False})
    assert d.engine is not None
    disk = d.engine.disk
    assert isinstance(disk, SyncObserver)
    blk = full(300 * 1024, 4)
    for transport in ("shm", "inline"):
        with Client(d.address, transport=transport) as c:
            for i, size in enumerate((1000, 3 * MiB)):  # one-message and streamed/reserved parks
                sid = f"{transport}{i}"
                c.park(sid, [full(size, i + 1)], refs=[f"B{transport}"], new_blocks={f"B{transport}": [blk]})
                # Step: everything the park wrote was covered by a sync before it returned.
                with disk.rec_lock:
                    assert sid in disk.durable and f"B{transport}" in disk.durable
                c.park(sid, [full(size, 7)], refs=[f"B{transport}"], overwrite=True)
                with disk.rec_lock:
                    assert disk.durable == disk.committed(), "acknowledged with unsynced writes"
    # Step: a stop without a flush keeps it all: shared blocks too.
    d.stop()
    d2 = daemon(**{"policy.write": "write_through"})
    with Client(d2.address) as c:
        assert sorted(s.seq_id for s in c.list()) == ["Binline", "Bshm", "inline0", "inline1", "shm0", "shm1"]
        for transport in ("shm", "inline"):
            out = c.restore(f"{transport}1")
            assert torch.equal(out[0], blk) and torch.equal(out[1], full(3 * MiB, 7))
        check(d2)


# ------------------------------------------------------------------ the reaper


def test_reaper_collects_a_shared_block_whose_sequence_failed(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    d = daemon(disk_factory=ResourceFault, **{"policy.write": "write_through", "leases.ttl_s": 0.5})
    assert d.engine is not None
    disk = d.engine.disk
    assert isinstance(disk, ResourceFault)
    with Client(d.address) as c:
        with pytest.raises(ResourceExhausted, match="injected"):
            c.park("s", [full(1000, 1)], refs=["B"], new_blocks={"B": [full(2 * MiB, 2)]})
        # Step: a block and its sequence are one transaction: the failed park left neither.
        with disk.rec_lock:
            assert "B" not in disk.durable
        assert c.list() == [] and c.stat().tiers["disk"].used_bytes == 0
        assert c.stat().tiers["host"].used_bytes == 0
        check(d)
    d.stop()
    # Step: a shared block whose sequence never came (on disk, referenced by nothing) is
    # collected after the lease TTL, memory and disk.
    store = DiskStore(str(tmp_path / "disk"), 256 * MiB)
    m = ParkSpec("B", (TensorMeta("uint8", (2 * MiB,), 2 * MiB),), 2 * MiB, shared=True).manifest(1 << 40, MiB)
    store.write(m, [memoryview(bytes(MiB)), memoryview(bytes(MiB))], sync=True)
    store.close()
    d2 = daemon(**{"leases.ttl_s": 0.5})
    with Client(d2.address) as c:
        assert wait_until(lambda: c.list() == [], timeout=30)
        assert wait_until(lambda: c.stat().tiers["disk"].used_bytes == 0)
        assert c.stat().tiers["host"].used_bytes == 0
        check(d2)


def test_ttl_expires_after_a_restart(daemon: Callable[..., Daemon]) -> None:
    ttl = 4.0
    d = daemon(**{"policy.write": "write_through"})
    with Client(d.address) as c:
        parked_at = time.time()
        c.park("short", [full(1000, 1)], ttl_s=ttl)
        c.park("keep", [full(1000, 2)])
    d.stop()
    d2 = daemon(**{"leases.ttl_s": 0.5})
    with Client(d2.address) as c:
        if time.time() < parked_at + ttl - 1:  # rebuilt from its manifest, deadline included
            assert c.present(["short", "keep"]) == [True, True]
        assert wait_until(lambda: c.present(["short"]) == [False], timeout=30)
        assert c.present(["keep"]) == [True]
        assert c.stat().tiers["disk"].used_bytes == 1000
        check(d2)


# ------------------------------------------------------------------ errors


def test_unexpected_exception_in_a_handler_is_internal_and_the_daemon_serves_on(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=FailsFor, **{"policy.write": "write_through"})
    for transport in ("shm", "inline"):
        with Client(d.address, transport=transport) as c:
            base = c.stat().tiers["host"].used_bytes
            for size in (1000, 3 * MiB):  # unary ParkSmall, then a reserved or streamed park
                with pytest.raises(Internal, match="RuntimeError: injected fault"):
                    c.park("boom", [full(size, 1)])
                assert c.stat().leases == 0 and c.stat().tiers["host"].used_bytes == base
                assert c.present(["boom"]) == [False]
            c.park("fine", [full(2 * MiB, 3)], overwrite=True)
            assert torch.equal(c.restore("fine")[0], full(2 * MiB, 3))
    check(d)


# ------------------------------------------------------------------ configuration


def test_restart_with_another_slot_size(daemon: Callable[..., Daemon]) -> None:
    a, b = torch.arange(3 * MiB + 777, dtype=torch.int64).remainder(253).to(torch.uint8), full(5000, 8)
    d = daemon(**{"policy.write": "write_through"})
    with Client(d.address) as c:
        c.park("a", [a])
        c.park("b", [b], refs=["B"], new_blocks={"B": [full(MiB, 3)]})
    d.stop()
    d2 = daemon(**{"tiers.host.slot_size": "256KiB"})
    for transport in ("shm", "inline"):
        with Client(d2.address, transport=transport) as c:
            assert torch.equal(c.restore("a")[0], a)
            out = c.restore("b")
            assert torch.equal(out[0], full(MiB, 3)) and torch.equal(out[1], b)
    with Client(d2.address) as c:
        c.park("c", [a[:MiB]])
        assert torch.equal(c.restore("c")[0], a[:MiB])
        c.drop("a")
        c.drop("b")
        assert c.present(["a", "b", "B", "c"]) == [False, False, False, True]
        assert c.stat().tiers["disk"].used_bytes == 0
        check(d2)


@pytest.mark.parametrize("eviction", ["lru", "lfu", "s3fifo", "arc"])
def test_every_eviction_policy_through_a_daemon(daemon: Callable[..., Daemon], eviction: str) -> None:
    d = daemon(**{"policy.eviction": eviction})
    with Client(d.address) as c:
        for i in range(30):  # 30 MiB through a 16 MiB host tier
            c.park(f"p{i}", [full(MiB, i)], priority=1 if i == 0 else 0)
            if i % 3 == 0:  # hits, so frequency- and recency-based orders differ
                assert torch.equal(c.restore("p0")[0], full(MiB, 0))
        st = c.stat()
        assert st.tiers["disk"].sequences > 0 and st.tiers["host"].used_bytes <= 16 * MiB
        for i in range(30):
            assert torch.equal(c.restore(f"p{i}")[0], full(MiB, i))
        with pytest.raises(NotFound):
            c.restore("missing")
        check(d)


def test_a_reserve_waiting_for_room_when_the_engine_closes_is_unavailable(daemon: Callable[..., Daemon]) -> None:
    """A park waiting for room (another reservation holds the tier) while the daemon
    shuts down gets UNAVAILABLE: before, the close took the tiers away under it and it
    died with a KeyError (an untyped INTERNAL)."""
    from kvpark.proto.errors import Unavailable

    MiB = 1 << 20
    d = daemon(**{"tiers.host.capacity": "4MiB"})
    eng = d.engine
    assert eng is not None

    def spec(sid: str) -> ParkSpec:
        return ParkSpec(sid, (TensorMeta("uint8", (3 * MiB,), 3 * MiB),), 3 * MiB)

    eng.reserve(spec("holder"))  # 3 of 4 MiB held by a reservation nobody commits
    got: list[BaseException] = []

    def waiter() -> None:
        try:
            eng.reserve(spec("waiter"))
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.5)  # the waiter is in its room wait by now (it waits up to 10 s)
    assert t.is_alive()
    eng.close(flush=False)
    t.join(30)
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], Unavailable), got
