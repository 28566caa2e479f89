"""A queued (failed) disk-eviction delete of a sequence still in memory must not cost it
its place on disk: a flush (the stop's, or a client's ``Flush``) takes the queued delete
over and writes the sequence (``Deletes.take_own``). A fix that made the flush skip such
a sequence instead let ``Engine.close``'s retry delete the old copy after the flush, and
an acknowledged, never-dropped sequence was gone after a graceful stop. Found by a
fresh-eyes attack."""

from __future__ import annotations

import threading
from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.disk_evict import disk_drop
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class Flaky(DiskStore):
    """``fail``: every transaction deleting "x"'s block records fails (EIO).
    ``recover_at_fsync``: the next fsync (the stop's flush ends with one) clears ``fail``:
    the disk works again from then on (a transient fault that is over by the stop)."""

    fail = False
    recover_at_fsync = False
    lock = threading.Lock()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        if Flaky.fail and m.seq_id == "x":
            raise lmdb.Error("injected: EIO")
        super()._delete_blocks(txn, m)

    def fsync(self) -> None:
        with Flaky.lock:
            if Flaky.recover_at_fsync:
                Flaky.recover_at_fsync = False
                Flaky.fail = False
        super().fsync()


@pytest.mark.parametrize("write", ["write_back", "write_through"])
def test_a_stop_keeps_a_memory_copy_whose_eviction_delete_is_queued(
        daemon: Callable[..., Daemon], write: str) -> None:
    """flush_on_shutdown (the default), write_back (the default) or write_through. x is parked, flushed, and evicted
    from disk while it keeps its memory copy; the eviction's delete fails (EIO) and is
    queued. The disk works again by the time the stop's flush has run. The flush leaves x
    out (its delete is queued: ``deleting``), then ``close`` retries the queued delete,
    which deletes x's old disk copy. After the restart x is gone; it was acknowledged,
    never dropped, and a graceful stop promises to write every memory-only sequence."""
    Flaky.fail = Flaky.recover_at_fsync = False
    try:
        d = daemon(disk_factory=Flaky, **{"policy.write": write})
        eng = d.engine
        assert eng is not None
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            c.park("other", [full(MiB, 3)])
            c.flush()
            Flaky.fail = True
            assert disk_drop(eng.mover, "x")  # its delete failed: queued, x in memory only
            seq = eng.catalog.find("x")
            assert seq is not None and not seq.on_disk and seq.res
            assert eng.deletes.pending >= 1
        Flaky.recover_at_fsync = True  # the disk works again by the end of the stop's flush
        d.stop(0.5)
        d2 = daemon(**{"policy.write": write})
        with Client(d2.address) as c2:
            present = c2.present(["x", "other"])
            got = [int(t[0]) for t in c2.restore("x")] if present[0] else None
        assert present == [True, True] and got == [5], (
            f"after a graceful stop (flush_on_shutdown) and a restart: present(x, other)={present}, x={got}")
    finally:
        Flaky.fail = Flaky.recover_at_fsync = False


def test_a_flush_call_writes_a_memory_copy_whose_eviction_delete_is_queued(
        daemon: Callable[..., Daemon], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """write_back (the default). x is flushed, then evicted from disk keeping its memory
    copy; the eviction's delete fails (EIO) and is queued (deletes of x keep failing for a
    moment; writes work). The client calls ``flush()`` ("writes every memory-only sequence
    to disk now"): it answers without writing x (its delete is queued: ``deleting``) and
    without an error. The disk works again and the maintenance pass's retry deletes x's
    old disk copy. A crash now (SIGKILL: what
    LMDB holds) has no x, though the client flushed after parking it."""
    from .disk_seams import crash_image

    Flaky.fail = Flaky.recover_at_fsync = False
    try:
        d = daemon(disk_factory=Flaky, **{"policy.flush_on_shutdown": "false"})
        eng = d.engine
        assert eng is not None
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            c.flush()
            Flaky.fail = True
            assert disk_drop(eng.mover, "x")  # its delete failed: queued, x in memory only
            flushed = c.flush()  # writes work; deletes of x still fail
            Flaky.fail = False  # the disk works again
            eng.deletes.retry()  # the maintenance pass
            seq = eng.catalog.find("x")
            assert seq is not None
            on_disk = seq.on_disk
            image = crash_image(eng.disk, str(tmp_path / "crash"))
        d.stop(0.5)
        d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
        with Client(d2.address) as c2:
            present = c2.present(["x"])
        assert on_disk and present == [True], (
            f"flush() answered {flushed} without an error; x.on_disk={on_disk} after it and the retry; "
            f"after a crash present(x)={present}")
    finally:
        Flaky.fail = Flaky.recover_at_fsync = False
