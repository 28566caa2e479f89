"""Reproductions of integrity bugs found by reading the commit, delete and maintenance
paths against ``docs/protocol.md``, each a regression test of its fix (the last one open,
a write_through park whose fsync fails after its transaction committed, is fixed: what it
wrote is deleted, as a write that lost a race deletes what it wrote).

Faults go through the ``disk_factory`` seam: a ``DiskStore`` subclass that fails ONE call.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import lmdb
import pytest
import torch

from kvpark.client import AlreadyExists, Client, KVParkError, Unavailable
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest, Write


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


@pytest.mark.parametrize("nbytes", [4096, 5 * (1 << 20) + 1], ids=["plain", "windowed"])
def test_a_park_whose_fsync_fails_leaves_the_index_and_the_disk_agreeing(
        daemon: Callable[..., Daemon], nbytes: int) -> None:
    d = daemon(disk_factory=_FailsOneSync, **{"policy.write": "write_through", "tiers.host.capacity": "4MiB"})
    with Client(d.address, transport="inline") as c:
        _FailsOneSync.armed = True
        with pytest.raises(KVParkError):
            c.park("s", [full(nbytes, 1)])
        assert d.engine is not None
        d.engine.check_invariants()


def test_a_park_whose_fsync_fails_is_refused_as_unavailable(daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=_FailsOneSync, **{"policy.write": "write_through"})
    with Client(d.address, transport="inline") as c:
        _FailsOneSync.armed = True
        with pytest.raises(Unavailable):
            c.park("s", [full(4096, 1)])


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


class _PinsTwoWrites(DiskStore):
    """``w``'s last staged window waits at ``go`` once it landed; ``y``'s write transaction
    waits at ``release`` inside LMDB's write lock; ``aborting``: a stage_abort began."""

    staged, go, in_txn, release, aborting = (threading.Event() for _ in range(5))
    arm_w = arm_y = False

    def stage_blocks(self, m: Manifest, first: int, blocks: Sequence[memoryview]) -> None:
        super().stage_blocks(m, first, blocks)
        cls = type(self)
        if cls.arm_w and m.seq_id == "w" and first + len(blocks) == len(m.block_lengths):
            cls.arm_w = False
            cls.staged.set()
            assert cls.go.wait(60)

    def _put(self, txn, w: Write, replaced) -> bool:  # type: ignore[no-untyped-def]
        cls = type(self)
        if cls.arm_y and w.manifest.seq_id == "y":
            cls.arm_y = False
            cls.in_txn.set()
            assert cls.release.wait(60)
        return super()._put(txn, w, replaced)

    def stage_abort(self, m: Manifest) -> None:
        type(self).aborting.set()
        super().stage_abort(m)


def test_a_refused_windowed_create_never_holds_the_index_lock_across_disk_io(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=_PinsTwoWrites, **{"tiers.host.capacity": "4MiB", "policy.write": "write_through"})
    eng = d.engine
    assert eng is not None
    big = 5 * (1 << 20) + 1
    done: dict[str, object] = {}
    with Client(d.address, transport="inline") as c:
        c.park("m", [full(4096, 7)])

        def run(name: str, fn: Callable[[], object]) -> threading.Thread:
            def body() -> None:
                try:
                    done[name] = fn()
                except Exception as e:  # noqa: BLE001 - recorded for the asserts
                    done[name] = e
            t = threading.Thread(target=body, daemon=True)
            t.start()
            return t
        try:
            _PinsTwoWrites.arm_w = True
            t_w = run("w", lambda: c.park("w", [full(big, 2)]))  # windowed: larger than its tier
            assert _PinsTwoWrites.staged.wait(30)
            c.park("w", [full(4096, 1)])  # another create of the id wins meanwhile
            _PinsTwoWrites.arm_y = True
            t_y = run("y", lambda: c.park("y", [full(4096, 3)]))  # a write that holds LMDB's write lock
            assert _PinsTwoWrites.in_txn.wait(30)
            _PinsTwoWrites.go.set()
            assert _PinsTwoWrites.aborting.wait(30)
            t_m = run("m", lambda: c.restore("m"))  # memory only: needs no disk
            t_m.join(10)
            served = "m" in done
        finally:
            _PinsTwoWrites.go.set()
            _PinsTwoWrites.release.set()
        for t in (t_w, t_y, t_m):
            t.join(60)
        assert isinstance(done["w"], AlreadyExists), done["w"]
        assert served, "a memory-only restore waited for another park's disk write"
