"""Behaviour that a mutation-testing pass found unguarded (``docs/testing.md``, ``make
mutate``): each test here fails with one planted bug and passes on the tree.

Real daemons and engines, real LMDB in temp dirs, a real Redis; nothing of the project's
own is mocked.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError, NotFound
from kvpark.client.client import _header
from kvpark.daemon import reads
from kvpark.daemon.engine import Engine
from kvpark.daemon.mover import Mover
from kvpark.daemon.server import Daemon
from kvpark.daemon.servicer import _spec
from kvpark.tiers.disk import DiskStore

from ..conftest import make_config, wait_until
from ..redis_servers import RedisServer

MiB = 1 << 20
_ns = itertools.count()


def _blob(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_a_read_lease_already_ended_by_its_restore_is_not_ended_again(tmp_path: Path) -> None:
    """``LeaseTable.end`` answers False for a lease someone else ended first. A restore
    that fails after leasing its parts ends its lease itself (``end_read``: its readers
    go, it leaves the table); shutdown's ``close()`` or the reaper may have picked it up
    from the table just before. Their ``end`` must then be a no-op that says so: the
    reaper counts a lease expired (metrics, the tenant's quota settling) only on True.
    (A real engine whose maintenance thread is not started: the test plays both.)"""
    eng = Engine(make_config(tmp_path))
    try:
        data = _blob(1, 3 * MiB)
        r = eng.reserve(_spec(_header("x", [data])), inline=True)
        eng.write_chunk(r.lease_id, 0, memoryview(data.numpy()))
        eng.commit(r.lease_id, expect_nbytes=3 * MiB)
        h = eng.acquire("x")
        lease = h.lease
        assert lease is not None and eng.stat().leases == 1
        with eng.catalog.lock:
            eng.leases.end_read(lease)  # what a failing restore does with its own lease
        assert eng.stat().leases == 0
        assert eng.leases.end(lease) is False  # a second end: nothing left to end
        assert eng.release(h.lease_id) is False
        eng.check_invariants()
    finally:
        eng.close(flush=False)


def test_remote_blocks_splits_the_remote_copy_into_the_manifests_blocks(
        daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    """``reads.remote_blocks`` serves a disk part whose copy left for Redis between the
    lease and the read: it must yield exactly the manifest's blocks, in order, each its
    recorded length (the stream regroups them by payload offset). A payload of two full
    slots and a short tail, so every block's offset and length count."""
    ns = f"gap{os.getpid()}-{next(_ns)}"
    d = daemon(**{"tiers.remote.url": redis_server.url, "tiers.remote.namespace": ns,
                  "tiers.remote.write": "write_through", "tiers.remote.timeout_s": 5.0})
    assert d.engine is not None and d.engine.remote is not None
    data = _blob(2, 2 * MiB + 12345)
    with Client(d.address, transport="inline") as c:
        c.park("x", [data])
        assert wait_until(lambda: (st := c.stat().remote) is not None and st.pending_writes == 0, timeout=30)
    with d.engine.catalog.lock:
        seq = d.engine.catalog.get("x")
        assert seq.on_remote
        m = seq.manifest
    assert len(m.block_lengths) == 3
    blocks = [bytes(b) for b in reads.remote_blocks(d.engine, m)]
    assert [len(b) for b in blocks] == list(m.block_lengths)
    assert b"".join(blocks) == data.numpy().tobytes()


class _HeldPromotions(DiskStore):
    """Holds each promotion's disk read (``Mover._promote_locked`` opening its read
    transaction) until the test lets it go, while ``hold`` is set; the read then runs as
    shipped. Nothing else is held: no other caller reads the disk in the test below."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.arrivals: queue.Queue[threading.Event] = queue.Queue()
        self.hold = True

    def read_txn(self):  # type: ignore[no-untyped-def]
        if self.hold and sys._getframe(1).f_code.co_name == "_promote_locked":
            go = threading.Event()
            self.arrivals.put(go)
            go.wait(60)
        return super().read_txn()


def _to_disk(c: Client, seq_id: str) -> None:
    """Push ``seq_id`` out of the host tier (write-back: its demotion writes it to disk),
    then drop the fillers that pushed it: the host tier has room again for a promotion
    (one that finds none serves the restore from disk, without promoting)."""
    n = 0
    while c.info(seq_id).tier != "disk":
        assert n < 40, f"{seq_id!r} still in memory after {n} fillers"
        c.park(f"fill{n}", [torch.full((2 * MiB,), 1, dtype=torch.uint8)], overwrite=True)
        n += 1
    for i in range(n):
        c.drop(f"fill{i}")
    assert wait_until(lambda: c.stat().tiers["host"].used_bytes <= 4 * MiB, timeout=30)


def test_a_restore_overwritten_on_every_try_answers_not_found(daemon: Callable[..., Daemon]) -> None:
    """A restore whose version an overwrite replaces while it promotes it from disk tries
    the current version again, ``reads.REPLACED_RETRIES`` times in all; past them the last
    error stands: the caller gets NOT_FOUND ("dropped or overwritten during the
    restore"), not an internal error. Each try is held at its disk read while the test
    overwrites the id and pushes the new version to disk, so every try meets an overwrite."""
    # The seam recognises a promotion by its function's name: renamed, say so now, not after a timeout.
    assert hasattr(Mover, "_promote_locked"), "Mover._promote_locked was renamed: update _HeldPromotions"
    d = daemon(disk_factory=_HeldPromotions, **{"tiers.host.capacity": "8MiB", "policy.restore_to": "host"})
    assert d.engine is not None
    disk = d.engine.disk
    assert isinstance(disk, _HeldPromotions)
    out: dict[str, object] = {}
    with Client(d.address, transport="inline") as c, Client(d.address, transport="inline") as reader:
        c.park("s", [_blob(100, 2 * MiB)])
        _to_disk(c, "s")

        def restore() -> None:
            try:
                out["got"] = reader.restore("s", timeout=120)
            except KVParkError as e:
                out["err"] = e

        t = threading.Thread(target=restore)
        t.start()
        try:
            for k in range(reads.REPLACED_RETRIES):
                go = disk.arrivals.get(timeout=60)  # try k is at its disk read
                c.park("s", [_blob(101 + k, 2 * MiB)], overwrite=True)
                _to_disk(c, "s")  # so the next try promotes from disk again
                go.set()
        finally:
            if t.is_alive() and not disk.arrivals.empty():  # failed above: let a held try go
                disk.hold = False
                disk.arrivals.get().set()
        t.join(120)
        assert not t.is_alive()
        assert disk.arrivals.empty()  # no try past the last
        disk.hold = False
        err = out.get("err")
        assert isinstance(err, NotFound), f"restore answered {out}"
        assert "overwritten during the restore" in str(err)
        # The id holds the last overwrite, whole.
        (got,) = c.restore("s")
        assert torch.equal(got, _blob(100 + reads.REPLACED_RETRIES, 2 * MiB))
    d.engine.check_invariants()


def test_a_shm_park_into_a_fragmented_arena_lands_every_block_in_place(daemon: Callable[..., Daemon]) -> None:
    """The host arena is fragmented (free slots 1, 4 and 5 only), so a 3-slot park over
    shared memory gets two segments, one of them two slots long. The client writes through
    the grant's segments: a segment merged wrongly puts a block at another's offset, and
    the restore (inline, read by the daemon at the allocation's own offsets) then differs."""
    # No background demotion below a full arena: it would move the fillers and free slots.
    d = daemon(**{"tiers.host.capacity": "16MiB", "policy.write": "write_back", "policy.max_dirty_s": 0,
                  "policy.high_watermark": 1.0, "policy.low_watermark": 0.95})
    assert d.engine is not None
    with Client(d.address, transport="inline") as c:
        for i in range(10):
            c.park(f"one{i}", [_blob(200 + i, MiB)])  # slots 0..9
        for i in (1, 4, 5):
            c.drop(f"one{i}")
        c.park("big", [_blob(300, 6 * MiB)])  # the one run that holds it: slots 10..15
    data = _blob(400, 3 * MiB)
    with Client(d.address, transport="shm") as c:
        c.park("frag", [data])
    with d.engine.catalog.lock:
        seq = d.engine.catalog.get("frag")
        slots = [o // MiB for o, _ in seq.res["host"].extents]
    assert slots == [1, 4, 5], f"the arena was not fragmented as planned: {slots}"
    with Client(d.address, transport="inline") as c:
        (got,) = c.restore("frag")
        assert torch.equal(got, data)
        for i in (0, 2, 3, 6, 7, 8, 9):
            assert torch.equal(c.restore(f"one{i}")[0], _blob(200 + i, MiB))
        assert torch.equal(c.restore("big")[0], _blob(300, 6 * MiB))


def test_the_disk_invariants_catch_an_index_entry_lmdb_does_not_back() -> None:
    """``check_disk`` (what ``check_invariants`` asks of the disk, after every attack test)
    fails for each way the index can claim a disk copy LMDB does not hold: no manifest, a
    manifest of another generation, a missing block record."""
    from kvpark.daemon.commit import check_disk
    from kvpark.daemon.model import ParkSpec, Seq
    from kvpark.proto.layout import TensorMeta
    from kvpark.tiers.disk import Scan

    spec = ParkSpec("x", (TensorMeta("uint8", (3 * MiB,), 3 * MiB),), 3 * MiB)
    m1, m2 = spec.manifest(1, MiB), spec.manifest(2, MiB)
    assert len(m1.block_lengths) == 3
    s = Seq(manifest=m2, on_disk=True)
    blocks = {("x", m2.key_gen): {0, 1, 2}}
    check_disk([s], Scan({"x": m2}, blocks, set()), set(), True)  # agreed: no error
    with pytest.raises(AssertionError, match="indexed on disk, no manifest in LMDB"):
        check_disk([s], Scan({}, {}, set()), set(), True)
    with pytest.raises(AssertionError, match="indexed generation 2, LMDB's manifest 1"):
        check_disk([s], Scan({"x": m1}, {("x", m1.key_gen): {0, 1, 2}}, set()), set(), True)
    with pytest.raises(AssertionError, match="LMDB holds blocks"):
        check_disk([s], Scan({"x": m2}, {("x", m2.key_gen): {0, 2}}, set()), set(), True)


def test_the_index_invariants_catch_expiry_candidates_out_of_step(tmp_path: Path) -> None:
    """``check_invariants`` fails when the index's list of sequences with a TTL (or shared
    blocks), which expiry walks instead of the whole index, misses one or holds a stranger."""
    eng = Engine(make_config(tmp_path))
    try:
        data = _blob(5, 4096)
        h = _header("ttl", [data])
        h.ttl_s = 3600
        r = eng.reserve(_spec(h), inline=True)
        eng.write_chunk(r.lease_id, 0, memoryview(data.numpy()))
        eng.commit(r.lease_id, expect_nbytes=4096)
        eng.check_invariants()
        with eng.catalog.lock:
            seq = eng.catalog.get("ttl")
            del eng.catalog._special[seq]  # expiry would never see it
        with pytest.raises(AssertionError, match="expiry candidates out of step with the index"):
            eng.check_invariants()
        with eng.catalog.lock:
            eng.catalog._special[seq] = None
        eng.check_invariants()
    finally:
        eng.close(flush=False)


def test_a_small_restore_from_disk_is_answered_inline_without_a_promotion(daemon: Callable[..., Daemon]) -> None:
    """An Acquire asking for a memory tier, of a payload of at most its ``inline_max``
    (here exactly that), is answered inline: with ``promote_on_restore`` off, the sequence
    stays where it was (disk) and is not staged on host for the answer. One byte more
    needs the tier, and is staged there."""
    import grpc

    from kvpark.proto.v1 import kvpark_pb2 as pb

    d = daemon(**{"tiers.host.capacity": "8MiB", "policy.promote_on_restore": False})
    with Client(d.address, transport="inline") as c, grpc.insecure_channel(d.address) as ch:
        acquire = ch.unary_unary("/kvpark.v1.KVPark/Acquire", request_serializer=pb.AcquireRequest.SerializeToString,
                                 response_deserializer=pb.AcquireResponse.FromString)
        for sid, n in (("at", 64 << 10), ("past", (64 << 10) + 1)):
            c.park(sid, [_blob(8, n)])
            _to_disk(c, sid)
            r = acquire(pb.AcquireRequest(seq_ids=[sid], tier="host", inline_max=64 << 10), timeout=30)
            if r.lease_id:
                c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=r.lease_id))
            if sid == "at":
                assert r.inlined and bytes(r.data) == _blob(8, n).numpy().tobytes()
                assert c.info(sid).tier == "disk"
            else:
                assert not r.inlined and c.info(sid).tier == "host"


def test_the_invariants_hold_write_through_to_every_sequence_on_disk(tmp_path: Path) -> None:
    """Under write_through, with no disk eviction yet, ``check_invariants`` fails for an
    acknowledged sequence the index does not hold on disk."""
    eng = Engine(make_config(tmp_path, **{"policy.write": "write_through"}))
    try:
        data = _blob(6, 4096)
        r = eng.reserve(_spec(_header("wt", [data])), inline=True)
        eng.write_chunk(r.lease_id, 0, memoryview(data.numpy()))
        eng.commit(r.lease_id, expect_nbytes=4096)
        eng.check_invariants()
        with eng.catalog.lock:  # the disk copy lost behind the index's back, and the index told
            seq = eng.catalog.get("wt")
            eng.disk.delete(seq.manifest, sync=True)
            seq.on_disk = False
        with pytest.raises(AssertionError, match="wt: acknowledged under write_through, not on disk"):
            eng.check_invariants()
    finally:
        eng.close(flush=False)


def test_a_windowed_park_with_no_room_for_its_windows_leaves_nothing_staged(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    """A park larger than the host tier goes through windows staged on disk. When the host
    tier has no room even for the windows (every slot held by pinned sequences), the park
    is refused typed, and what it began staging on disk is aborted: nothing stays charged."""
    from kvpark.client import ResourceExhausted
    from kvpark.daemon import window

    monkeypatch.setattr(window, "ROOM_WAIT_S", 0.5)
    d = daemon(**{"tiers.host.capacity": "8MiB", "tiers.disk.capacity": "64MiB"})
    assert d.engine is not None
    with Client(d.address, transport="inline") as c:
        for i in range(8):
            c.park(f"pin{i}", [_blob(i, MiB)], pinned=True)
        with pytest.raises(ResourceExhausted, match="window"):
            c.park("big", [_blob(9, 20 * MiB)])
        assert d.engine.disk.staged == 0
        assert c.present(["big"]) == [False]
    d.engine.check_invariants()
