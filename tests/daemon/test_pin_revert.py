"""A pin acknowledged while a refused overwrite's manifest is current in LMDB (its
fsync slow, or its undo queued after failing) survives the undo: the manifest put back
carries the pin the index has when the undo's transaction runs, not the one the refused
write found. Found by a fresh-eyes attack."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore

from .disk_seams import crash_image
from .test_revert_attacks import FailingRevert, failing_revert  # noqa: F401 (fixture)

WT = {"policy.write": "write_through"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_a_pin_acknowledged_while_a_refused_overwrite_is_queued_for_undo_survives_a_restart(
        daemon: Callable[..., Daemon], failing_revert: type[FailingRevert], tmp_path: Path) -> None:
    """write_through: "x" v1 on disk. The overwrite v2 commits its transaction, its fsync
    fails (refused), its undo fails too (queued). ``pin("x")`` is acknowledged: its
    ``update_manifest`` finds v2's manifest current and silently writes nothing. The
    retry's ``revert`` puts back the v1 manifest decoded at v2's write: unpinned. The
    acknowledged pin is gone after a restart."""
    d = daemon(disk_factory=failing_revert, **WT)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        failing_revert.sync_armed = failing_revert.txn_armed = True
        with pytest.raises(KVParkError):
            c.park("x", [full(4096, 2)], overwrite=True)
        assert eng.deletes.pending == 1
        assert c.pin("x").pinned  # acknowledged
        eng.deletes.retry()
        assert eng.deletes.pending == 0
        live = c.info("x").pinned
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, **WT})
    with Client(d2.address) as c2:
        after = c2.info("x")
    assert live and after.pinned, f"pin acknowledged; live pinned={live}; after a restart pinned={after.pinned}"


class HeldFailingSync(DiskStore):
    """Armed: the next fsync waits at ``gate`` (``entered`` set), then fails (EIO); every
    other fsync works. One fault: the undo itself succeeds."""

    armed = False
    entered = threading.Event()
    gate = threading.Event()

    def sync(self) -> None:
        cls = HeldFailingSync
        if cls.armed:
            cls.armed = False
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()


def test_a_pin_acknowledged_while_an_overwrite_is_fsyncing_survives_that_overwrites_refusal(
        daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """write_through: "x" v1 on disk. The overwrite v2 commits its transaction; its fsync
    is slow and then fails. Meanwhile ``pin("x")`` is acknowledged (v1 is the indexed
    version; ``update_manifest`` finds v2's manifest current and writes nothing). The
    refusal's undo succeeds at once and puts back the v1 manifest taken at v2's write,
    unpinned: the acknowledged pin is lost at the next start. A single disk fault."""
    HeldFailingSync.armed = False
    HeldFailingSync.entered.clear()
    HeldFailingSync.gate.clear()
    d = daemon(disk_factory=HeldFailingSync, **WT)
    eng = d.engine
    assert eng is not None
    errors: list[BaseException] = []
    try:
        with Client(d.address, transport="inline") as c:
            c.park("x", [full(4096, 1)])

            def overwrite() -> None:
                try:
                    with Client(d.address, transport="inline") as c2:
                        c2.park("x", [full(4096, 2)], overwrite=True)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            HeldFailingSync.armed = True
            t = threading.Thread(target=overwrite)
            t.start()
            assert HeldFailingSync.entered.wait(30), "the overwrite never fsynced"
            assert c.pin("x").pinned  # acknowledged
            HeldFailingSync.gate.set()
            t.join(30)
            assert errors and isinstance(errors[0], KVParkError), f"the overwrite was not refused: {errors}"
            assert eng.deletes.pending == 0  # the undo went through
            live = c.info("x").pinned
            image = crash_image(eng.disk, str(tmp_path / "crash"))
    finally:
        HeldFailingSync.armed = False
        HeldFailingSync.gate.set()
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, **WT})
    with Client(d2.address) as c3:
        after = c3.info("x")
        got = [int(t[0]) for t in c3.restore("x")]
    assert live and after.pinned and got == [1], \
        f"pin acknowledged; live pinned={live}; after a restart pinned={after.pinned}, x restores {got}"
