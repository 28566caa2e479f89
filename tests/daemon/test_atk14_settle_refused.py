"""Fresh-eyes attack on 4f5a4df (absence answered only once durable): ``settle`` runs for
every id a multi-id restore names when one of them is missing, present ids included,
and unpublishes the manifests of that id's queued deletes. A queued *undo* of a refused
write_through overwrite is such an entry: its manifest (the refused one) is still the
current one in LMDB, and the retry's ``revert`` puts the standing version's manifest
back only where the refused one is still current. ``settle`` deletes it first: the
standing, acknowledged version is left with no manifest, and a crash loses it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import NotFound

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


def test_a_multi_restore_missing_one_id_never_unpublishes_a_present_ids_refused_manifest_before_its_undo(
        daemon: Callable[..., Daemon], failing_revert: type[FailingRevert], tmp_path: Path) -> None:
    """write_through, "x" v1 acknowledged on disk. Overwrite B of x commits its
    transaction, its fsync fails: refused; its undo fails too and is queued (B's manifest
    is still current in LMDB; x stays indexed at v1). A client restores ["x", "nope"]:
    NOT_FOUND for "nope", and ``Engine.absent`` settles both ids; for "x" ``settle``
    unpublishes B's manifest (queued, not gone, no twin). The maintenance retry then
    runs B's undo: B's manifest is no longer current, so v1's is not put back. x v1 is
    indexed on disk with no manifest in LMDB; a crash loses it."""
    d = daemon(disk_factory=failing_revert, **WT)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        c.park("y", [full(4096, 7)])
        failing_revert.sync_armed = failing_revert.txn_armed = True
        with pytest.raises(KVParkError):
            c.park("x", [full(4096, 2)], overwrite=True)
        assert not failing_revert.txn_armed and eng.deletes.pending == 1, "the undo did not fail and queue"
        with pytest.raises(NotFound):
            c.restore_many(["x", "nope"], timeout=20)  # "nope" is not parked; x is
        eng.deletes.retry()  # the maintenance pass, the disk healthy
        assert [int(t[0]) for t in c.restore("x")] == [1]
        broken = invariants(d)
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    got = restored_after_crash(daemon, image)
    assert got == [1] and not broken, (
        f"x v1 (acknowledged, write_through, never dropped) lost: after a crash 'x' restores {got}; "
        f"invariants: {broken!r}")
