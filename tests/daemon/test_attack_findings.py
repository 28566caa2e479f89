"""Reproductions of integrity bugs found by reading the commit, delete and maintenance
paths against ``docs/protocol.md``. Each is ``xfail(strict=True)``: it documents a bug
that is not fixed yet, and starts failing (XPASS) the day the fix lands, so the marker
is removed with the fix.

Faults go through the ``disk_factory`` seam: a ``DiskStore`` subclass that fails ONE call.
"""

from __future__ import annotations

from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client, KVParkError, Unavailable
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class _FailsOneSync(DiskStore):
    """The next fsync, once armed, fails as LMDB reports an I/O error on ``env.sync``:
    the write transaction before it has already committed."""

    armed = False

    def sync(self) -> None:
        if _FailsOneSync.armed:
            _FailsOneSync.armed = False
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()


@pytest.mark.xfail(strict=True, reason="commit.py: a write_through commit whose fsync fails after its "
                   "write transaction committed frees its slots and reports failure, but leaves the "
                   "manifest and records in LMDB, charged to nobody the index knows (window.py checks "
                   "disk.holds() on the same path; commit.py does not)")
def test_a_park_whose_fsync_fails_leaves_the_index_and_the_disk_agreeing(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=_FailsOneSync, **{"policy.write": "write_through"})
    with Client(d.address, transport="inline") as c:
        _FailsOneSync.armed = True
        with pytest.raises(KVParkError):
            c.park("s", [full(4096, 1)])
        assert d.engine is not None
        d.engine.check_invariants()


@pytest.mark.xfail(strict=True, reason="tiers/disk.py DiskStore.sync: an lmdb.Error from env.sync is not "
                   "mapped through _write_error, so a failed fsync reaches the client as INTERNAL")
def test_a_park_whose_fsync_fails_is_refused_as_unavailable(daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=_FailsOneSync, **{"policy.write": "write_through"})
    with Client(d.address, transport="inline") as c:
        _FailsOneSync.armed = True
        with pytest.raises(Unavailable):
            c.park("s", [full(4096, 1)])


@pytest.mark.xfail(strict=True, reason="deletes.py Deletes.delete defers the records of a version a disk read "
                   "lease still reads to Deletes.retry, which only the maintenance pass runs; Engine.close "
                   "(engine.py) ends the leases after the maintenance thread stopped and never retries, so "
                   "an acknowledged drop's manifest stays in LMDB and the id is back after a clean restart")
def test_a_drop_acknowledged_while_a_disk_read_was_leased_stays_dropped_after_a_restart(
        daemon: Callable[..., Daemon]) -> None:
    over = {"policy.write": "write_through", "policy.promote_on_restore": "false"}
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("s", [full(1 << 20, 6)])
        assert eng.mover.demote("s", "host")
    h = eng.acquire("s")  # a restore granted from the disk copy, read later
    assert h.parts[0].tier == "disk" and h.lease_id
    with Client(d.address) as c:
        assert c.drop("s")  # acknowledged
    d.stop(0.5)  # a clean stop, with the read lease still open (it ends at shutdown)
    d2 = daemon(**over)
    with Client(d2.address) as c:
        assert c.present(["s"]) == [False]


@pytest.mark.xfail(strict=True, reason="as above: the replaced version's manifest, deferred under a disk read "
                   "lease, is never deleted before shutdown, so after a restart the id restores the version an "
                   "acknowledged overwrite replaced (not the new one, not NotFound)")
def test_an_overwrite_acknowledged_while_the_old_disk_copy_was_leased_never_brings_the_old_version_back(
        daemon: Callable[..., Daemon]) -> None:
    over = {"policy.promote_on_restore": "false", "policy.flush_on_shutdown": "false"}
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("s", [full(1 << 20, 1)])
        assert eng.mover.demote("s", "host")  # its only copy on disk
    h = eng.acquire("s")  # a restore granted from the disk copy, read later
    assert h.parts[0].tier == "disk" and h.lease_id
    with Client(d.address) as c:
        c.park("s", [full(1 << 20, 2)], overwrite=True)  # acknowledged; in memory (write_back)
    d.stop(0.5)
    d2 = daemon(**over)
    with Client(d2.address) as c:
        if c.present(["s"]) == [True]:
            assert int(c.restore("s")[0][0]) == 2, "the replaced version came back"
