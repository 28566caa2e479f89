"""Disk eviction: the mover making room on the local disk.

A disk write that does not fit, or a background pass past the disk's high mark, moves
the disk's coldest sequences (by the eviction policy) to the remote tier and deletes
their disk copies; without a remote tier (``policy.disk_full = "evict"``) it drops them
instead. A sequence leaves the disk only once its copy is in Redis; pinned sequences,
sequences being read or moved, and shared blocks still referenced are never victims.

Locks as in ``mover.py``: a victim's ``Seq.move_lock`` is only ever *tried* (a promotion
holding it keeps its sequence), metadata changes happen under the index lock, and no
disk or Redis I/O runs under the index lock.

Primitives:
- ``evict_disk(mover, need, target=None, exclude=None) -> bool``: make the disk hold at
  most ``target`` bytes (default: room for ``need`` more); True when it got there.
  With a remote tier, up to ``tiers.remote.evict_parallel`` victims move at once
  (``Mover.evict_pool``), so one's round trips, LMDB read and delete overlap the others'.
- ``disk_drop(mover, victim) -> bool``: no remote tier: free one disk copy (dropping the
  sequence when it was its only copy).
- ``disk_to_remote(mover, victim) -> bool``: copy one sequence to remote (unless that
  generation is there now, checked in Redis: a remembered copy may have expired), then
  delete its disk copy.
- ``claim_on_disk(mover, victim) -> Seq | None``: a disk-resident sequence with its move
  lock held, if no other move owns it. ``victim`` is the ``Seq`` a plan chose (acted on
  only while it is still the indexed version), or an id.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

from kvpark.proto.errors import KVParkError
from kvpark.tiers.remote import GONE

from . import remote_moves
from .model import Seq

if TYPE_CHECKING:
    from .mover import Mover

log = logging.getLogger("kvpark.mover")


def evict_disk(mover: "Mover", need: int, target: int | None = None, exclude: Seq | None = None) -> bool:
    """Make the disk hold at most ``target`` bytes (default: room for ``need`` more)
    by moving its coldest sequences to the remote tier, or (no remote tier,
    ``policy.disk_full = "evict"``) by dropping them. True when it got there.

    A sequence leaves the disk only once its copy is in Redis; with Redis down
    nothing moves (the breaker makes that quick) and the caller's write fails as it
    would without a remote tier. Without one, a sequence whose only copy is on disk
    is dropped from the index (a later restore raises NotFound); one that also sits
    in memory only loses its disk copy. Pinned sequences, sequences being read or
    moved, and shared blocks still referenced are never victims.
    """
    if mover.remote is None and not mover.disk_evicts:
        return False
    if need > mover.disk.capacity:
        return False  # nothing we drop makes it fit
    cap = mover.disk.capacity
    goal = cap - need if target is None else target
    from .mover import ROOM_WAIT_S  # the mover's room wait; imported here, as mover.py imports this module

    deadline = time.monotonic() + ROOM_WAIT_S
    while True:
        with mover.catalog.lock:
            used = mover.disk.used
            if used <= goal:
                return True
            # The coldest few of the disk's eviction order, not a sort of the index; a
            # read lease on a disk copy (a granted restore) keeps it.
            plan = mover.catalog.disk_victims(
                lambda s: (s is not exclude and not s.moving and not any(s.readers.values())
                           and not (s.pinned and (mover.remote is None or s.tier == "disk"))
                           and not (s.shared and mover.catalog.refcount(s.seq_id)) and s.on_disk),
                used - goal)
        moved = False
        serial = plan
        if mover.remote is not None and len(plan) > 1 and mover.evict_pool is not None:
            moved, down = _to_remote_many(mover, plan, goal)
            if down:
                return False  # Redis is down: stop here, fail fast
            serial = []  # tried, every one (``plan`` still says whether there were victims)
        for victim in serial:  # the records chosen: an id re-parked meanwhile is another version
            if mover.disk.used <= goal:
                return True
            if mover.remote is None:
                moved |= disk_drop(mover, victim)
            elif disk_to_remote(mover, victim):
                moved = True
            elif mover.remote.store.breaker.state != "closed":
                return False  # Redis is down: stop here, fail fast
        if mover.disk.used <= goal:
            return True
        if moved:
            continue
        # Nothing moved: the victims were busy (another eviction or a promotion holds
        # them, or they are being read). Wait for that to end, within the deadline.
        with mover.catalog.lock:
            left = deadline - time.monotonic()
            if left <= 0 or not plan:
                return False
            mover.catalog.changed.wait(min(0.05, left))


def _to_remote_many(mover: "Mover", plan: list[Seq], goal: int) -> tuple[bool, bool]:
    """``disk_to_remote`` of the victims in ``plan``, up to ``tiers.remote.evict_parallel``
    at once, in plan order, until the disk holds at most ``goal`` bytes. Each move is the
    one-at-a-time move, whole (its claim, copy, checks under the index lock, stub and
    delete): what runs at once is only what already could, in several threads making
    room. Returns (any moved, Redis down): once the breaker opens, no new move starts."""
    assert mover.remote is not None and mover.evict_pool is not None
    pool, breaker = mover.evict_pool, mover.remote.store.breaker
    todo = iter(plan)
    running: set[concurrent.futures.Future[bool]] = set()
    moved = down = False

    def start() -> None:
        while len(running) < mover.evict_parallel and not down and mover.disk.used > goal:
            victim = next(todo, None)
            if victim is None:
                return
            try:
                running.add(pool.submit(disk_to_remote, mover, victim))
            except RuntimeError:  # the mover has closed (a flush at stop still makes room): here
                f: concurrent.futures.Future[bool] = concurrent.futures.Future()
                f.set_result(disk_to_remote(mover, victim))
                running.add(f)

    start()
    while running:
        done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for f in done:
            running.discard(f)
            if f.result():  # disk_to_remote answers False for any failure it logged
                moved = True
            elif breaker.state != "closed":
                down = True
        start()
    return moved, down


def disk_drop(mover: "Mover", victim: Seq | str) -> bool:
    """Without a remote tier: free one sequence's disk copy, dropping the sequence
    when the disk held its only copy. True when the disk copy is gone."""
    seq = claim_on_disk(mover, victim)
    if seq is None:
        return False
    seq_id = seq.seq_id
    try:
        with mover.catalog.lock:
            # Checked again under the lock: a reader, a pin or a new reference since
            # the plan keeps it; a version no longer indexed is no one's to evict.
            if (seq.dropped or not seq.on_disk or seq.moving or any(seq.readers.values()) or seq.pinned
                    or (seq.shared and mover.catalog.refcount(seq_id)) or not mover.catalog.current(seq)):
                return False
            todo = [seq]
            retired = not seq.res
            if retired:  # the disk held its only copy: it leaves the index too
                mover.catalog.retire(seq)
                todo += mover.catalog.take_orphans()
                mover.deletes.claim(todo)  # an answer of absence waits for these deletes
        mover.delete_all(todo, claimed=retired)  # a failed delete is retried; the accounting follows the index
        with mover.catalog.lock:
            mover.catalog.notify()
        mover.count_eviction("disk")
        log.debug("evicted %r from disk%s", seq_id, "" if seq.res else " (its only copy: dropped)")
        return True
    finally:
        mover.catalog.unclaim(seq)


def disk_to_remote(mover: "Mover", victim: Seq | str) -> bool:
    """Write one disk-resident sequence to remote (unless it is there), then delete
    its disk copy. True when the disk copy is gone."""
    assert mover.remote is not None
    seq = claim_on_disk(mover, victim)
    if seq is None:
        return False
    seq_id = seq.seq_id
    try:
        m = seq.manifest
        t0 = time.perf_counter()
        # A remembered "it is in Redis" is not proof: Redis may have expired or evicted
        # the keys since, or another daemon deleted them. Checked (and with ttl_s, the
        # TTL refreshed) right before the only local copy goes; gone means copy again.
        # Replaced means a later write of the id (another daemon's) is what Redis
        # serves: this version is superseded there, and copying it would hide that one.
        if seq.on_remote and mover.remote.copy_state(m) == GONE:
            log.warning("remote copy of %r (generation %d) is gone from Redis; copying it again before "
                        "it leaves the disk", seq_id, m.gen)
            with mover.catalog.lock:
                seq.on_remote = False
            # Its remains first (a manifest over missing chunks): while the copy is
            # rewritten, no reader finds that manifest, misses a chunk and deletes the
            # generation under the rewrite.
            mover.remote.store.delete(m)
        if not seq.on_remote:
            with mover.catalog.lock:
                if seq.dropped:
                    return False
                # A drop from here on tombstones this version: no miss adopts the copy
                # between its landing in Redis and the delete below (``remote_tier.py``).
                mover.remote.put_begin(m)
            written = False
            try:
                remote_moves.put_disk_copy(mover, m)
                written = True
            finally:
                stale = remote_moves.end_copy(mover, seq, written)
            if stale:
                return False
            mover.moved("disk", "remote", t0)
        with mover.catalog.lock:
            # Checked again under the lock, as ``disk_drop`` does: a read lease granted from
            # the disk copy while it was copied pins it (no eviction takes a leased copy), a
            # pin since keeps it, and a version no longer indexed was deleted by its drop.
            if (seq.dropped or not seq.on_disk or seq.readers.get("disk") or seq.pinned
                    or not mover.catalog.current(seq)):
                return False
        # Redis alone will hold it: a stub on disk keeps it indexed across a restart (an
        # overwrite or drop after one must tombstone it, not leave it to be adopted back).
        mover.remote.stub(seq)
        mover.delete_all([seq])  # a failed delete is retried; the copy is in remote either way
        with mover.catalog.lock:
            mover.catalog.notify()
        mover.count_eviction("disk")
        return True
    except KVParkError as e:
        log.warning("eviction of %r from disk to remote failed: %s", seq_id, e)
        return False
    finally:
        mover.catalog.unclaim(seq)


def claim_on_disk(mover: "Mover", victim: Seq | str) -> Seq | None:
    """The victim's record (the one chosen; an id: the one indexed now) with its move
    lock held, if it is on disk and no promotion or other move owns it right now; else
    None. The caller releases it with ``Catalog.unclaim``."""
    with mover.catalog.lock:
        seq = mover.catalog.find(victim) if isinstance(victim, str) else victim
        if seq is None or seq.dropped or not seq.on_disk:
            return None
    return seq if mover.catalog.claim(seq, blocking=False) else None

