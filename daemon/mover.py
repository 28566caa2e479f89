"""The mover: promote, demote, make room, prefetch; the policies decide, the copy engine copies.

*What* leaves a tier comes from ``kvpark.tiers.policy``; memory-to-memory bytes move
through the copy engine (``kvpark.tiers.copy``), whose completion path attaches the new
copy to its sequence: a reader never sees a half-copied slot, and a background demotion
leaves its device-to-host copy in flight while it moves on to the next victim. Disk
bytes move through the disk store, never under the index lock.

Locks: ``Seq.move_lock`` serialises the moves of one sequence (a promotion holds it
while it copies; demotion only ever *tries* it, so two promotions making room for each
other cannot deadlock). Metadata changes happen under the index lock
(``Catalog.lock``), which is never held across I/O. Lock order: ``move_lock`` -> index lock.

Primitives:
- ``Mover(catalog, leases, disk, copy, PolicyConfig, slot_size, remote=None, metrics=None)``;
  ``evictions``: per tier, copies freed to make room (demotions, and disk copies moved to
  remote); with ``metrics``, every copy
  between tiers is counted and timed (``kvpark_moves_total``, ``kvpark_move_seconds``) and
  every eviction counted.
- ``promote(seq, to, make_room, lease=None) -> bool``: bring a copy into memory tier
  ``to`` (disk blocks are verified on the way; a disk sequence bound for the device is
  staged through host). A sequence whose copies belong in the private tier goes there
  instead, whatever ``to`` says (``placement.py``): every promotion, batched or not,
  passes through this choice, so none puts such a sequence in memory a client maps.
  With ``lease``, the copy is leased in the same step that finds it ready, so a
  demotion cannot take it away in between; True when leased.
- ``promote_batch(seqs, to)``: the memory-resident ones among ``seqs`` in one copy job
  (a restore of many blocks); what does not fit now is left to ``promote``.
- ``demote(victim, tier, jobs=None) -> bool``: move one copy down a tier; ``victim`` is
  the ``Seq`` a plan chose (a version dropped or replaced since is left alone) or an id.
- ``await_room(tier, need, exclude, deadline) -> bool``: demote, or wait on the catalog's
  ``changed`` condition for in-flight work to free room.
- ``relieve() -> int``: one background pass: every tier past its high mark down to its low mark.
- ``write_back() -> int``: one pass of write_back's dirty bounds (``dirty.py``,
  ``flush.write_back``), into free disk space only.
- ``write_to_disk(seq) -> bool`` (the shared blocks it references first); ``flush() -> int``
  (batched: ``flush.py``).
- ``delete_from_disk(seq)``; ``delete_all(seqs) -> KVParkError | None`` (every one tried);
  ``retry_deletes()`` (the maintenance pass): ``deletes.py``. ``cleanups`` / ``cleaned()``:
  records a write landed for a version retired meanwhile, not yet deleted (``quiet`` waits).
- The remote tier (when configured), below disk: ``promote`` reads a sequence known
  only from remote straight into memory (verified); ``fetch_remote(seq)`` brings one
  onto the local disk instead (when memory has no room, or it is served from disk);
  ``evict_disk(need, target=None)`` writes the disk's coldest sequences (by the
  eviction policy; not pinned there, not being read or moved) to remote and deletes
  them from disk, so a disk write fits (also from ``relieve`` past the disk's high
  mark); ``copy_to_remote_later(seqs)`` queues background copies (write_through).
- Without a remote tier, ``evict_disk`` drops the disk's coldest sequences instead
  (``policy.disk_full = "evict"``, the default; "refuse" keeps a full disk full).
- The disk-eviction paths live in ``disk_evict.py``, the reads from and copies to Redis
  in ``remote_moves.py``; ``Mover`` keeps the entry points above.
- ``prefetch(seq, tier, wait, timeout) -> str`` (``prefetch.py``; waited: a version an
  overwrite replaced meanwhile is prefetched as the new one; only a drop is ``NotFound``);
  ``idle`` (``idle_work.IdleWork``: work held for a lull in reads and parks);
  ``write_to_disk`` is ``flush.write_one``; ``quiet()`` (no
  demotion starts, moves in flight land: for invariant checks); ``close()``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

from kvpark.proto.errors import DataLoss, KVParkError, NotFound, Unavailable
from kvpark.proto.sizes import human
from kvpark.tiers import policy
from kvpark.tiers.arena import Allocation
from kvpark.tiers.copy import D2H, H2D, CopyEngine, CopyJob, runs
from kvpark.tiers.disk import DiskStore

from . import disk_evict, flush, remote_moves
from .prefetch import Prefetches
from .idle_work import IdleWork
from .catalog import Catalog
from .deletes import Deletes
from .config import PolicyConfig
from .leases import LeaseTable
from .metrics import Metrics
from .model import MEM_TIERS, Lease, Seq
from .remote_tier import RemoteTier

log = logging.getLogger("kvpark.mover")

# How long a park or promotion waits for in-flight work (copies, reads, other
# reservations) to free room before it gives up with RESOURCE_EXHAUSTED.
ROOM_WAIT_S = 10.0
# How long a move waits for its copy between memory tiers: far beyond any real copy
# (64 GiB at PCIe speed), so only a hung device reaches it. The copy's completion still
# attaches or frees its slots whenever it comes; the waiter gives up with UNAVAILABLE.
COPY_WAIT_S = 120.0
# How long a move waits for another move of the same sequence (its move lock): a
# promotion reading a large sequence from disk or Redis can take a while, a hung copy
# holds it for ever.
MOVE_WAIT_S = 300.0


def await_copy(job: CopyJob, timeout: float = COPY_WAIT_S) -> None:
    """Wait for ``job`` (re-raising its failure); ``Unavailable`` after ``timeout``."""
    if not job.wait(timeout):
        raise Unavailable(f"a copy between memory tiers ({human(job.nbytes)}, {job.direction}) did not finish in "
                          f"{timeout:.0f} s: the device may be hung; the copy's slots are freed if it ever ends")
# One write-back pass writes for about this long, so the maintenance thread still reaps
# leases and expires TTLs on time; it runs again at once while there is more.
WRITE_BACK_BUDGET_S = 0.5


class Mover:
    def __init__(self, catalog: Catalog, leases: LeaseTable, disk: DiskStore, copy: CopyEngine,
                 config: PolicyConfig, slot_size: int, remote: RemoteTier | None = None,
                 metrics: Metrics | None = None) -> None:
        self.catalog = catalog
        self.remote = remote
        self.metrics = metrics
        self.evictions: dict[str, int] = {}  # REQUIRES: index lock to change
        self.disk_high = config.high_watermark
        self.disk_low = config.low_watermark
        self.tiers = catalog.tiers
        self.leases = leases
        self.disk = disk
        self.copy = copy
        self.eviction = config.eviction
        self.disk_evicts = config.disk_full == "evict"
        self.slot_size = slot_size
        self.closed = False
        self._paused = 0  # quiet() holders: no demotion starts
        # Disk writes that landed for a version retired meanwhile, their records not yet
        # deleted (``delete_written`` runs after the copy has ended): quiet() waits for
        # them too, or the store would hold a generation the index no longer counts.
        # REQUIRES: index lock.
        self.cleanups = 0
        self.deletes = Deletes(catalog, disk)  # a failed delete is retried (``deletes.py``)
        self.prefetches = Prefetches(self)
        self.idle = IdleWork()  # promotions after disk grants, held for a lull in reads and parks
        # Disk eviction to remote, several sequences at once (``disk_evict.py``).
        self.evict_parallel = remote.store.opts.evict_parallel if remote is not None else 1
        self.evict_pool = (ThreadPoolExecutor(self.evict_parallel, thread_name_prefix="kvpark-evict")
                           if self.evict_parallel > 1 else None)

    def close(self) -> None:
        """Stop taking moves; in-flight prefetches are cancelled or finish."""
        with self.catalog.lock:
            self.closed = True
            self.catalog.changed.notify_all()
        self.idle.close()  # before the pool it hands promotions to
        self.prefetches.close()
        if self.evict_pool is not None:
            self.evict_pool.shutdown(wait=True)  # moves under way end (each is bounded by Redis's timeouts)

    @property
    def paused(self) -> bool:
        """Someone holds ``quiet()``: no demotion or write-back starts. REQUIRES: index lock."""
        return self._paused > 0

    @contextmanager
    def quiet(self, timeout: float = 10.0) -> Iterator[None]:
        """Hold off new demotions and wait (up to ``timeout``) for moves in flight to land."""
        with self.catalog.lock:
            self._paused += 1
            deadline = time.monotonic() + timeout
            while (self.catalog.busy() or self.cleanups) and time.monotonic() < deadline:
                self.catalog.changed.wait(deadline - time.monotonic())
        try:
            yield
        finally:
            with self.catalog.lock:
                self._paused -= 1

    # ------------------------------------------------------------------ promotion

    def promote(self, seq: Seq, to: str, make_room: bool, lease: Lease | None = None) -> bool:
        to = self.catalog.placement.tier(seq.seq_id, to)
        if seq.manifest.block_size != self.slot_size:
            self.fetch_remote(seq)
            return False  # parked under another slot size; served from disk as it is
        try:
            self.catalog.claim(seq, timeout=MOVE_WAIT_S)
            try:
                if to == "device" and "host" not in seq.res and "device" not in seq.res:
                    self._promote_locked(seq, "host", make_room=False)  # stage via pinned host memory
                self._promote_locked(seq, to, make_room)
                if lease is None:
                    return False
                with self.catalog.lock:  # still under move_lock: no demotion can start on it
                    if to not in seq.res or seq.dropped:
                        return False
                    seq.add_reader(to)
                    lease.parts.append((seq, to))
                    return True
            finally:
                self.catalog.unclaim(seq)
        finally:
            with self.catalog.lock:
                self.catalog.notify()  # a demotion waiting for this sequence may take it now

    def promote_batch(self, seqs: list[Seq], to: str) -> None:
        """Promote the memory-resident ones among ``seqs`` into ``to`` with one copy job
        (per tier they go to: see ``promote``).

        A restore of many blocks would otherwise submit and wait one job per block.
        Disk-only sequences, and any this cannot place, are left to ``promote``.
        """
        groups: dict[str, list[Seq]] = {}
        for s in seqs:
            groups.setdefault(self.catalog.placement.tier(s.seq_id, to), []).append(s)
        for tier, group in groups.items():
            self._promote_batch(group, tier)

    def _promote_batch(self, seqs: list[Seq], to: str) -> None:
        with self.catalog.lock:
            uniq = {id(s): s for s in seqs if to not in s.res and s.res and not s.dropped
                    and s.manifest.block_size == self.slot_size}
        todo = sorted(uniq.values(), key=lambda s: s.seq_id)  # one lock order for every batch
        if len(todo) < 2:
            return
        locked: list[Seq] = []
        planned: list[tuple[Seq, str, Allocation, Allocation]] = []  # (seq, src tier, src, dst)
        mem = self.tiers[to]
        submitted = False

        def finish(landed: bool) -> None:
            # Once: from the copy's completion when it was submitted (so a wait that gives
            # up never frees slots a copy still writes), else on the way out below.
            with self.catalog.lock:
                for seq, _, _, a in planned:
                    self.catalog.copy_end(seq)
                    if landed and not seq.dropped:
                        seq.res[to] = a
                        self.catalog.touch(seq, to)
                    else:
                        self.catalog.free(to, a)
                    self.catalog.release_dropped(seq)
                self.catalog.notify()
            for seq in locked:
                self.catalog.unclaim(seq)

        try:
            for seq in todo:
                self.catalog.claim(seq, timeout=MOVE_WAIT_S)  # demotion only ever tries these, so no cycle
                locked.append(seq)
            for seq in todo:
                # Only what fits now: making room would wait on the move locks this batch
                # holds. The rest is promoted one by one (making room) by ``promote``.
                a = self._alloc_in(to, seq, make_room=False)
                if a is None:
                    continue  # there already, dropped, or no room
                with self.catalog.lock:
                    src = next((t for t in MEM_TIERS if t in seq.res and t != to), None)
                    if src is None:
                        self.catalog.free(to, a)
                        continue
                    self.catalog.copy_begin(seq)  # the source copy cannot be freed under the copy
                    planned.append((seq, src, seq.res[src], a))
            if not planned:
                return
            pieces = [(mem.tensor(d, n), self.tiers[src].tensor(o, n))
                      for _, src, src_alloc, dst_alloc in planned
                      for o, d, n in runs(src_alloc.extents, dst_alloc.extents)]
            job = self.copy.submit(pieces, restore=True, on_done=lambda j: finish(j.error is None),
                                   direction=H2D if to == "device" else D2H)
            submitted = True
            await_copy(job)
        finally:
            if not submitted:
                finish(False)

    def _promote_locked(self, seq: Seq, to: str, make_room: bool) -> None:
        # REQUIRES: seq.move_lock held.
        mem = self.tiers[to]
        a = self._alloc_in(to, seq, make_room)
        if a is None:
            return
        src = next((t for t in MEM_TIERS if t in seq.res and t != to), None)
        if src is not None:
            try:
                job = self._copy(seq, src, to, a, restore=True)
            except BaseException:
                with self.catalog.lock:
                    self.catalog.free(to, a)
                raise
            await_copy(job)  # the completion path attached the copy (or freed the slots on failure)
            return
        t0 = time.perf_counter()
        try:
            if not seq.on_disk and seq.on_remote:
                # Straight from Redis into memory: no disk write on the restore path, and
                # into the host arena's slots themselves (no staging buffer).
                if mem.on_cpu:
                    remote_moves.remote_guard(self, seq, lambda: self.remote.fetch_into(seq.manifest, mem.views(a)))
                else:
                    for (off, _n), block in zip(a.extents, remote_moves.remote_blocks(self, seq)):
                        mem.write(off, block)
                self.moved("remote", to, t0)
            else:
                with self.disk.read_txn() as r:
                    for i, (off, n) in enumerate(a.extents):
                        try:
                            block = r.read_block(seq.manifest, i, n)
                        except DataLoss:
                            with self.catalog.lock:
                                gone = seq.dropped
                            if gone:  # dropped or replaced under us: gone, not corrupt
                                raise NotFound(f"sequence {seq.seq_id!r} was dropped or overwritten during the "
                                               "restore") from None
                            raise
                        mem.write(off, block)
                self.moved("disk", to, t0)
        except BaseException:
            with self.catalog.lock:
                self.catalog.free(to, a)
            raise
        with self.catalog.lock:
            seq.promotions += 1
            if seq.dropped:
                self.catalog.free(to, a)
                return
            seq.res[to] = a
            self.catalog.touch(seq, to)

    def _alloc_in(self, tier: str, seq: Seq, make_room: bool) -> Allocation | None:
        assert self.catalog.placement.allowed(seq.seq_id, tier), f"{seq.seq_id!r} may not be in the {tier} tier"
        mem = self.tiers[tier]
        if seq.manifest.nbytes > mem.alloc.capacity:
            return None  # never fits (a windowed park's sequence): it stays where it is, nothing is demoted for it
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            with self.catalog.lock:
                if tier in seq.res or seq.dropped:
                    return None
                a = mem.alloc.alloc(seq.manifest.nbytes)
            if a is not None or not make_room or not self.await_room(tier, seq.manifest.nbytes, seq, deadline):
                return a

    def _copy(self, seq: Seq, src: str, dst: str, dst_alloc: Allocation, restore: bool,
              then: Callable[[bool], None] | None = None) -> CopyJob:
        """Submit a copy of ``seq``'s bytes from ``src`` into ``dst_alloc``.

        Once submitted, the completion path owns ``dst_alloc``: it attaches it as the
        sequence's ``dst`` copy, or frees it (failed copy, or the sequence was dropped
        meanwhile), then calls ``then(attached)``.
        """
        t0 = time.perf_counter()
        with self.catalog.lock:
            src_alloc = seq.res.get(src)
            if src_alloc is None:  # dropped (its copies freed) since the caller looked
                raise NotFound(f"sequence {seq.seq_id!r} was dropped during a move")
            self.catalog.copy_begin(seq)  # the source copy cannot be freed under the copy

        def done(job: CopyJob) -> None:
            with self.catalog.lock:
                self.catalog.copy_end(seq)
                attached = job.error is None and not seq.dropped and dst not in seq.res
                if attached:
                    seq.res[dst] = dst_alloc
                    self.catalog.touch(seq, dst)
                else:
                    self.catalog.free(dst, dst_alloc)
                self.catalog.release_dropped(seq)
                self.catalog.notify()
            if job.error is None:
                self.moved(src, dst, t0)
            if then is not None:
                then(attached)

        s_mem, d_mem = self.tiers[src], self.tiers[dst]
        pieces = [(d_mem.tensor(d, n), s_mem.tensor(s, n)) for s, d, n in runs(src_alloc.extents, dst_alloc.extents)]
        # The DMA direction is the tiers': a promotion from the device pool to host is
        # D2H whatever its priority (on a GPU the pieces say so themselves).
        way = H2D if dst == "device" else D2H if src == "device" else None
        try:
            return self.copy.submit(pieces, restore=restore, on_done=done, direction=way)
        except BaseException:
            with self.catalog.lock:
                self.catalog.copy_end(seq)
                self.catalog.release_dropped(seq)
            raise

    def prefetch(self, seq: Seq, tier: str, wait: bool = False, timeout: float | None = None,
                 then: Callable[[], None] | None = None) -> str:
        """Promote ``seq`` into ``tier`` in the background, or wait for it; ``then()`` once
        the promotion has ended (``prefetch.py``)."""
        return self.prefetches.prefetch(seq, tier, wait, timeout, then)

    # ------------------------------------------------------------------ demotion

    def await_room(self, tier: str, need: int, exclude: Seq | None, deadline: float) -> bool:
        """Demote (or wait for in-flight work to free space) so ``need`` bytes may fit in ``tier``.

        False when waiting cannot help: nothing is demotable and nothing in flight
        (a copy, a read, a reservation) will free space before ``deadline``.
        """
        with self.catalog.lock:
            if self.closed:
                return False  # shutting down: the tiers are about to go
            seen = self.catalog.version
        if self.make_room(tier, need, exclude):
            return True
        with self.catalog.lock:
            # Room now, or something changed since make_room chose its victims (a reader
            # left, a copy landed): look again at once rather than wait for the next change.
            if self.tiers[tier].alloc.fits(need) or self.catalog.version != seen:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or self.closed or not (self.leases.transient() or self.catalog.busy(exclude)):
                return False
            # Frees, readers leaving and copies ending all notify ``changed``.
            self.catalog.changed.wait(left)
        return True

    def make_room(self, tier: str, need: int, exclude: Seq | None = None) -> bool:
        """Demote in policy order until ``need`` bytes fit in ``tier``. True if it fits now.

        The byte target alone is not enough: packed tails fragment slots, so the loop
        checks the allocator itself after every victim.
        """
        mem = self.tiers[tier]
        while True:
            with self.catalog.lock:
                if mem.alloc.fits(need):
                    return True
                # Just enough victims to cover the shortfall (a fragmented tier may need
                # another round): the coldest few of the tier's order, not a sort of it all.
                order = self.catalog.demotion_plan(tier, exclude, max(need - mem.alloc.free_bytes, self.slot_size))
            freed = False
            for seq in order:
                freed |= self.demote(seq, tier)  # the version chosen, not whatever holds its id by now
                with self.catalog.lock:
                    if mem.alloc.fits(need):
                        return True
            if not freed:
                return False

    def demote(self, victim: Seq | str, tier: str, jobs: list[CopyJob] | None = None) -> bool:
        """Move ``victim``'s copy out of ``tier`` to the next tier down. True if freed (or in flight).

        ``victim`` is the record chosen (a plan made under the index lock): a version
        dropped or replaced since is left alone, never the one now under its id. An id
        (tools, benches) means the version indexed now.
        With ``jobs``, a device-to-host copy is left in flight and appended to it; its
        completion frees the device copy.
        """
        with self.catalog.lock:
            seq = self.catalog.find(victim) if isinstance(victim, str) else victim
            if seq is None or seq.dropped or tier not in seq.res or self._paused:
                return False
        seq_id = seq.seq_id
        if not self.catalog.claim(seq, blocking=False):
            return False  # a promotion or another demotion owns it right now
        handed_off = False
        try:
            if tier == "device" and "host" not in seq.res and not seq.on_disk:
                a = self._alloc_in("host", seq, make_room=True)
                if a is not None:
                    def finished(attached: bool) -> None:  # on the copy engine's completion path
                        try:
                            if attached:
                                self._evicted(seq, tier)
                        finally:
                            self.catalog.unclaim(seq)
                            with self.catalog.lock:
                                self.catalog.notify()

                    try:
                        job = self._copy(seq, "device", "host", a, restore=False, then=finished)
                    except BaseException:
                        with self.catalog.lock:
                            self.catalog.free("host", a)
                        raise
                    handed_off = True
                    if jobs is not None:
                        jobs.append(job)
                        return True
                    await_copy(job)
                    with self.catalog.lock:
                        return tier not in seq.res
            if not any(t in seq.res for t in MEM_TIERS if t != tier):
                self.write_to_disk(seq)  # host demotion, or device when host had no room
        except KVParkError as e:
            log.warning("demotion of %r from %s failed: %s", seq_id, tier, e)
            return False
        finally:
            if not handed_off:
                self.catalog.unclaim(seq)
        return self._evicted(seq, tier)

    def _evicted(self, seq: Seq, tier: str) -> bool:
        """Drop a demoted sequence's copy in ``tier``; count it as an eviction when freed."""
        if not self._drop_copy(seq, tier):
            return False
        self.count_eviction(tier)
        return True

    def count_eviction(self, tier: str) -> None:
        with self.catalog.lock:
            self.evictions[tier] = self.evictions.get(tier, 0) + 1
        if self.metrics is not None:
            self.metrics.evicted(tier)

    def moved(self, src: str, dst: str, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.moved(src, dst, time.perf_counter() - t0)

    def _drop_copy(self, seq: Seq, tier: str) -> bool:
        """Free ``seq``'s copy in ``tier`` if another copy remains and nobody reads it."""
        with self.catalog.lock:
            elsewhere = seq.on_disk or any(t in seq.res for t in MEM_TIERS if t != tier)
            if elsewhere and tier in seq.res and not seq.readers.get(tier) and not seq.moving:
                self.catalog.free(tier, seq.res.pop(tier))
                return True
        return False

    def relieve(self) -> int:
        """One background pass: demote every tier past its high mark to its low mark."""
        moved = 0
        for name in MEM_TIERS:  # device first: its demotions may push host over
            mem = self.tiers.get(name)
            if mem is None:
                continue
            with self.catalog.lock:
                plan: list[Seq] = []
                if policy.over_high(mem.alloc.used_bytes, mem.alloc.capacity, mem.high):
                    plan = self.catalog.demotion_plan(
                        name, None, mem.alloc.used_bytes - policy.background_target(mem.alloc.capacity, mem.low))
            jobs: list[CopyJob] = []
            try:
                for seq in plan:
                    if self.closed:
                        break
                    moved += self.demote(seq, name, jobs)
            finally:
                for job in jobs:  # device copies in flight land before host is relieved
                    try:
                        await_copy(job)
                    except Exception as e:  # noqa: BLE001 - the copy's completion frees or attaches its slots
                        log.warning("demotion copy from %s failed: %s", name, e)
        if not self.closed and self.disk_pressure():
            before = self.disk.used
            self.evict_disk(0, policy.background_target(self.disk.capacity, self.disk_low))
            moved += self.disk.used < before
        return moved

    def disk_pressure(self) -> bool:
        """The disk is past its high mark and something can evict from it."""
        return (self.remote is not None or self.disk_evicts) and \
            policy.over_high(self.disk.used, self.disk.capacity, self.disk_high)

    def write_back(self) -> int:
        """Write back what is past write_back's dirty bounds (``dirty.py``), into free disk
        space below the disk's low mark only: write-back never evicts, and never starts
        background disk eviction. Returns how many sequences got a disk copy."""
        with self.catalog.lock:
            if not self.catalog.dirty.enabled or self.closed or self._paused:
                return 0
        room = int(self.disk.capacity * self.disk_low) - self.disk.used
        return flush.write_back(self, room, WRITE_BACK_BUDGET_S)

    def write_to_disk(self, seq: Seq) -> bool:
        """Make sure ``seq`` has a disk copy (the shared blocks it references first); its
        memory copies are kept (``flush.write_one``)."""
        return flush.write_one(self, seq)

    def cleaned(self) -> None:
        """One ``cleanups`` entry is over (its records deleted, or queued for a retry)."""
        with self.catalog.lock:
            self.cleanups -= 1
            self.catalog.changed.notify_all()

    def delete_from_disk(self, seq: Seq) -> None:
        self.deletes.delete(seq)

    def delete_all(self, seqs: list[Seq], claimed: bool = False) -> KVParkError | None:
        """Delete the disk copies of ``seqs``, every one tried; the first failure is
        returned, and what failed is deleted again by ``retry_deletes`` (``deletes.py``)."""
        return self.deletes.delete_all(seqs, claimed=claimed)

    def retry_deletes(self) -> int:
        return self.deletes.retry()

    def flush(self) -> int:
        """Write every memory-only sequence to disk (keeping its memory copies), in
        batches of one transaction each (``flush.py``)."""
        return flush.flush(self)

    # ------------------------------------------------------------------ the remote tier

    def fetch_remote(self, seq: Seq) -> None:
        """If ``seq`` is known only from the remote tier, bring it onto the local disk."""
        if self.remote is None or not seq.on_remote:
            return
        self.catalog.claim(seq, timeout=MOVE_WAIT_S)
        try:
            remote_moves.fetch_remote_locked(self, seq)
        finally:
            self.catalog.unclaim(seq)

    def evict_disk(self, need: int, target: int | None = None, exclude: Seq | None = None) -> bool:
        """Make the disk hold at most ``target`` bytes (default: room for ``need`` more):
        its coldest sequences go to remote, or are dropped (``disk_evict.py``)."""
        return disk_evict.evict_disk(self, need, target, exclude)

    def copy_to_remote_later(self, seqs: list[Seq]) -> None:
        """write_through: copy each of ``seqs`` to remote in the background."""
        if self.remote is None:
            return
        for s in seqs:
            self.remote.copy_later(f"copy of {s.seq_id!r} to remote", lambda s=s: remote_moves.copy_to_remote(self, s))
