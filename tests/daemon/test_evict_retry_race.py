"""A queued (failed) eviction delete of a sequence still in memory is retried while a
flush would write that sequence's disk copy again under the same record keys: the flush
leaves it to a later pass (``Deletes.deleting`` counts the queued delete), so the retry
never deletes records the flush just wrote. Found by a fresh-eyes attack."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import lmdb
import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.disk_evict import disk_drop
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest, Write

from .disk_seams import crash_image

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class Seam(DiskStore):
    """``fail``: every transaction deleting "x"'s block records fails (EIO) while set.
    ``del_hold``: the next ``delete`` of "x" waits at ``del_gate`` (``del_entered``).
    ``w_hold``: the next write transaction of "x" waits at ``w_gate`` (``w_entered``)
    before it reserves or writes anything."""

    fail = False
    del_hold = False
    del_entered = threading.Event()
    del_gate = threading.Event()
    w_hold = False
    w_entered = threading.Event()
    w_gate = threading.Event()

    def delete(self, m: Manifest, sync: bool = False) -> None:
        cls = Seam
        if cls.del_hold and m.seq_id == "x":
            cls.del_hold = False
            cls.del_entered.set()
            assert cls.del_gate.wait(60), "the test never opened the delete gate"
        super().delete(m, sync=sync)

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        if Seam.fail and m.seq_id == "x":
            raise lmdb.Error("injected: EIO")
        super()._delete_blocks(txn, m)

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = Seam
        if cls.w_hold and any(w.manifest.seq_id == "x" for w in writes):
            cls.w_hold = False
            cls.w_entered.set()
            assert cls.w_gate.wait(60), "the test never opened the write gate"
        return super().write_many(writes, sync=sync)


@pytest.fixture
def seam():
    for e in (Seam.del_entered, Seam.del_gate, Seam.w_entered, Seam.w_gate):
        e.clear()
    Seam.fail = Seam.del_hold = Seam.w_hold = False
    yield Seam
    Seam.fail = Seam.del_hold = Seam.w_hold = False
    Seam.del_gate.set()
    Seam.w_gate.set()


def test_a_flush_rewriting_x_while_its_failed_eviction_delete_is_retried_keeps_x_on_disk(
        daemon: Callable[..., Daemon], seam: type[Seam], tmp_path: Path) -> None:
    """write_back. x (in memory and flushed) is evicted from disk; the delete fails and is
    queued with x's Seq. A flush of x passes ``deleting(x)`` (nothing under way) and is
    about to write. The retry takes the queued delete (x not on disk for the index yet),
    the flush's transaction commits, x is marked on disk, then the retry's generation-
    exact delete deletes the records and manifest the flush just wrote (same keys) and
    forgets the charge. x is indexed on disk with nothing in LMDB."""
    over = {"policy.flush_on_shutdown": "false"}
    d = daemon(disk_factory=seam, **over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
        c.park("other", [full(MiB, 3)])
        assert c.flush() == 2
        seam.fail = True
        assert disk_drop(eng.mover, "x")  # its delete failed: queued for the retry
        assert eng.deletes.pending >= 1
        seam.w_hold = True
        flushed: list[int] = []
        fl = threading.Thread(target=lambda: flushed.append(eng.flush()))
        fl.start()
        deadline = time.monotonic() + 30
        while not seam.w_entered.is_set() and fl.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        seam.fail = False  # the disk works again
        if seam.w_entered.is_set():
            # The flush writes x while its delete is queued: the retry's delete runs
            # between the flush's check and its transaction.
            seam.del_hold = True  # the next delete of x (a retry's), if any, waits at the gate
            rt = threading.Thread(target=eng.deletes.retry)
            rt.start()
            deadline = time.monotonic() + 30
            while not seam.del_entered.is_set() and rt.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)  # the retry deletes x (it is queued) or has nothing of x to do
            seam.w_gate.set()
            fl.join(30)
            seam.del_gate.set()
            rt.join(30)
        else:
            # The flush left x to a later pass (its delete is queued): the retry deletes
            # the old records, then a flush writes x again.
            fl.join(30)
            seam.w_gate.set()
            eng.deletes.retry()
            flushed.append(eng.flush())
        eng.deletes.retry()
        info = c.info("x")
        scan = eng.disk.scan()
        seq = eng.catalog.find("x")
        assert seq is not None
        on_disk = seq.on_disk
        image = crash_image(eng.disk, str(tmp_path / "crash"))
        try:
            eng.check_invariants()
            invariant = ""
        except AssertionError as e:
            invariant = str(e)
        # Memory pressure: x's memory copy goes, its disk copy being the index's.
        demoted = eng.mover.demote("x", "host")
        try:
            restored = [int(t[0]) for t in c.restore("x")]
        except Exception as e:  # noqa: BLE001
            restored = repr(e)
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, **over})
    with Client(d2.address) as c2:
        present = c2.present(["x", "other"])
    assert restored == [5] and not invariant and (not on_disk or "x" in scan.manifests), (
        f"restore of x after demote({demoted}): {restored}; flushed={flushed}, x.on_disk={on_disk}, tier={info.tier}, manifests={sorted(scan.manifests)}, "
        f"invariants: {invariant!r}; after a crash present(x, other)={present}")


def test_a_fetch_from_redis_never_writes_records_a_queued_delete_of_them_would_take(
        daemon: Callable[..., Daemon], seam: type[Seam], redis_server) -> None:
    """A disk eviction of x to Redis whose delete failed leaves that delete queued (x's own
    Seq, the same record keys as any later disk copy of x). A fetch of x from Redis onto
    the disk meanwhile takes that queued delete over (``Deletes.take_own``): its write
    replaces those records, and no retry deletes them after it."""
    from kvpark.daemon.disk_evict import disk_to_remote

    from .test_remote_tier import _new_ns, _remote

    over = {"policy.promote_on_restore": "false", **_remote(redis_server.url, _new_ns(), write="on_evict")}
    d = daemon(disk_factory=seam, **over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
        c.flush()
        assert eng.mover.demote("x", "host")  # its only copy on disk
        seam.fail = True
        disk_to_remote(eng.mover, "x")  # copied to Redis; the disk delete failed: queued
        seam.fail = False
        assert eng.deletes.pending >= 1 and c.info("x").tier == "remote"
        seq = eng.catalog.find("x")
        assert seq is not None
        # The fetch onto disk (a windowed restore's, or one of another slot size).
        eng.mover.fetch_remote(seq)
        assert seq.on_disk and eng.deletes.pending == 0  # the queued delete was taken over
        eng.deletes.retry()
        scan = eng.disk.scan()
        assert seq.on_disk and scan.manifests["x"].gen == seq.gen
        assert len(scan.records[("x", seq.manifest.key_gen)]) == len(seq.manifest.block_lengths)
        eng.check_invariants()
        assert eng.mover.demote("x", "host") or c.info("x").tier == "disk"
        assert [int(t[0]) for t in c.restore("x")] == [5]
        eng.check_invariants()
