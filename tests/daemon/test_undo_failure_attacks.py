"""Two disk faults in a row: a write_through overwrite refused (its fsync failed) whose
undo fails too. Its id stays pending until the retry undoes it, and a drop meanwhile
deletes the refused manifest before it answers. Found by a fresh-eyes attack; each test
failed on the code as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon.server import Daemon

from .disk_seams import crash_image
from .test_revert_attacks import WT, FailingRevert, failing_revert, restored_after_crash  # noqa: F401 (fixture)


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def invariants(d: Daemon) -> str:
    assert d.engine is not None
    try:
        d.engine.check_invariants()
        return ""
    except AssertionError as e:
        return str(e)


def test_a_drop_acknowledged_while_a_refused_overwrites_undo_is_queued_stays_dropped_after_a_crash(
        daemon: Callable[..., Daemon], failing_revert: type[FailingRevert], tmp_path: Path) -> None:
    """write_through, "x" v1 on disk. Overwrite B commits its transaction (B's manifest
    replaces v1's), its fsync fails: refused, answered. Its undo (``revert``) fails too and
    is queued for the maintenance pass. Then a drop of "x" is acknowledged: it deletes v1's
    generation-exact records (``DiskStore.delete``), and B's manifest, still current in
    LMDB, stays. A crash before the maintenance retry brings "x" back (B's refused bytes)
    after an acknowledged drop (the rule of
    ``test_a_drop_acknowledged_while_a_refused_overwrite_of_the_id_is_in_its_error_path_…``:
    once the overwrite has answered, a crash finds the id gone)."""
    d = daemon(disk_factory=failing_revert, **WT)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        failing_revert.sync_armed = failing_revert.txn_armed = True
        with pytest.raises(KVParkError):
            c.park("x", [full(4096, 2)], overwrite=True)
        assert not failing_revert.txn_armed and eng.deletes.pending == 1, "the undo did not fail and queue"
        assert c.drop("x")  # acknowledged; the disk is healthy again
        assert eng.deletes.pending == 1, "the maintenance pass ran the queued undo meanwhile"
        image = crash_image(eng.disk, str(tmp_path / "crash"))  # a SIGKILL now
    d.stop(0.5)
    got = restored_after_crash(daemon, image)
    assert got is None, f"the acknowledged drop of 'x' was undone by a crash: it restores {got} (B was refused)"


def test_a_refused_overwrite_after_an_earlier_refusals_undo_failed_keeps_the_standing_version(
        daemon: Callable[..., Daemon], failing_revert: type[FailingRevert], tmp_path: Path) -> None:
    """write_through, "x" v1 on disk. Overwrite B is refused (fsync failed) and its undo
    fails: queued, and B's ids are released (``pending.done`` in the ``finally``) although
    B's manifest still stands in LMDB. Overwrite C of "x" then writes over B's manifest
    (C's transaction replaced B's, not v1's) and is refused too (fsync failed); C's undo
    runs: B's generation is no longer held (its failed revert forgot it), so C's undo
    deletes the manifest. v1 is indexed on disk with no manifest in LMDB; the queued undo
    of B later finds no manifest of B current and puts nothing back. A crash loses v1,
    acknowledged under write_through. (Either C waits until B's undo is done, or an undo
    puts back what the index stands for.)"""
    d = daemon(disk_factory=failing_revert, **WT)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        failing_revert.sync_armed = failing_revert.txn_armed = True
        with pytest.raises(KVParkError):
            c.park("x", [full(4096, 2)], overwrite=True)  # B
        assert not failing_revert.txn_armed and eng.deletes.pending == 1, "B's undo did not fail and queue"
        failing_revert.sync_armed = True
        with pytest.raises(KVParkError):
            c.park("x", [full(4096, 3)], overwrite=True)  # C: refused, its undo succeeds
        assert [int(t[0]) for t in c.restore("x")] == [1]
        eng.deletes.retry()  # the maintenance pass, the disk healthy
        assert eng.deletes.pending == 0
        broken = invariants(d)
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    got = restored_after_crash(daemon, image)
    assert got == [1] and not broken, \
        f"v1 (acknowledged, write_through) lost: after a crash 'x' restores {got}; invariants: {broken!r}"
