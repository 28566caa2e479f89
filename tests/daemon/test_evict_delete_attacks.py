"""A disk eviction of a sequence that keeps another copy, attacked: a failed delete of its
disk copy, a drop after that failure, and a read lease granted while the eviction copies
it to Redis. Found by a fresh-eyes attack on the change that made such evictions delete
their records at once; each test failed on that change as first written."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import lmdb
import torch

from kvpark.client import Client
from kvpark.daemon.disk_evict import disk_drop, disk_to_remote
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

from .disk_seams import crash_image
from .test_crash_after_ack import assert_dropped, read_all, started, started_on

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class FailsOneDelete(DiskStore):
    """The next transaction deleting ``fail``'s block records fails (EIO): a real failed
    ``delete`` (its transaction aborted, the manifest and records left, the charge gone)."""

    fail = ""
    # Deletes of ``hold`` by the maintenance thread (its ``retry``) wait for ``gate``: the
    # crash is taken before that pass.
    hold = ""
    gate = threading.Event()

    def delete(self, m: Manifest, sync: bool = False) -> None:
        cls = type(self)
        if cls.hold and m.seq_id == cls.hold and threading.current_thread().name == "kvpark-maintain":
            assert cls.gate.wait(60), "the test never opened the gate"
        super().delete(m, sync=sync)

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        cls = type(self)
        if cls.fail and m.seq_id == cls.fail:
            cls.fail = ""
            raise lmdb.Error("injected: EIO")
        super()._delete_blocks(txn, m)


def records_of(d: Daemon, seq_id: str) -> list[tuple[str, int]]:
    assert d.engine is not None
    return [k for k in d.engine.disk.scan().records if k[0] == seq_id]


def test_a_drop_after_a_failed_eviction_delete_of_a_sequence_in_memory_leaves_nothing_a_crash_brings_back(
        daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """write_through: x is on disk and in memory. A disk eviction of x fails to delete its
    disk copy (the manifest stays in LMDB; x is in memory only for the index). A drop of x
    then deletes that manifest before it answers (it once answered with the manifest still
    in LMDB: a crash before the maintenance pass's retry brought the dropped version back)."""
    over = {"policy.write": "write_through", "policy.flush_on_shutdown": "false"}
    d, eng = started(daemon, disk_factory=FailsOneDelete, **over)
    try:
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            c.park("other", [full(MiB, 3)])
            FailsOneDelete.gate.clear()
            FailsOneDelete.fail = FailsOneDelete.hold = "x"
            assert disk_drop(eng.mover, "x")  # the failure is logged and retried later
            assert c.info("x").tier == "host"
            c.drop("x")  # acknowledged
        image = crash_image(eng.disk, str(tmp_path / "crash"))
        FailsOneDelete.gate.set()
        assert_dropped(started_on(daemon, image, **over), "x", kept="other")
    finally:
        FailsOneDelete.fail = FailsOneDelete.hold = ""
        FailsOneDelete.gate.set()


def test_a_failed_eviction_delete_of_a_sequence_still_in_memory_is_retried(
        daemon: Callable[..., Daemon]) -> None:
    """The failed delete is queued for ``retry``, which deletes the records of the live
    sequence (not on disk for the index) instead of taking it for its own twin and keeping
    them, charged to nobody, for as long as it lives in memory."""
    over = {"policy.write": "write_through", "policy.flush_on_shutdown": "false"}
    d, eng = started(daemon, disk_factory=FailsOneDelete, **over)
    try:
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            FailsOneDelete.fail = "x"
            assert disk_drop(eng.mover, "x")
            assert c.info("x").tier == "host"
            eng.deletes.retry()  # the maintenance pass
            eng.deletes.retry()
            assert not records_of(d, "x"), "x's records stay in LMDB after the retries"
            assert "x" not in eng.disk.scan().manifests
            assert eng.deletes.pending == 0
            eng.check_invariants()
    finally:
        FailsOneDelete.fail = ""


class HeldRead(DiskStore):
    """A read transaction opened by the thread named ``hold`` waits at ``gate`` once
    (``entered`` set) before it reads: the eviction's copy of a disk copy to Redis."""

    hold = ""
    entered = threading.Event()
    gate = threading.Event()

    def read_txn(self):  # type: ignore[override]
        cls = type(self)
        if cls.hold and threading.current_thread().name == cls.hold:
            cls.hold = ""
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
        return super().read_txn()


def test_a_disk_to_remote_eviction_that_a_read_lease_overtakes_leaves_no_records_behind(
        daemon: Callable[..., Daemon], redis_server) -> None:
    """A restore granted from the disk copy while the eviction copies it to Redis (a lease
    needs no move lock) pins that copy: the eviction checks readers again before it
    deletes, and takes nothing. It once deleted the manifest and kept the records for
    ever (``retry`` took the live sequence itself for a twin)."""
    from .test_remote_tier import _new_ns, _remote

    over = {"policy.promote_on_restore": "false",
            **_remote(redis_server.url, _new_ns(), write="on_evict")}
    HeldRead.entered.clear()
    HeldRead.gate.clear()
    d, eng = started(daemon, disk_factory=HeldRead, **over)
    try:
        with Client(d.address) as c:
            c.park("s", [full(MiB, 6)])
            c.flush()
            assert eng.mover.demote("s", "host")  # its only copy on disk
            out: list[bool] = []
            HeldRead.hold = "evictor"
            t = threading.Thread(target=lambda: out.append(disk_to_remote(eng.mover, "s")), name="evictor")
            t.start()
            assert HeldRead.entered.wait(30)
            h = eng.acquire("s", stream=True)  # granted from disk while the eviction copies it
            assert h.parts[0].tier == "disk" and h.lease is not None
            HeldRead.gate.set()
            t.join(30)
            assert read_all(eng, h) == b"\x06" * MiB  # the lease reads what it leased either way
            eng.release(h.lease.lease_id)
            eng.deletes.retry()
            eng.deletes.retry()
            # The lease pinned the disk copy: that eviction took nothing (Redis keeps its copy).
            assert out == [False] and c.info("s").tier == "disk" and records_of(d, "s")
            eng.check_invariants()
            assert disk_to_remote(eng.mover, "s")  # the lease over, the eviction goes through
            assert c.info("s").tier == "remote" and not records_of(d, "s") and not eng.disk.kept
            assert torch.equal(c.restore("s")[0], full(MiB, 6))
            eng.check_invariants()
    finally:
        HeldRead.hold = ""
        HeldRead.gate.set()
