"""The flush: every memory-only sequence written to disk, many per transaction.

A daemon stopping with a million small blocks in memory wrote one LMDB transaction per
block (72 s for 1M 1 KiB blocks on the 2-core dev VM); batches of up to ``BATCH``
sequences or ``BATCH_BYTES`` go in one ``DiskStore.write_many`` each, with one
``evict_disk`` for the batch. A batch the disk refuses (full) is retried one sequence at
a time, so what fits is still written, exactly as before.

Each sequence is handled as ``Mover.write_to_disk`` handles one: its memory copy is
pinned (``moving``) while it is read, a sequence dropped or overwritten meanwhile gets
no ``on_disk`` and what was written for it is deleted, and a newer generation already
on disk wins (``write_many`` skips the stale write).

Primitives:
- ``flush(mover, prefix="") -> int``: write them all (with ``prefix``, those of one
  tenant's namespace only); returns how many were written.
- ``write_batch(mover, seqs, evict=True) -> int``: one batch, one transaction
  (``evict=False``: no disk eviction first, and a sequence whose blocks are not on disk
  is left out, not written after them).
- ``write_back(mover, room, budget_s) -> int``: one write-back pass under write_back's
  dirty bounds (``dirty.py``): the oldest memory-only sequences past a bound, in
  batches, into at most ``room`` bytes of free disk, for about ``budget_s`` seconds.
- ``write_one(mover, seq) -> bool``: one sequence (``Mover.write_to_disk``), the shared
  blocks it references first.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvpark.proto.errors import KVParkError
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import Write

from .model import Seq

if TYPE_CHECKING:
    from .mover import Mover

log = logging.getLogger("kvpark.flush")

BATCH = 1024
BATCH_BYTES = 64 << 20


def flush(mover: "Mover", prefix: str = "") -> int:
    """Write every memory-only sequence (of namespace ``prefix``, if given) to disk,
    keeping its memory copies."""
    with mover.catalog.lock:
        if prefix:
            todo = [s for s in mover.catalog.in_namespace(prefix) if s.res and not s.on_disk]
        else:  # read in place: a stop with a million blocks indexed as rows thaws none of them
            todo = mover.catalog.memory_only()
    total = len(todo)
    done, last, i = 0, time.monotonic(), 0
    while i < total:
        batch, size = [todo[i]], todo[i].manifest.nbytes
        i += 1
        while i < total and len(batch) < BATCH and size + todo[i].manifest.nbytes <= BATCH_BYTES:
            size += todo[i].manifest.nbytes
            batch.append(todo[i])
            i += 1
        try:
            done += write_batch(mover, batch)
        except KVParkError:
            for s in batch:  # the disk refused the batch (full): what fits still goes, one by one
                try:
                    done += mover.write_to_disk(s)
                except KVParkError as e:
                    log.error("flush: sequence %r not written: %s", s.seq_id, e)
        if time.monotonic() - last > 1.0:
            log.info("flush: %d/%d sequences on disk", done, total)
            last = time.monotonic()
    mover.disk.fsync()
    if total:
        log.info("flush: %d/%d memory-only sequence(s) written to disk", done, total)
    return done


def write_back(mover: "Mover", room: int, budget_s: float) -> int:
    """Write back what is past the dirty bounds; returns how many sequences got a disk
    copy. Only free disk space is used (``room``): nothing is evicted for it."""
    cat = mover.catalog
    done, until = 0, time.monotonic() + budget_s
    while not mover.closed and room > 0 and time.monotonic() < until:
        with cat.lock:
            if mover.paused:  # someone waits for a quiet engine (check_invariants, a stop)
                break
            batch = cat.dirty.due(time.monotonic(), room, BATCH, BATCH_BYTES)
        if not batch:
            break
        room -= sum(s.manifest.nbytes for s in batch)
        try:
            n = write_batch(mover, batch, evict=False)
        except Exception as e:  # noqa: BLE001 - a disk error: the flush at stop (or demotion) still writes them
            with cat.lock:
                cat.dirty.requeue(batch, time.monotonic())
            log.warning("write-back: %d sequence(s) not written now: %s", len(batch), e)
            break
        with cat.lock:
            # Left out (their blocks first) or refused: memory-only still.
            cat.dirty.requeue((s for s in batch if not s.on_disk), time.monotonic())
        done += n
        if n == 0:
            break
    return done


def write_batch(mover: "Mover", seqs: list[Seq], evict: bool = True) -> int:
    """Give each of ``seqs`` a disk copy in one transaction; returns how many got one now."""
    cat = mover.catalog
    with cat.lock:
        need = sum(s.manifest.nbytes for s in seqs if not (s.dropped or s.on_disk or not s.res))
    if evict:
        mover.evict_disk(need)
    picked: list[tuple[Seq, str, Allocation]] = []
    # Queued deletes of a picked sequence's old disk copy (an eviction's that failed):
    # taken over for the write, so no retry deletes the records it writes (same keys).
    own: dict[int, list] = {}
    later: list[Seq] = []
    with cat.lock:
        if not evict and mover.paused:
            # Write-back yields to quiet() here too: between its pick and this point
            # nothing counts it as busy, so a quiet() taken meanwhile would not wait for it.
            return 0
        batch = {id(s) for s in seqs}
        for s in seqs:
            if s.dropped or s.on_disk or not s.res or mover.deletes.deleting(s):
                continue  # (a disk eviction deleting its old copy: the same record keys)
            if any((b := cat.find(r)) is not None and not (b.on_disk or b.on_remote or id(b) in batch)
                   for r in s.refs):
                # A block it references is not on disk and not in this transaction: the
                # sequence goes after it (``Mover.write_to_disk``), never before.
                later.append(s)
                continue
            src = s.cpu_copy
            assert src is not None
            cat.copy_begin(s)  # pins the memory copy while we read it
            picked.append((s, src, s.res[src]))
            own[id(s)] = mover.deletes.take_own(s)  # its queued deletes: ours for the write
    if not evict:
        later = []  # written after their blocks, by a later pass (which never evicts for them)
    if not picked:
        return sum(mover.write_to_disk(s) for s in later)
    written: list[bool] = []
    stale: list[Seq] = []
    t0 = time.perf_counter()
    try:
        written = mover.disk.write_many([Write(s.manifest, mover.tiers[src].views(a), live=lambda s=s: not s.dropped)
                                          for s, src, a in picked])
    finally:
        with cat.lock:
            for k, (s, _, _) in enumerate(picked):
                cat.copy_end(s)
                landed = False
                if written and written[k]:
                    if s.dropped:  # dropped or overwritten while we wrote
                        stale.append(s)
                        mover.cleanups += 1
                    else:
                        s.on_disk = landed = True
                        cat.dirty.untrack(s)
                        cat.touch(s, "disk")  # its place in the disk's eviction order
                mover.deletes.taken_over(own.get(id(s), []), landed)
                cat.release_dropped(s)
            # Waiters may demote these now. No version bump: see Mover.write_to_disk.
            cat.changed.notify_all()
    for s in stale:
        try:
            mover.deletes.delete_written(s.manifest)  # remove what we wrote
        finally:
            mover.cleaned()
    if mover.metrics is not None and written:
        share = (time.perf_counter() - t0) / len(picked)
        for (s, src, _), ok in zip(picked, written):
            if ok:
                mover.metrics.moved(src, "disk", share)
    done = sum(1 for (s, _, _), ok in zip(picked, written) if ok and s not in stale)
    return done + sum(mover.write_to_disk(s) for s in later)


def write_one(mover: "Mover", seq: Seq) -> bool:
    """Make sure ``seq`` has a disk copy; its memory copies are kept.

    A sequence's disk copy goes after those of the shared blocks it references: a
    crash in between must not leave it on disk, listed at the next start, with
    blocks that never got there (every restore of it would fail).
    """
    with mover.catalog.lock:
        if seq.dropped or seq.on_disk or not seq.res:
            return seq.on_disk
        blocks = [b for r in seq.refs if (b := mover.catalog.find(r)) is not None and not b.on_disk]
    for b in blocks:
        # A block only in remote is durable there (adopted at the next start).
        if not write_one(mover, b) and not b.on_remote:
            return False
    mover.evict_disk(seq.manifest.nbytes)
    with mover.catalog.lock:
        if seq.dropped or seq.on_disk or not seq.res:
            return seq.on_disk
        if mover.deletes.deleting(seq):
            return False  # its old disk copy (the same record keys) is being deleted: a later pass
        src = seq.cpu_copy
        assert src is not None
        alloc = seq.res[src]
        mover.catalog.copy_begin(seq)  # pins the memory copy while we read it
        own = mover.deletes.take_own(seq)  # as in ``write_batch``
    written = False
    t0 = time.perf_counter()
    try:
        written = mover.disk.write(seq.manifest, mover.tiers[src].views(alloc), live=lambda: not seq.dropped)
        if written:
            mover.moved(src, "disk", t0)
    finally:
        with mover.catalog.lock:
            mover.catalog.copy_end(seq)
            stale = seq.dropped  # dropped or overwritten while we wrote
            if written and not stale:
                seq.on_disk = True
                mover.catalog.dirty.untrack(seq)
                mover.catalog.touch(seq, "disk")
            mover.deletes.taken_over(own, landed=written and not stale)
            mover.catalog.release_dropped(seq)
            if written and stale:
                mover.cleanups += 1
            # Waiters may demote it now. No version bump: a write that failed (disk
            # full) must not send a make_room loop straight back to the same victim.
            mover.catalog.changed.notify_all()
            if written and mover.catalog.over_high():
                mover.catalog.wake.notify_all()  # the disk, say, past its high mark
    if written and stale:
        try:
            mover.deletes.delete_written(seq.manifest)  # remove what we wrote
        finally:
            mover.cleaned()
    return written and not stale
