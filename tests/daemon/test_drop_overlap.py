"""A drop that overlaps a write_through overwrite whose fsync then fails, and whose undo
fails too. The refused park is indeterminate until its queued undo lands (a double
fault: docs/protocol.md, "Refused is gone"): a crash in that window may bring it back,
as a write that took effect after the drop, which the overlap allows. It never brings
back the version the drop retired, and once the retry lands the drop stands."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import lmdb
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

from .disk_seams import crash_image

WT = {"policy.write": "write_through"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class Seam(DiskStore):
    """``armed``: the next fsync waits at ``gate`` (``entered``), then fails (EIO), and the
    next transaction deleting "x"'s records *after* that (the refusal's undo) fails too."""

    armed = False
    undo_fails = False
    entered = threading.Event()
    gate = threading.Event()

    def sync(self) -> None:
        cls = Seam
        if cls.armed:
            cls.armed = False
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
            cls.undo_fails = True
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        if Seam.undo_fails and m.seq_id == "x":
            Seam.undo_fails = False
            raise lmdb.Error("mdb_put: Input/output error")
        super()._delete_blocks(txn, m)


def test_a_drop_overlapping_a_refused_overwrite_whose_undo_failed_never_brings_back_the_dropped_version(
        daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """write_through: "x" v1 on disk. The overwrite v2 commits its transaction (v2's
    manifest current) and its fsync is slow. ``drop("x")`` runs meanwhile: acknowledged.
    v2's fsync fails, its undo fails, v2 answers UNAVAILABLE, its undo queued. A crash
    now finds x dropped or v2 (the refused park, linearized after the drop), never v1.
    Without a crash the retry undoes v2 and x stays dropped, in LMDB too."""
    Seam.armed = Seam.undo_fails = False
    Seam.entered.clear()
    Seam.gate.clear()
    d = daemon(disk_factory=Seam, **WT)
    eng = d.engine
    assert eng is not None
    errors: list[BaseException] = []
    try:
        with Client(d.address, transport="inline") as c:
            c.park("x", [full(4096, 1)])
            c.park("other", [full(4096, 3)])

            def overwrite() -> None:
                try:
                    with Client(d.address, transport="inline") as c2:
                        c2.park("x", [full(4096, 2)], overwrite=True)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            Seam.armed = True
            t = threading.Thread(target=overwrite)
            t.start()
            assert Seam.entered.wait(30), "the overwrite never fsynced"
            assert c.drop("x")  # acknowledged
            Seam.gate.set()
            t.join(30)
            assert errors and isinstance(errors[0], KVParkError), f"the overwrite was not refused: {errors}"
            assert eng.deletes.pending == 1  # the undo failed: queued
            image = crash_image(eng.disk, str(tmp_path / "crash"))  # a SIGKILL now
            eng.deletes.retry()  # the disk healthy again: the undo lands
            assert eng.deletes.pending == 0
            assert "x" not in eng.disk.scan().manifests
            assert c.present(["x", "other"]) == [False, True]
            eng.check_invariants()
            path = eng.disk.path
    finally:
        Seam.armed = Seam.undo_fails = False
        Seam.gate.set()
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, **WT})
    with Client(d2.address) as c3:
        present = c3.present(["x", "other"])
        got = [int(t[0]) for t in c3.restore("x")] if present[0] else None
    assert present[1] and got in (None, [2]), f"after a crash in the undo's window x restores {got}"
    d2.stop(0.5)
    d3 = daemon(**{"tiers.disk.path": path, **WT})
    with Client(d3.address) as c4:
        assert c4.present(["x", "other"]) == [False, True]  # the retry landed: the drop stands
