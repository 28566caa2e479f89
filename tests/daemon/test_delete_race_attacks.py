"""A drop racing a failed or retried delete of the same disk copy, and an overwrite refused
after its write committed: what a crash right after the answer leaves. Each test pins one
interleaving with a DiskStore seam (a call held or failed once), takes a crash image (what
SIGKILL leaves) and starts a daemon on it. Found by a fresh-eyes attack; each failed on
the code as it was then."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client, Unavailable
from kvpark.daemon.disk_evict import disk_drop
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

from .disk_seams import crash_image
from .test_crash_after_ack import assert_dropped, started_on

MiB = 1 << 20
WT = {"policy.write": "write_through", "policy.flush_on_shutdown": "false"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class FailedThenHeld(DiskStore):
    """``fail``: the next transaction deleting that id's block records fails (EIO), a real
    failed ``delete`` (transaction aborted, manifest and records left, charge forgotten).
    ``hold_after_fail``: that failed ``delete`` then waits at ``gate`` before its error
    reaches the caller. ``hold``: the next ``delete`` of that id (any thread) waits at
    ``gate`` before its transaction."""

    fail = ""
    hold_after_fail = False
    hold = ""
    entered = threading.Event()
    gate = threading.Event()

    def delete(self, m: Manifest, sync: bool = False) -> None:
        cls = type(self)
        if cls.hold and m.seq_id == cls.hold:
            cls.hold = ""
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
        try:
            super().delete(m, sync=sync)
        except Exception:
            if cls.hold_after_fail:
                cls.hold_after_fail = False
                cls.entered.set()
                assert cls.gate.wait(60), "the test never opened the gate"
            raise

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        cls = type(self)
        if cls.fail and m.seq_id == cls.fail:
            cls.fail = ""
            raise lmdb.Error("injected: EIO")
        super()._delete_blocks(txn, m)


def _reset() -> None:
    FailedThenHeld.fail = FailedThenHeld.hold = ""
    FailedThenHeld.hold_after_fail = False
    FailedThenHeld.entered.clear()
    FailedThenHeld.gate.clear()


def test_a_drop_while_a_retry_deletes_a_failed_eviction_copy_leaves_nothing_a_crash_brings_back(
        daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """write_through. x is on disk and in memory; a disk eviction of x fails to delete its
    disk copy (queued for ``retry``; x's manifest is still in LMDB). The maintenance
    pass's ``retry`` takes it out of the queue and starts its delete; while that delete
    waits for its transaction, the client drops x. The drop finds x neither on disk nor
    held nor queued (``_queued`` looks only at ``_undeleted``, not at what a retry holds)
    and answered at once, leaving x's manifest in LMDB (a SIGKILL then brought x back); a
    delete under way of the generation now counts too."""
    _reset()
    d = daemon(disk_factory=FailedThenHeld, **WT)
    eng = d.engine
    assert eng is not None
    t: threading.Thread | None = None
    try:
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            c.park("other", [full(MiB, 3)])
            FailedThenHeld.fail = "x"
            assert disk_drop(eng.mover, "x")  # its delete failed: queued for retry
            assert c.info("x").tier == "host"
            FailedThenHeld.hold = "x"  # the retry's delete of x waits before its transaction
            t = threading.Thread(target=eng.deletes.retry, name="test-retry")
            t.start()
            assert FailedThenHeld.entered.wait(30)
            assert c.drop("x")  # acknowledged
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    finally:
        FailedThenHeld.gate.set()
        if t is not None:
            t.join(30)
        _reset()
    assert_dropped(started_on(daemon, image, **WT), "x", kept="other")


def test_a_drop_just_after_an_eviction_delete_failed_leaves_nothing_a_crash_brings_back(
        daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """write_through. A disk eviction of x (x also in memory) fails to delete its disk
    copy. ``DiskStore.delete`` forgets the charge in its ``finally``, and only after that
    does ``Deletes.delete`` queue the record (``_undeleted``). A drop in between finds x
    neither held by the store nor queued, skips the unpublish, and is acknowledged with x's
    manifest in LMDB (a SIGKILL then brought x back). ``_busy`` still names x's generation
    at that moment, and the drop now looks at it."""
    _reset()
    d = daemon(disk_factory=FailedThenHeld, **WT)
    eng = d.engine
    assert eng is not None
    t: threading.Thread | None = None
    try:
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            c.park("other", [full(MiB, 3)])
            FailedThenHeld.fail = "x"
            FailedThenHeld.hold_after_fail = True
            t = threading.Thread(target=disk_drop, args=(eng.mover, "x"), name="test-evict")
            t.start()
            assert FailedThenHeld.entered.wait(30)  # failed, charge forgotten, not yet queued
            assert c.drop("x")  # acknowledged
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    finally:
        FailedThenHeld.gate.set()
        if t is not None:
            t.join(30)
        _reset()
    assert_dropped(started_on(daemon, image, **WT), "x", kept="other")


class FailsOneSync(DiskStore):
    """The next fsync, once armed, fails (EIO) after its write transaction committed."""

    armed = False

    def sync(self) -> None:
        if FailsOneSync.armed:
            FailsOneSync.armed = False
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()




@pytest.mark.parametrize("nbytes", [4096, 5 * MiB + 1], ids=["plain", "windowed"])
def test_a_refused_overwrite_whose_fsync_failed_keeps_the_version_it_would_have_replaced(
        daemon: Callable[..., Daemon], tmp_path: Path, nbytes: int) -> None:
    """write_through. x v1 is parked (on disk, acknowledged). An overwrite of x commits its
    write transaction (x's manifest in LMDB is now v2's: the write replaced the key), then
    its fsync fails: the overwrite is refused (UNAVAILABLE), and what it wrote goes with
    v1's manifest put back (``DiskStore.revert``). It once deleted v2's manifest and left
    none: v1, acknowledged and never dropped, was lost at the next start."""
    over = {**WT, "tiers.host.capacity": "4MiB"}
    d = daemon(disk_factory=FailsOneSync, **over)
    eng = d.engine
    assert eng is not None
    try:
        with Client(d.address, transport="inline") as c:
            c.park("x", [full(nbytes, 1)])
            c.park("other", [full(4096, 3)])
            FailsOneSync.armed = True
            with pytest.raises(Unavailable):
                c.park("x", [full(nbytes, 2)], overwrite=True)
            assert int(c.restore("x")[0][0]) == 1  # the refused overwrite left v1 standing
        image = crash_image(eng.disk, str(tmp_path / "crash"))
        assert "x" in eng.disk.scan().manifests, "v1's manifest left LMDB with the refused overwrite's"
        eng.check_invariants()
    finally:
        FailsOneSync.armed = False
    d2 = started_on(daemon, image, **over)
    with Client(d2.address, transport="inline") as c:
        assert int(c.restore("x")[0][0]) == 1
