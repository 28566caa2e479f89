"""Disk accounting after one failed disk call: the store charges exactly what the index
holds on disk, and nothing stays charged as staged, whichever call failed.

Found by the history checker ("invariants: disk: store holds X bytes, the index Y" with
EIO and map-full faults); each case fails ONE call through the ``disk_factory`` seam.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import lmdb
import pytest
import torch

from kvpark.client import Client, ResourceExhausted, Unavailable
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest, Write

from ..conftest import wait_until

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def _error(kind: str) -> lmdb.Error:
    return lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL") if kind == "map_full" else \
        lmdb.Error("mdb_txn_commit: Input/output error")


class _FailsStageCommit(DiskStore):
    """The next ``stage_commit`` fails as its write transaction would (nothing written)."""

    armed = ""

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        if _FailsStageCommit.armed:
            kind, _FailsStageCommit.armed = _FailsStageCommit.armed, ""
            raise self._write_error(_error(kind))
        return super().stage_commit(m, replace, sync)


def _accounted(d: Daemon) -> None:
    e = d.engine
    assert e is not None
    assert e.disk.staged == 0, f"{e.disk.staged} bytes still charged as staged"
    e.check_invariants()


@pytest.mark.parametrize("kind", ["eio", "map_full"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_windowed_park_whose_stage_commit_fails_leaves_nothing_charged(
        daemon: Callable[..., Daemon], kind: str, overwrite: bool) -> None:
    d = daemon(disk_factory=_FailsStageCommit, **{"tiers.host.capacity": "4MiB"})
    with Client(d.address, transport="inline") as c:
        if overwrite:
            c.park("w", [full(5 * MiB + 1, 1)])
        _FailsStageCommit.armed = kind
        with pytest.raises((Unavailable, ResourceExhausted)):
            c.park("w", [full(5 * MiB + 1, 2)], overwrite=True)
        _accounted(d)
        if overwrite:
            assert int(c.restore("w")[0][0]) == 1
        c.park("w", [full(5 * MiB + 1, 3)], overwrite=True)
        assert int(c.restore("w")[0][0]) == 3
        _accounted(d)


class _WriteRacesADrop(DiskStore):
    """The first write transaction naming ``x`` waits until the test dropped ``x``
    (``go``); the next delete of ``x`` then fails as LMDB does on an I/O error."""

    held = threading.Event()
    go = threading.Event()
    fail_delete = False

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        if any(w.manifest.seq_id == "x" for w in writes) and not _WriteRacesADrop.held.is_set():
            _WriteRacesADrop.held.set()
            _WriteRacesADrop.go.wait(30)
        return super().write_many(writes, sync=sync)

    def delete(self, m: Manifest, sync: bool = False) -> None:
        if m.seq_id == "x" and _WriteRacesADrop.fail_delete:
            _WriteRacesADrop.fail_delete = False
            with self._acct:
                self._forget((m.seq_id, m.gen))  # as the real one does, failed or not
            raise self._write_error(_error("eio"))
        super().delete(m, sync)


@pytest.mark.parametrize("how", ["demote", "flush"])
def test_a_disk_write_that_loses_to_a_drop_and_fails_to_delete_leaves_no_stray_record(
        daemon: Callable[..., Daemon], how: str) -> None:
    _WriteRacesADrop.held.clear()
    _WriteRacesADrop.go.clear()
    _WriteRacesADrop.fail_delete = True
    d = daemon(disk_factory=_WriteRacesADrop)  # write_back: parks stay in memory
    e = d.engine
    assert e is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 1)])
        seq = e.catalog.find("x")
        assert seq is not None and not seq.on_disk
        write = (lambda: e.mover.write_to_disk(seq)) if how == "demote" else (lambda: e.mover.flush())
        errors: list[BaseException] = []

        def run() -> None:
            try:
                write()
            except BaseException as err:  # checked below
                errors.append(err)

        t = threading.Thread(target=run)
        t.start()
        assert _WriteRacesADrop.held.wait(30)
        # Step: the drop retires x while its disk write runs; the write then lands, finds
        # it stale, and its delete of what it wrote fails once.
        assert c.drop("x")
        _WriteRacesADrop.go.set()
        t.join(60)
    assert errors == []  # the write's caller is not answered with the delete's failure
    e.check_invariants()  # the record is queued for a retry, not left behind
    assert wait_until(lambda: e.deletes.pending == 0)
    e.check_invariants()
    assert e.disk.scan().records == {}


class _DeletesOfXFail(DiskStore):
    """Every delete of ``x`` fails as LMDB does on an I/O error while ``armed``."""

    armed = False

    def delete(self, m: Manifest, sync: bool = False) -> None:
        if m.seq_id == "x" and _DeletesOfXFail.armed:
            with self._acct:
                self._forget((m.seq_id, m.gen))  # as the real one does, failed or not
            raise self._write_error(_error("eio"))
        super().delete(m, sync)


def test_a_retried_delete_never_removes_the_same_version_adopted_again_from_the_remote_tier(
        daemon: Callable[..., Daemon], redis_server: Any) -> None:
    _DeletesOfXFail.armed = False
    d = daemon(disk_factory=_DeletesOfXFail, **{
        "policy.write": "write_through", "policy.promote_on_restore": "false",
        "tiers.remote.url": redis_server.url, "tiers.remote.namespace": "twin", "tiers.remote.write": "write_through",
        "tiers.remote.timeout_s": 1.0})
    e = d.engine
    assert e is not None
    with Client(d.address, transport="inline") as c:  # inline: served from disk, no promotion
        c.park("x", [full(MiB, 1)])
        assert wait_until(lambda: (r := c.stat().remote) is not None and r.pending_writes == 0)
        # Step 1: x is dropped here only (its copy in Redis stays), and its disk delete
        # fails: the record waits for a retry.
        _DeletesOfXFail.armed = True
        with pytest.raises(Unavailable):
            e.drop("x", everywhere=False)
        # Step 2: a restore adopts x from Redis: the same version, the same generation,
        # and fetches it onto the disk under the same record keys.
        assert int(c.restore("x")[0][0]) == 1
        seq = e.catalog.find("x")
        assert seq is not None and seq.on_disk
        # Step 3: the retry runs; it must not delete the adopted version's records.
        _DeletesOfXFail.armed = False
        e.mover.retry_deletes()
        assert wait_until(lambda: e.deletes.pending == 0)
        assert int(c.restore("x")[0][0]) == 1  # before the fix: DataLoss, record missing
    e.check_invariants()


class _SlowDeleteOfX(DiskStore):
    """A delete of ``x`` waits for ``go`` after announcing itself on ``held``."""

    held = threading.Event()
    go = threading.Event()
    armed = False

    def delete(self, m: Manifest, sync: bool = False) -> None:
        if m.seq_id == "x" and _SlowDeleteOfX.armed:
            _SlowDeleteOfX.held.set()
            _SlowDeleteOfX.go.wait(30)
        super().delete(m, sync)


def test_a_retried_delete_under_way_still_counts_as_pending(daemon: Callable[..., Daemon]) -> None:
    """``pending == 0`` means every record a failed delete left is gone. Found by CI: a
    maintenance retry took the record off the list, and a caller that saw 0 scanned LMDB
    before the retry's delete landed."""
    _DeletesOfXFail.armed = False
    _SlowDeleteOfX.held.clear()
    _SlowDeleteOfX.go.clear()
    _SlowDeleteOfX.armed = False

    class Store(_SlowDeleteOfX, _DeletesOfXFail):
        pass

    d = daemon(disk_factory=Store, **{"policy.write": "write_through"})
    e = d.engine
    assert e is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 1)])
        _DeletesOfXFail.armed = True
        with pytest.raises(Unavailable):
            e.drop("x")
        assert e.deletes.pending == 1
        # Whichever retry runs next (this test's or the maintenance pass's) now waits
        # inside its delete.
        _SlowDeleteOfX.armed = True
        _DeletesOfXFail.armed = False
        t = threading.Thread(target=e.deletes.retry)
        t.start()
        try:
            assert _SlowDeleteOfX.held.wait(30)
            assert e.deletes.pending == 1  # before the fix: 0, with the record still in LMDB
        finally:
            _SlowDeleteOfX.go.set()
            t.join(30)
        assert wait_until(lambda: e.deletes.pending == 0)
        assert e.disk.scan().manifests == {}
    e.check_invariants()
