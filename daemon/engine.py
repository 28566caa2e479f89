"""The engine: the two-phase park and restore protocol, and the daemon's lifecycle.

Speaks dataclasses only (protobuf stops at the servicer). The jobs around it live in
their own modules: the index (``catalog.py``), the lease table (``leases.py``), moving
bytes between tiers (``mover.py``), the restore side's leasing and streaming
(``reads.py``), the maintenance pass, expiry, drops and the start-up reconcile
(``maintenance.py``), opening the memory tiers (``memory.py``), the records (``model.py``);
each tier keeps its own accounting (``kvpark.tiers``).

Primitives:
- ``Engine(config, disk_factory=DiskStore)``; ``start()``; ``close(flush=...)``; ``flush()``.
- Park, two-phase: ``reserve(ParkSpec, inline=False, tier=None) -> Reservation`` (slots
  under a write lease), ``write_chunk(lease_id, offset, data)`` for inline bytes,
  ``commit(lease_id) -> SeqInfo`` (publish: ``commit.py``), ``release(lease_id)`` (abort).
- Restore: ``acquire(seq_ids, need=None, stream=False) -> ReadHandle`` (memory copies under
  a read lease, or disk records; ``grant(handle)`` is its frozen view),
  ``iter_chunks(handle, size)``, ``release``.
- A payload larger than its memory tier moves through one window of slots at a time
  (``window.py``): ``reserve`` hands out window 0, ``window(lease_id, index)`` the next
  (a park) or reads it (a restore); ``acquire`` with ``need`` serves such a sequence so.
- ``prefetch(seq_id, tier, wait, timeout) -> str``; ``when_idle(fn, weight)``: work held until
  reads and parks pause (``idle_work.py``: the promotions after disk grants).
- ``drop``, ``present``, ``info``, ``list``, ``stat``, ``hello() -> Capabilities``;
  ``instance``: this start's random id (new at every start; ``Capabilities.instance``).
- ``check_invariants()``: assert slot, refcount, lease and disk accounting (tests call
  it when the engine is quiet).

Tiers, fastest first: ``device`` (optional GPU pool, or a CPU stand-in), ``host`` (the
shared arena), ``private`` (daemon-private memory, only on a daemon with a tenant that
is not trusted_local), ``disk`` (LMDB), and optionally ``remote`` (Redis, shared with
other daemons: ``remote_tier.py``). A sequence of a tenant that is not trusted_local has
memory copies in the private tier only, wherever a park, restore or prefetch asks to
put it; every other sequence never has one there (``placement.py``). A sequence may
hold copies in several tiers at once: committed data is immutable, so copies are
identical. An id this daemon does not hold is looked up in the remote tier's manifests
(``info``, ``restore``, ``prefetch``, ``drop``; ``present`` only asks whether it
exists); an unreachable Redis is a miss.

Invariants and locks:
- A sequence is visible only after commit; a failed or abandoned park frees its slots.
- A memory copy with readers, or with a copy in flight from it, is never freed;
  dropping or overwriting such a sequence defers the free to the last reader.
- No lock that commits, drops or restores need is held across disk I/O. A commit
  validates and pins its references under the index lock, writes to disk (one
  transaction, one fsync under write_through, a batch included), then publishes under
  the index lock. Generations, taken at that commit point by every park kind, order
  commits and drops of one id: the disk store never lets an older generation's manifest
  replace a newer one, and a commit that finds a newer version published when it comes
  to publish is replaced at once. Creates of one id are serialised (``commit.py``).
- Lock order: ``Lease.lock`` -> ``Seq.move_lock`` -> ``Catalog.lock`` (the index lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
from typing import Callable, Iterator


from kvpark.proto import VERSION
from kvpark.proto.errors import (
    AlreadyExists,
    InvalidArgument,
    KVParkError,
    LeaseExpired,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvpark.proto.layout import validate_seq_id
from kvpark.proto.sizes import human
from kvpark.proto.types import SeqInfo, Stat
from kvpark.tiers import cuda
from kvpark.tiers.copy import CopyEngine
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import DiskStore, Manifest
from kvpark.tiers.memory import MemTier
from kvpark.tiers.stubs import Stubs
from kvpark.tiers.tombs import Tombs

from . import commit, maintenance, reads
from .catalog import Catalog
from .config import Config
from .dirty import Dirty
from .leases import LeaseTable
from .metrics import Metrics
from .model import MAX_PARTS, Capabilities, Grant, ParkSpec, ReadHandle, Reservation, Seq
from .memory import MemoryTiers
from .mover import ROOM_WAIT_S, Mover
from .placement import CLIENT_TIERS, Placement
from .remote_tier import RemoteTier
from .window import Windows

log = logging.getLogger("kvpark.engine")

# How long a pin waits for a disk write that is reading its sequence (see ``pin``).
PIN_WAIT_S = 10.0

DiskFactory = Callable[..., DiskStore]  # (path, capacity, *, writemap) -> DiskStore

__all__ = ["DiskFactory", "Engine", "MAX_PARTS", "ROOM_WAIT_S"]


class Engine:
    def __init__(self, config: Config, *, disk_factory: DiskFactory = DiskStore,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.slot_size = config.tiers.host.slot_size
        self._closed = False
        # This start's id: a client never uses memory (arena, device pool) it mapped from
        # another start of the daemon (Hello and every reply handing out memory carry it).
        self.instance = secrets.token_hex(16)
        self._thread: threading.Thread | None = None
        self.write_through = config.policy.write == "write_through"

        # The disk store first: it is what most often refuses to open (a lock held by
        # another daemon, permissions), and it holds no memory to give back.
        self.disk = disk_factory(config.tiers.disk.path, config.disk_capacity, writemap=config.tiers.disk.writemap)
        try:
            # Connects lazily: a Redis that is down at start is a degraded tier, not a
            # daemon that will not start.
            opts = config.remote_options
            self.remote = RemoteTier(opts, config.tiers.remote.write) if opts is not None else None
            try:
                if self.remote is not None:  # before any lookup: what the last run dropped stays dropped
                    self.remote.load_tombs(Tombs(self.disk.env), Stubs(self.disk.env))
                self.memory = MemoryTiers.open(config.tiers, config.policy)
            except BaseException:
                if self.remote is not None:
                    self.remote.close()
                raise
        except BaseException:
            self.disk.close()
            raise
        self.tiers, self.arena = self.memory.tiers, self.memory.arena
        # The tier a restore that reads any CPU-readable copy (streamed or small) promotes
        # into, or None. "auto": such a reader copies from host memory; a device copy would
        # be paid for (an H2D copy, device room) and then not read. (A reader of one tier,
        # shm or cuda_ipc, always has its sequence promoted into that tier.)
        pol = config.policy
        self.restore_to = None if not pol.promote_on_restore else "host" if pol.restore_to == "auto" else pol.restore_to
        # Whose copies live in daemon-private memory: the tenants that are not trusted_local.
        self.placement = Placement(config.untrusted)
        # Disk grants hand a client the LMDB files, which hold every tenant's bytes: only
        # while every tenant may read every other's anyway (all trusted_local, or none).
        self.disk_grants = config.tiers.disk.direct_reads and not config.untrusted
        self.catalog = Catalog(self.tiers, config.policy.eviction, self.placement)
        pol = config.policy
        if pol.write == "write_back":  # write_through has no dirty data
            self.catalog.dirty = Dirty(pol.max_dirty_s, pol.max_dirty_bytes, pol.max_dirty_sequences)
        self.leases = LeaseTable(self.catalog, config.leases, metrics)
        if metrics is not None:
            self.disk.on_corrupt = metrics.checksum_failure
        dev = self.tiers.get("device")
        self.copy = CopyEngine(config.copy.max_inflight_bytes, device=dev.device if dev is not None else None)
        self.mover = Mover(self.catalog, self.leases, self.disk, self.copy, config.policy, self.slot_size,
                           self.remote, metrics)
        self.catalog.disk_pressure = self.mover.disk_pressure
        self.pending = commit.Pending()  # ids between their commit point and their publish
        self.deletes = self.mover.deletes  # retired disk copies, retried on failure (``deletes.py``)
        # A refused commit whose undo failed keeps its ids pending until the retry undoes it.
        self.deletes.on_undone = lambda ids: self.pending.done(self.catalog, ids)
        self.windows = Windows(self.catalog, self.leases, self.disk, self.mover, self.tiers, self.slot_size,
                               config.tiers.host.window_size, self.write_through,
                               self.pending, self.deletes)
        self._load_index()
        if self.remote is not None:  # what the index holds now was committed by earlier runs
            self.remote.started(self.catalog.gens.counter)

    @property
    def arena_pinned(self) -> bool:
        return self.memory.arena_pinned

    @property
    def host(self) -> MemTier:
        return self.tiers["host"]

    # ------------------------------------------------------------------ lifecycle

    def _load_index(self) -> None:
        total = count = 0
        # A chunk at a time: the index keeps rows, not manifests, and a million decoded
        # manifests alive at once would leave the rebuilt index scattered among their remains.
        for manifests, bad in self.disk.load_manifests_in():
            for b in bad:
                log.error("unreadable manifest skipped: %s", b)
            total += self.catalog.load(manifests)
            count += len(manifests)
        if count:
            log.info("disk tier: %d sequence(s), %d MiB, rebuilt from manifests", count, total >> 20)
        # The versions a disk eviction moved to Redis: indexed as before the restart, so an
        # overwrite or a drop of their ids retires (tombstones) them (``tiers/stubs.py``).
        def indexed(sid: str) -> Manifest | None:
            seq = self.catalog.find(sid)
            return seq.manifest if seq is not None else None

        adopted = self.remote.load_stubs(indexed) if self.remote is not None else []
        if adopted:
            with self.catalog.lock:
                self.catalog.adopt(adopted)
        if count or adopted:
            maintenance.reconcile(self)  # versions a crash left without their shared blocks

    def start(self) -> None:
        if self.remote is not None:
            self.remote.probe()
        self._thread = threading.Thread(target=maintenance.maintain, args=(self,), name="kvpark-maintain",
                                        daemon=True)
        self._thread.start()

    def close(self, flush: bool | None = None) -> None:
        flush = self.config.policy.flush_on_shutdown if flush is None else flush
        with self.catalog.lock:
            if self._closed:
                return
            self._closed = True
            self.catalog.wake.notify_all()
            self.pending.close(self.catalog)  # parks waiting on a pending id answer UNAVAILABLE now
            self.deletes.close()  # and answers of absence waiting for a delete
        self.mover.close()
        if self._thread is not None:
            self._thread.join()
        if flush:
            self.flush()
        if self.remote is not None:
            self.remote.close()  # background copies read memory copies: finish them first
        self.leases.close()  # windowed parks under way delete what they staged
        # Disk copies a read lease deferred (a drop or overwrite acknowledged while a
        # restore read them): their leases are gone now, so they go before the store
        # closes, or an acknowledged drop would come back at the next start.
        self.deletes.retry()
        self.windows.close()
        self.copy.close()
        self.disk.close()
        self.memory.close()

    def end_waits(self) -> None:
        """The stop has begun: parks waiting for a pending id, and answers of absence waiting
        for a delete, give up (``UNAVAILABLE``), so their handlers leave before the engine
        closes (``close`` does this too)."""
        with self.catalog.lock:
            self.pending.close(self.catalog)
            self.deletes.close()

    def flush(self) -> int:
        """Write every memory-only sequence to disk (keeping its memory copies)."""
        return self.mover.flush()

    @property
    def closed(self) -> bool:
        """Shutting down or shut (read under the index lock by the maintenance thread)."""
        return self._closed

    def check_open(self) -> None:
        """``Unavailable`` once shutting down: every call that starts new work checks it."""
        if self._closed:
            raise Unavailable("daemon is shutting down")

    def tier_arg(self, tier: str) -> str:
        """``tier`` if it names an enabled memory tier a client may ask for, else
        ``InvalidArgument`` (the private tier is chosen by the owner, never asked for)."""
        if tier not in CLIENT_TIERS:
            raise InvalidArgument(f"tier must be 'device' or 'host', got {tier!r}")
        if tier not in self.tiers:
            raise InvalidArgument(f"the {tier} tier is not enabled on this daemon")
        return tier

    @property
    def park_tier(self) -> str:
        """Where inline parks land: host, whose bytes the inline path writes from this
        process anyway, unless ``policy.restore_to = "device"`` asks for the device pool
        (then a park crosses PCIe once more, and evicts cuda_ipc users' data from it)."""
        return "device" if "device" in self.tiers and self.config.policy.restore_to == "device" else "host"

    # ------------------------------------------------------------------ park

    def reserve(self, spec: ParkSpec, inline: bool = False, tier: str | None = None) -> Reservation:
        """Reserve slots for a park under a write lease.

        ``inline``: the bytes come through this process (``write_chunk``), not from a
        client writing into the slots, so a park bound for the device may land on host.
        """
        spec.validate()
        self.check_open()
        self.mover.idle.busy()  # promotions left for a lull wait (``idle_work.py``)
        order = self.landing(spec, inline, tier)
        if self.windowed(spec, inline, tier):
            # Larger than any tier it may land in: through one window of slots to disk.
            return self.windows.reserve(spec, max(order, key=lambda t: self.tiers[t].alloc.capacity))
        sizes = [b.nbytes for b in spec.blocks] + [spec.nbytes]
        for t in order:  # an inline park that cannot land on device lands on host
            mem = self.tiers[t]
            deadline = time.monotonic() + (ROOM_WAIT_S if t == order[-1] else 0.0)
            while True:
                with self.catalog.lock:
                    # A close while this waited for room takes the tiers away: say so, typed.
                    self.check_open()
                    if not spec.overwrite and spec.seq_id in self.catalog:  # no thaw of a row
                        raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
                    got = self._alloc_all(t, sizes)
                    if got is not None:
                        lease = self.leases.issue_write(spec, t, got)
                        return Reservation(lease.lease_id, t,  # type: ignore[arg-type]
                                           tuple(seg for a in got for seg in a.segments()), self.config.leases.ttl_s)
                if not self.mover.await_room(t, spec.total, None, deadline):
                    break
        mem = self.tiers[order[-1]]
        with self.catalog.lock:
            free = mem.alloc.free_bytes
        raise ResourceExhausted(f"{mem.name} tier cannot take {human(spec.total)} ({human(free)} of "
                                f"{human(mem.alloc.capacity)} free) and demotion freed too little: {self.room_hint()}")

    def room_hint(self) -> str:
        """Why demotion may not make room, in words: the disk's fill, and the remote tier's
        state when it is down (then the disk cannot evict into it)."""
        hint = f"disk {human(self.disk.used)} of {human(self.disk.capacity)} used"
        down = self.remote_down()
        return hint + (f"; {down}" if down else "") + "; or the rest is leased or pinned"

    def remote_down(self) -> str:
        """Words for a capacity error when the remote tier is down (its breaker not
        closed): the disk cannot evict into it. "" when it is up or there is none."""
        if self.remote is None or (state := self.remote.store.breaker.state) == "closed":
            return ""
        return f"the remote tier is down (circuit {state}), so the disk cannot evict into it (kvpark stat shows it)"

    def landing(self, spec: ParkSpec, inline: bool = False, tier: str | None = None) -> list[str]:
        """The memory tiers a park may land in, in order: an inline park bound for the
        device may land on host; a park of a tenant that is not trusted_local lands in
        the private tier, whatever it asked for."""
        tier = self.tier_arg(tier or self.park_tier)
        if self.placement.private(spec.owner):
            return [self.placement.tier(spec.owner, tier)]
        return [tier] if tier == "host" or not inline else [tier, "host"]

    def windowed(self, spec: ParkSpec, inline: bool = False, tier: str | None = None) -> bool:
        """Whether ``reserve`` streams this park to disk through windows: it is larger
        than every memory tier it may land in, so it never occupies one."""
        return spec.total > max(self.tiers[t].alloc.capacity for t in self.landing(spec, inline, tier))

    def _alloc_all(self, tier: str, sizes: list[int]) -> list[Allocation] | None:
        # REQUIRES: index lock. All or nothing.
        got: list[Allocation] = []
        for n in sizes:
            a = self.tiers[tier].alloc.alloc(n)
            if a is None:
                for g in got:
                    self.catalog.free(tier, g)
                return None
            got.append(a)
        return got

    def write_chunk(self, lease_id: str, offset: int, data: memoryview) -> None:
        """Copy inline bytes straight into the reserved slots. Chunks must arrive in order."""
        lease = self.leases.get_write(lease_id)
        n = len(data)
        assert lease.spec is not None
        total = lease.spec.total
        if offset != lease.received:
            raise InvalidArgument(f"chunk at offset {offset}, expected {lease.received} (chunks must be in order)")
        if n == 0:
            raise InvalidArgument("empty chunk")
        if offset + n > total:
            raise InvalidArgument(f"chunk [{offset}, {offset + n}) overruns the declared {total} bytes")
        if lease.window is not None:
            self.windows.write(lease, offset, data)
            return
        mem = self.tiers[lease.tier]
        bs = self.slot_size
        with lease.lock:  # the reaper cannot free these slots while we copy into them
            if lease.ended:
                raise LeaseExpired(f"write lease {lease.lease_id!r} expired (the stream was idle too long)")
            pos = 0
            start = 0  # payload offset where the current allocation begins
            for a in lease.write_allocs():
                size = a.nbytes
                while pos < n and offset + pos < start + size:
                    blk, within = divmod(offset + pos - start, bs)
                    base, ln = a.extents[blk]
                    take = min(ln - within, n - pos)
                    mem.write(base + within, data[pos : pos + take])
                    pos += take
                start += size
                if pos == n:
                    break
            lease.received += n
            self.leases.extend(lease)

    def commit(self, lease_id: str, expect_nbytes: int | None = None) -> SeqInfo:
        """Publish a reserved park: validate under the index lock, write disk without it, publish."""
        try:
            spec: ParkSpec | None = self.leases.get_write(lease_id).spec
        except KVParkError:
            spec = None  # ``take_write`` answers for it below
        if spec is not None and not spec.overwrite and spec.seq_id:
            # A create's success says the id was absent: durably so first (``settle``),
            # or a crash could bring back a version dropped just before it.
            self.settle([spec.seq_id])
        with self.catalog.lock:
            lease = self.leases.take_write(lease_id)
        if lease.spec.refs:
            # Shared blocks it names that only the remote tier holds are indexed first, as a
            # restore of them would (``present`` says they are parked): never NOT_FOUND.
            try:
                reads.adopt(self, list(lease.spec.refs))
            except KVParkError as e:  # a miss is safe: the commit's checks answer for the refs
                log.debug("adopting the shared blocks a park names failed: %s", e)
        with lease.lock:  # no chunk lands after this; the reaper no longer owns the slots
            if lease.ended:
                raise LeaseExpired(f"write lease {lease_id!r} is gone (expired, aborted or never issued)")
            lease.ended = True
        # NOT_FOUND for a shared block it names (dropped meanwhile) once that is durable.
        with self.absent(list(lease.spec.refs)):
            if lease.window is not None:
                return self.windows.commit(lease, expect_nbytes)
            return commit.commit(self, lease, expect_nbytes)

    def window(self, lease_id: str, index: int) -> tuple[tuple[int, int], ...]:
        """Window ``index`` of a windowed park or restore: where its bytes lie (``window.py``)."""
        return tuple(self.windows.move(self.leases.get(lease_id), index))

    def release(self, lease_id: str) -> bool:
        """End a read lease or abort an uncommitted write lease. False if already gone."""
        return self.leases.release(lease_id)

    # ------------------------------------------------------------------ restore

    def acquire(self, seq_ids: str | list[str], need: str | None = None, stream: bool = False,
                expect_layout: str = "", inline_max: int = 0, disk: bool = False) -> ReadHandle:
        """Lease readable copies of one or more sequences, served as one payload (``reads.py``).
        ``disk``: the caller reads the disk tier itself; a restore whose parts are all on
        disk only is answered with a disk grant (``ReadHandle.direct``) when this daemon
        offers them (``disk_grants``)."""
        self.mover.idle.busy()  # promotions left for a lull wait (``idle_work.py``)
        return reads.acquire(self, seq_ids, need, stream, expect_layout, inline_max, disk and self.disk_grants)

    def grant(self, handle: ReadHandle) -> Grant:
        w = handle.window
        return Grant(handle.lease_id, handle.info, tuple(handle.segments()), self.config.leases.ttl_s,
                     window_size=w.size if w is not None else 0)

    def iter_chunks(self, handle: ReadHandle, chunk_size: int) -> Iterator[tuple[int, list[memoryview]]]:
        """(payload offset, views) pieces of at most ``chunk_size`` bytes, in payload order (``reads.py``)."""
        return reads.iter_chunks(self, handle, chunk_size)

    def retire_remote(self, gone: list[Seq]) -> list[Manifest]:
        """Tombstone the remote copies of versions leaving the index (``RemoteTier.retired``):
        no later miss adopts them back. REQUIRES: index lock, in the step that unindexed them."""
        return self.remote.retired(gone) if self.remote is not None and gone else []

    def forget_remote(self, gone: list[Manifest]) -> KVParkError | None:
        """Delete what ``retire_remote`` returned from Redis (in the background), the
        tombstones on disk first. Before the drop or overwrite is acknowledged; a drop
        answers the error returned (``RemoteTier.forget``)."""
        if self.remote is not None and gone:
            return self.remote.forget(gone)
        return None

    def when_idle(self, fn: Callable[[], None], weight: int = 1) -> None:
        """Run ``fn()`` once no read or park has started for a moment (``idle_work.py``):
        work that would slow the reads under way, and that nothing waits for. ``fn``
        stops between its steps once the engine closes; ``weight``: how many steps it has."""
        self.mover.idle.add(fn, weight)

    def prefetch(self, seq_id: str, tier: str, wait: bool = False, timeout: float | None = None,
                 then: Callable[[], None] | None = None) -> str:
        """Promote ``seq_id`` into ``tier`` (for a private sequence, the private tier); ``then()``
        once a promotion this started or joined has ended (a tenant's quota settles there)."""
        validate_seq_id(seq_id)
        self.check_open()
        tier = self.placement.tier(seq_id, self.tier_arg(tier))
        reads.adopt(self, [seq_id])
        with self.absent([seq_id]):
            with self.catalog.lock:
                seq = self.catalog.get(seq_id)
                # About to be read: not the first victim of the demotion its own promotion may
                # start (a cold sequence prefetched to a full tier would leave it again at once).
                seq.manifest.last_access = time.time()
                self.catalog.touch(seq)
            return self.mover.prefetch(seq, tier, wait, timeout, then)

    @contextlib.contextmanager
    def absent(self, seq_ids: list[str]) -> Iterator[None]:
        """A ``NotFound`` leaving this block is answered only once the absence of these
        ids is durable (``Deletes.settle``; ``Unavailable`` instead when it is not yet).
        Every one of them, even one indexed again by now (the answer was decided when it
        was not): ``Deletes.settle`` never touches what a present id's versions need (a
        refused write's undo). The index lock must not be held when it leaves."""
        try:
            yield
        except NotFound:
            self.settle(seq_ids)
            raise

    def settle(self, seq_ids: list[str]) -> None:
        """Before answering that these ids are gone: nothing of them in LMDB to come back at
        a crash (``Deletes.settle``), nor in Redis behind a tombstone that holds in memory
        only. ``Unavailable`` while either is so."""
        self.deletes.settle(seq_ids)
        if self.remote is not None and seq_ids:
            self.remote.settle_stubs(seq_ids)
        loose = self.remote.loose(seq_ids) if self.remote is not None and seq_ids else []
        if loose:
            raise Unavailable(f"sequence {loose[0]!r}: a dropped version of it could come back at a restart "
                              "(its tombstone, or the removal of its remote-only stub, could not be written "
                              "to disk); ask again")

    # ------------------------------------------------------------------ queries

    def drop(self, seq_id: str, everywhere: bool = True) -> bool:
        """Unpublish ``seq_id`` now; its disk copy is deleted after, without any lock held.

        ``everywhere``: its remote copy goes too (in the background); an id only the
        remote tier has is dropped there.
        """
        validate_seq_id(seq_id)
        if everywhere:
            reads.adopt(self, [seq_id])
        with self.catalog.lock:
            seq = self.catalog.find(seq_id)
            if seq is not None:
                todo = maintenance.retire(self, seq)
                forget = self.retire_remote([seq]) if everywhere else []
                self.deletes.claim(todo)  # absence waits for these deletes from now on
        if seq is not None:
            maintenance.finish_drop(self, todo, forget, claimed=True)
        # Nothing of any version of the id left in LMDB to come back at a crash (an older
        # version whose delete failed, another drop's delete under way) before we answer.
        self.settle([seq_id])
        return seq is not None

    def present(self, seq_ids: list[str]) -> list[bool]:
        """For each id, whether it is parked (prefix lookups and dedup)."""
        if len(seq_ids) > MAX_PARTS:
            raise InvalidArgument(f"{len(seq_ids)} ids; at most {MAX_PARTS} per call")
        for sid in seq_ids:
            validate_seq_id(sid)
        with self.catalog.lock:
            out = self.catalog.present(seq_ids)
        if self.remote is not None and not all(out):
            ask = [sid for sid, p in zip(seq_ids, out) if not p]
            there = dict(zip(ask, self.remote.present(ask)))
            out = [p or there[sid] for sid, p in zip(seq_ids, out)]
        if not all(out):
            self.settle([sid for sid, p in zip(seq_ids, out) if not p])  # absence, durable
        return out

    def in_memory(self, seq_ids: list[str]) -> bool:
        """Whether every id is parked with a ready memory copy (reading it takes no disk I/O)."""
        with self.catalog.lock:
            return self.catalog.in_memory(seq_ids)

    def info(self, seq_id: str) -> SeqInfo:
        validate_seq_id(seq_id)
        reads.adopt(self, [seq_id])
        with self.absent([seq_id]), self.catalog.lock:
            return self.catalog.info(self.catalog.get(seq_id))

    def list(self) -> list[SeqInfo]:
        with self.catalog.lock:
            return self.catalog.infos()

    def stat(self) -> Stat:
        used = self.disk.used
        pinned = {k: v for k, v in cuda.pinned_bytes().items() if v}  # its own locks, not the index's
        with self.catalog.lock:
            on_remote = self.catalog.on_remote()
            st = Stat(tiers=self.catalog.tier_stats(self.disk.capacity, used, self.mover.evictions, self.slot_size),
                      sequences=len(self.catalog), leases=self.leases.count, damaged=self.disk.damaged,
                      pinned=pinned)
        if self.remote is None:
            return st
        return dataclasses.replace(st, remote=self.remote.stat(on_remote))

    def pin(self, seq_id: str, pinned: bool = True) -> SeqInfo:
        """Pin (never demoted below the tier it is in) or unpin ``seq_id``; kept on disk too."""
        validate_seq_id(seq_id)
        self.check_open()
        reads.adopt(self, [seq_id])  # held only in Redis: pinned like any other (``present`` says it is)
        with self.absent([seq_id]), self.catalog.lock:
            seq = self.catalog.get(seq_id)
            # A disk write reading this sequence (demotion, flush, write-back) encodes the
            # manifest as it is then, and marks it on disk only after: pinning in between
            # would miss both that write and the update below. Wait for it to land.
            deadline = time.monotonic() + PIN_WAIT_S
            while seq.moving and not seq.on_disk and time.monotonic() < deadline:
                self.catalog.changed.wait(deadline - time.monotonic())
            if seq.moving and not seq.on_disk:
                # The write still runs (a stalled disk): pinned now, in memory only, the pin
                # would be acknowledged and lost at a crash. Not acknowledged, not applied.
                raise Unavailable(f"sequence {seq_id!r}: a disk write of it has not landed in "
                                  f"{PIN_WAIT_S:.0f} s; pin it again")
            seq.manifest.pinned = pinned
            on_disk, manifest = seq.on_disk, seq.manifest
        if on_disk:
            # A later commit of the id replaced this generation: its own manifest stands.
            self.disk.update_manifest(manifest, sync=self.write_through)
        if self.remote is not None:
            # Held only in Redis (or about to be: an eviction's stub written): its stub
            # carries the pin across a restart.
            self.remote.restub(manifest)
        with self.catalog.lock:
            self.catalog.notify()  # an unpinned copy may be demoted now
            return self.catalog.info(seq)

    def hello(self) -> Capabilities:
        transports = ["inline"]
        if self.arena.path:
            transports.insert(0, "shm")
        dev = self.tiers.get("device")
        handle = self.memory.ipc_handle
        if handle:
            transports.insert(0, "cuda_ipc")
        return Capabilities(
            server_version=VERSION,
            transports=tuple(transports),
            chunk_size=self.config.server.chunk_size,
            arena_path=self.arena.path,
            arena_size=self.arena.size,
            slot_size=self.slot_size,
            lease_ttl_s=self.config.leases.ttl_s,
            device=str(dev.device) if dev is not None else "",
            device_size=dev.alloc.capacity if dev is not None else 0,
            ipc_handle=handle,
            device_uuid=cuda.device_uuid(dev.device) if dev is not None else "",
            instance=self.instance,
            disk_path=os.path.abspath(self.disk.path) if self.disk_grants else "",
        )

    def check_invariants(self) -> None:
        """Assert that slot, refcount, lease and disk accounting agree.

        Holds off demotions and waits for moves in flight first; parks, restores and
        drops must be quiet (the caller's job).

        Every memory tier's allocator charges exactly the copies the index holds, the
        copies read leases still hold of dropped sequences, and the slots of open write
        leases; the disk store holds exactly the bytes of the sequences the index has on
        disk; every reference count equals the references parked sequences make, each to
        a parked shared block; readers equal read leases, and no copy is in flight. The
        index agrees with LMDB: each sequence on disk has its manifest at its generation
        and all its block records, and no record or manifest is left that none owns
        (``commit.check_disk``). No copy, reservation or window of a sequence is in a
        tier its owner's bytes may not be in (``placement.py``).
        """
        with self.mover.quiet():
            used = self.disk.used - self.disk.staged  # windowed parks under way: not in the index yet
            scan = self.disk.scan()
            with self.catalog.lock:
                writes, readers, leased = self.leases.held()
                self.catalog.check(used, writes, readers, leased)
                for owner, tier in self.leases.slots():  # reservations and windows: placed as copies are
                    assert self.placement.allowed(owner, tier), f"{owner}: a lease's slots in the {tier} tier"
                # A disk eviction under write_through leaves memory copies without a disk one.
                all_on_disk = self.write_through and not self.mover.evictions.get("disk", 0)
                deleting = self.deletes.held()
                commit.check_disk(self.catalog.sequences(), scan, deleting, all_on_disk)
                # Records kept from the orphan sweep for a reader: only while their delete waits.
                stray = self.disk.kept - deleting
                assert not stray, f"records kept from the orphan sweep with no delete waiting: {sorted(stray)[:8]}"
                # Parks are quiet: no commit is between its lease's end and its publish.
                left = sorted(s.seq_id for s in self.catalog.committing)
                assert not left, f"commits that never published nor were refused: {left[:8]}"
