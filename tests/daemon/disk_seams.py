"""Disk stores for the ``disk_factory`` seam that observe or pin the daemon's disk I/O.

They re-implement nothing the daemon relies on: ``SyncObserver`` overrides only ``sync()``
(the one seam every fsync goes through), so ``write_many``, ``stage_commit``,
``update_manifest`` and the flush run exactly as shipped; ``GatedWrites`` holds one write
transaction at a gate the test opens, then writes as shipped.

Primitives:
- ``SyncObserver``: ``durable`` (``{seq_id: generation}``: what LMDB held when the last
  fsync started, i.e. what a power cut now would keep), ``syncs`` (how many completed),
  ``wait_durable(seq_id, gen)``.
- ``GatedWrites``: ``hold`` (a seq_id prefix; "" = none), ``entered`` / ``gate`` events.
- ``HeldAfterCommit``: ``after_hold`` / ``after_entered`` / ``after_gate``: one write held
  just after its transaction committed; ``HeldBeforeAndAfter``: both holds on one store.
- ``crash_image(disk, dst)``: a consistent copy of LMDB now (what a SIGKILL would leave).
- ``waiting_in(function, module)``: a thread is blocked in a wait inside that function.
- ``FailingDeletes``: deletes and unpublishes of one id ("x") that fail on demand:
  ``fail_deletes`` (generations whose block deletes abort their transaction),
  ``fail_unpublish`` (generations whose unpublish fails), ``unpublish_budget`` (after that
  many unpublishes, every further one fails); ``unpublished`` lists the generations tried.
- ``park_filled(engine, seq_id, v, nbytes, overwrite=False)``: park ``nbytes`` bytes of
  value ``v`` through an engine whose maintenance is not started (the test runs it).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Sequence

import lmdb
import torch

from kvpark.client.client import _header
from kvpark.daemon.engine import Engine
from kvpark.daemon.servicer import _spec
from kvpark.tiers.disk import DiskStore, Manifest, Write


class SyncObserver(DiskStore):
    """Records, at each fsync, the manifests committed before it: what that fsync made durable."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.rec_lock = threading.Lock()
        self.durable: dict[str, int] = {}
        self.syncs = 0

    def committed(self) -> dict[str, int]:
        """Every manifest LMDB holds now (committed transactions), by id."""
        with self.env.begin() as txn:
            db = self.env.open_db(b"manifests", txn=txn, create=False)
            return {bytes(k).decode(): Manifest.decode(v).gen for k, v in txn.cursor(db=db)}

    def sync(self) -> None:
        # Taken before the fsync: everything committed by now is made durable by it (a
        # write committing between the two is not counted, so the record never overstates).
        snap = self.committed()
        super().sync()
        with self.rec_lock:
            self.durable = snap
            self.syncs += 1


class GatedWrites(DiskStore):
    """The first write transaction holding an id starting with ``hold`` waits at ``gate``."""

    hold = ""
    entered = threading.Event()
    gate = threading.Event()

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = type(self)
        if cls.hold and any(w.manifest.seq_id.startswith(cls.hold) for w in writes):
            cls.hold = ""  # one write only
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
        return super().write_many(writes, sync=sync)


class HeldAfterCommit(DiskStore):
    """The first write transaction holding an id starting with ``after_hold`` waits at
    ``after_gate`` just after it committed (``after_entered`` set): its manifest is in
    LMDB, and the writer has not yet looked at what happened meanwhile (a drop). Its own
    names, so a store can be held before (``GatedWrites``) and after the same write."""

    after_hold = ""
    after_entered = threading.Event()
    after_gate = threading.Event()

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = type(self)
        mine = bool(cls.after_hold) and any(w.manifest.seq_id.startswith(cls.after_hold) for w in writes)
        if mine:
            cls.after_hold = ""  # one write only
        done = super().write_many(writes, sync=sync)
        if mine:
            cls.after_entered.set()
            assert cls.after_gate.wait(60), "the test never opened the gate"
        return done


class HeldBeforeAndAfter(GatedWrites, HeldAfterCommit):
    """One write held before its transaction (``GatedWrites``) and just after its commit."""


def crash_image(disk: DiskStore, dst: str) -> str:
    """A consistent copy of what LMDB holds now: what a SIGKILL at this moment would
    leave (committed transactions survive the process; nothing else is written)."""
    os.makedirs(dst, exist_ok=True)
    disk.env.copy(dst)
    return dst


def waiting_in(function: str, module: str) -> bool:
    """Some thread is blocked in a condition or event wait inside ``function`` of the
    file ``module`` (its name, e.g. ``"engine.py"``): how a test knows a call it started
    has reached a wait the product makes, without a sleep."""
    for frame in sys._current_frames().values():
        names, f = [], frame
        while f is not None:
            names.append((f.f_code.co_name, f.f_code.co_filename))
            f = f.f_back
        if names and names[0][0] == "wait" and any(n == function and fn.endswith(module) for n, fn in names):
            return True
    return False


def park_filled(engine: Engine, seq_id: str, v: int, nbytes: int, overwrite: bool = False) -> None:
    """Park ``nbytes`` bytes of value ``v`` as ``seq_id`` (reserve, one chunk, commit)."""
    data = torch.full((nbytes,), v, dtype=torch.uint8)
    h = _header(seq_id, [data])
    h.overwrite = overwrite
    r = engine.reserve(_spec(h), inline=True)
    engine.write_chunk(r.lease_id, 0, memoryview(data.numpy()))
    engine.commit(r.lease_id, expect_nbytes=nbytes)


class FailingDeletes(DiskStore):
    """Deletes and unpublishes of ``target`` ("x") that fail as a disk error would, on
    demand (see the module docstring); everything else runs as shipped."""

    target = "x"

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.fail_deletes: set[int] = set()
        self.fail_unpublish: set[int] = set()
        self.unpublish_budget: int | None = None
        self.unpublished: list[int] = []

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        if m.seq_id == self.target and m.gen in self.fail_deletes:
            raise lmdb.Error("injected: EIO")
        super()._delete_blocks(txn, m)

    def unpublish(self, m: Manifest, sync: bool = False) -> None:
        if m.seq_id == self.target:
            self.unpublished.append(m.gen)
            over = self.unpublish_budget is not None and len(self.unpublished) > self.unpublish_budget
            if m.gen in self.fail_unpublish or over:
                raise self._write_error(lmdb.Error("injected: EIO"))
        super().unpublish(m, sync=sync)
