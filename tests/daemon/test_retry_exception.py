"""The retry of a queued undo that meets an exception that is not LMDB's (the maintenance
pass catches every ``Exception`` and goes on) keeps what it did not do queued: the
refused manifest is undone by a later retry and the hold the undo owns is released.
Found by a fresh-eyes attack."""

from __future__ import annotations

from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon import commit as commit_mod
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

WT = {"policy.write": "write_through"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class Flaky(DiskStore):
    """Armed: the next fsync fails (EIO); while ``txn_armed``, every transaction deleting
    "x"'s records fails (EIO); ``odd``: the next one raises a non-LMDB error, once."""

    sync_armed = False
    txn_armed = False
    odd = False

    def sync(self) -> None:
        if Flaky.sync_armed:
            Flaky.sync_armed = False
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        if m.seq_id == "x":
            if Flaky.odd:
                Flaky.odd = False
                raise OSError(5, "Input/output error")
            if Flaky.txn_armed:
                raise lmdb.Error("mdb_put: Input/output error")
        super()._delete_blocks(txn, m)


@pytest.fixture
def flaky():
    Flaky.sync_armed = Flaky.txn_armed = Flaky.odd = False
    yield Flaky
    Flaky.sync_armed = Flaky.txn_armed = Flaky.odd = False


def test_a_retry_that_meets_a_non_lmdb_error_keeps_the_undo_queued(
        daemon: Callable[..., Daemon], flaky: type[Flaky], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit_mod, "PENDING_WAIT_S", 3.0)  # how long the next park waits
    d = daemon(disk_factory=flaky, **WT)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        flaky.sync_armed = flaky.txn_armed = True
        with pytest.raises(KVParkError):
            c.park("x", [full(4096, 2)], overwrite=True)
        assert eng.deletes.pending == 1
        flaky.odd = True
        flaky.txn_armed = False
        try:
            eng.deletes.retry()  # as the maintenance pass meets it (it logs and goes on)
        except OSError:
            pass
        assert not flaky.odd, "no retry met the error"
        for _ in range(3):
            eng.deletes.retry()  # the disk healthy again
        manifests = eng.disk.scan().manifests
        on_disk_gen = manifests["x"].gen if "x" in manifests else None
        with eng.catalog.lock:
            stuck = eng.pending.busy(["x"])
            indexed_gen = eng.catalog.find("x").gen
        try:
            c.park("x", [full(4096, 3)], overwrite=True)
            later = "ok"
        except KVParkError as e:
            later = repr(e)
        disk_path = eng.disk.path
    d.stop(0.5)  # a clean stop
    d2 = daemon(**{"tiers.disk.path": disk_path, **WT})
    with Client(d2.address, transport="inline") as c2:
        restarted = [int(t[0]) for t in c2.restore("x")]
    assert restarted in ([1], [3]) and not stuck and on_disk_gen == indexed_gen and later == "ok", (
        f"x pending={stuck}; LMDB's manifest of x: generation {on_disk_gen}, the index's {indexed_gen}; "
        f"a later overwrite of x: {later}; after a clean restart x restores {restarted}")


def test_a_drop_whose_delete_meets_a_non_lmdb_error_is_typed_queued_and_never_comes_back(
        daemon: Callable[..., Daemon], flaky: type[Flaky], tmp_path) -> None:
    """The drop's own disk delete raises something untyped (an OSError from below LMDB).
    It used to leave that delete unqueued (only typed failures were) and answer INTERNAL:
    the manifest stayed in LMDB with nothing to delete it, the next ``present`` said x was
    gone, and a crash brought x back. Now: UNAVAILABLE, queued, and absence is answered
    only once the manifest is gone."""
    from kvpark.proto.errors import Unavailable

    from .disk_seams import crash_image

    d = daemon(disk_factory=flaky, **{**WT, "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        flaky.odd = True
        with pytest.raises(Unavailable):
            c.drop("x")
        assert c.present(["x"]) == [False]
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c2:
        assert c2.present(["x"]) == [False]
