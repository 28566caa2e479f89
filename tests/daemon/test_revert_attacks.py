"""A refused write_through overwrite whose undo fails once: the maintenance pass retries
the same undo (the version it was to replace gets its manifest back), never a plain
delete of the manifest. Found by a fresh-eyes attack; it failed on the code as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import lmdb
import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

from .disk_seams import crash_image

WT = {"policy.write": "write_through"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def restored_after_crash(daemon: Callable[..., Daemon], image: str) -> list[int] | None:
    d2 = daemon(**{"tiers.disk.path": image, **WT})
    with Client(d2.address) as c:
        return [int(t[0]) for t in c.restore("x")] if c.present(["x"]) == [True] else None


class FailingRevert(DiskStore):
    """Armed: the next fsync fails (EIO) at once, and the next write transaction that
    deletes block records of "x" (the refusal's ``revert``) fails (EIO) and is rolled
    back; the disk works again after that."""

    sync_armed = False
    txn_armed = False

    def sync(self) -> None:
        cls = FailingRevert
        if cls.sync_armed:
            cls.sync_armed = False
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        cls = FailingRevert
        if cls.txn_armed and m.seq_id == "x":
            cls.txn_armed = False
            raise lmdb.Error("mdb_put: Input/output error")
        super()._delete_blocks(txn, m)


@pytest.fixture
def failing_revert() -> Iterator[type[FailingRevert]]:
    FailingRevert.sync_armed = FailingRevert.txn_armed = False
    yield FailingRevert
    FailingRevert.sync_armed = FailingRevert.txn_armed = False


def test_a_refused_overwrite_whose_revert_failed_is_retried_as_a_revert_not_a_delete_of_the_manifest(
        daemon: Callable[..., Daemon], failing_revert: type[FailingRevert], tmp_path: Path) -> None:
    """write_through, "x" v1 acknowledged on disk. B (overwrite) commits its transaction
    (its manifest replaces v1's); its fsync fails: refused. The undo (``revert``) fails
    too (the disk is failing) and is queued. The maintenance retry once ran a plain
    ``DiskStore.delete`` of B: B's manifest was current, so it went and v1's never came
    back (a crash lost v1). Now the retry is the same undo."""
    d = daemon(disk_factory=failing_revert, **WT)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        failing_revert.sync_armed = failing_revert.txn_armed = True
        with pytest.raises(KVParkError):
            c.park("x", [full(4096, 2)], overwrite=True)
        assert not failing_revert.txn_armed, "the refusal's revert never ran"
        assert eng.deletes.pending == 1
        eng.deletes.retry()  # the maintenance pass, the disk healthy again
        assert eng.deletes.pending == 0
        assert [int(t[0]) for t in c.restore("x")] == [1]
        image = crash_image(eng.disk, str(tmp_path / "crash"))
        try:
            eng.check_invariants()
            invariant = ""
        except AssertionError as e:
            invariant = str(e)
    d.stop(0.5)
    got = restored_after_crash(daemon, image)
    assert got == [1] and not invariant, \
        f"v1 (acknowledged, write_through) lost by a crash: 'x' restores {got}; invariants: {invariant!r}"
