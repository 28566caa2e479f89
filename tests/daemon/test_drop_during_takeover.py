"""A drop acknowledged while a flush has taken over the queued (failed) eviction delete
of the sequence (``Deletes.take_own``) still deletes the old manifest that failed delete
left in LMDB before it answers: a taken-over delete counts as queued for the drop. Before
that, a crash brought the dropped sequence back. Found by a fresh-eyes attack."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import lmdb
import torch

from kvpark.client import Client
from kvpark.daemon.disk_evict import disk_drop
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest, Write

from .disk_seams import crash_image

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class FlakyGated(DiskStore):
    fail = False
    hold = ""
    entered = threading.Event()
    gate = threading.Event()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        if FlakyGated.fail and m.seq_id == "x":
            raise lmdb.Error("injected: EIO")
        super()._delete_blocks(txn, m)

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = FlakyGated
        if cls.hold and any(w.manifest.seq_id == cls.hold for w in writes):
            cls.hold = ""
            cls.entered.set()
            assert cls.gate.wait(60), "gate never opened"
        return super().write_many(writes, sync=sync)


def test_drop_during_taken_over_flush_leaves_old_manifest(
        daemon: Callable[..., Daemon], tmp_path) -> None:  # type: ignore[no-untyped-def]
    FlakyGated.fail = False
    FlakyGated.hold = ""
    FlakyGated.entered = threading.Event()
    FlakyGated.gate = threading.Event()
    try:
        d = daemon(disk_factory=FlakyGated, **{"policy.flush_on_shutdown": "false"})
        eng = d.engine
        assert eng is not None
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            c.flush()
            FlakyGated.fail = True
            assert disk_drop(eng.mover, "x")  # its delete failed: queued; manifest still in LMDB
            seq = eng.catalog.find("x")
            assert seq is not None and not seq.on_disk and seq.res
            assert eng.deletes.pending >= 1
            FlakyGated.hold = "x"
            t = threading.Thread(target=eng.flush)  # takes the queued delete over (take_own)
            t.start()
            assert FlakyGated.entered.wait(30)
            dropped_err = None
            try:
                c.drop("x")
            except Exception as e:  # noqa: BLE001
                dropped_err = e
            FlakyGated.gate.set()
            t.join(30)
            present_now = c.present(["x"])
            image = crash_image(eng.disk, str(tmp_path / "crash"))
        FlakyGated.fail = False
        d.stop(0.5)
        d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
        with Client(d2.address) as c2:
            after = c2.present(["x"])
        assert dropped_err is None and present_now == [False] and after == [False], (
            f"drop of x answered {dropped_err!r} (acknowledged), present before crash={present_now}; "
            f"after a crash present(x)={after}: the dropped sequence came back")
    finally:
        FlakyGated.fail = False
        FlakyGated.hold = ""
        FlakyGated.gate.set()
