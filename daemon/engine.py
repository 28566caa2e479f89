"""The engine: sequences, their placement on the device/host/disk tiers, and leases.

Speaks dataclasses only (protobuf stops at the servicer). *What* to demote comes from
``kvpark.tiers.policy``; *how* bytes move between memory tiers is the copy engine's job
(``kvpark.tiers.copy``); this module decides where things live and applies it.

Primitives:
- ``Engine(config, disk_factory=DiskStore)``; ``start()``; ``close(flush=...)``; ``flush()``.
- Park, two-phase: ``reserve(ParkSpec, stream=False, tier=None) -> Lease`` (slots under a
  write lease), ``write_chunk(lease, offset, data)`` for inline bytes,
  ``commit(lease_id) -> SeqInfo`` (publish), ``release(lease_id)`` (abort).
- Restore: ``acquire(seq_id, need=None, stream=False) -> ReadHandle`` (a memory copy
  under a read lease, or disk records), ``iter_chunks(handle, size)``, ``release``.
- ``prefetch(seq_id, tier, wait, timeout) -> str``.
- ``drop``, ``info``, ``list``, ``stat``, ``hello``.

Tiers, fastest first: ``device`` (optional GPU pool, or a CPU stand-in), ``host`` (the
shared arena), ``disk`` (LMDB). A sequence may hold copies in several tiers at once:
committed data is immutable, so copies are identical, and a copy is attached only
after the copy engine reports it complete: a reader never sees a half-copied slot.

Invariants:
- A sequence is visible only after commit; a failed or abandoned park frees its slots.
- A memory copy with readers, or with a copy in flight from it, is never freed;
  dropping or overwriting such a sequence defers the free to the last reader.
- Pinned sequences are never demoted below the tier they are in.
- Every disk write and delete, and the publish of a write-through park, happen under
  ``_disk_lock``; metadata changes happen under ``_lock``, which is never held across
  I/O. Lock order: ``_commit_lock`` -> ``Seq.move_lock`` -> ``_disk_lock`` -> ``_lock``;
  ``move_lock`` is only ever *tried* by demotion, so two promotions making room for
  each other cannot deadlock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import threading
import time
from typing import Callable, Iterator

import torch

from kvpark.proto import VERSION
from kvpark.proto.errors import (
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    LayoutMismatch,
    InvalidArgument,
    KVParkError,
    LeaseExpired,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvpark.proto.layout import fingerprint, validate_seq_id, validate_tensors
from kvpark.proto.types import SeqInfo, Stat, TierStat
from kvpark.proto.wire import regroup
from kvpark.tiers import copy as copier
from kvpark.tiers import policy
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import DiskStore, Manifest
from kvpark.tiers.memory import MemTier
from kvpark.tiers.shm import SharedArena, remove_stale

from .config import Config
from .model import MEM_TIERS, Lease, ParkSpec, Part, ReadHandle, Seq

log = logging.getLogger("kvpark.engine")

# How long a park or promotion waits for in-flight work (copies, reads, other
# reservations) to free room before it gives up with RESOURCE_EXHAUSTED.
ROOM_WAIT_S = 10.0
MAX_PARTS = 1 << 16  # ids in one restore/lookup call


DiskFactory = Callable[..., DiskStore]  # (path, capacity, *, writemap) -> DiskStore


class Engine:
    def __init__(self, config: Config, *, disk_factory: DiskFactory = DiskStore) -> None:
        self.config = config
        self.slot_size = config.tiers.host.slot_size
        self._lock = threading.Lock()
        self._disk_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._space = threading.Condition(self._lock)  # notified whenever memory slots are freed
        self._seqs: dict[str, Seq] = {}
        self._refcount: dict[str, int] = {}  # shared block id -> sequences using it
        self._orphans: list[Seq] = []  # retired shared blocks whose disk copies still need deleting
        self._leases: dict[str, Lease] = {}
        self._gen = 0
        self._disk_used = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._prefetches: dict[tuple[str, str], concurrent.futures.Future[None]] = {}
        self._prefetcher = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpark-prefetch")

        # The disk store first: it is what most often refuses to open (a lock held by
        # another daemon, permissions), and it holds no memory to give back.
        self.disk = disk_factory(config.tiers.disk.path, config.disk_capacity, writemap=config.tiers.disk.writemap)
        try:
            self._open_memory(config)
        except BaseException:
            self.disk.close()
            self._prefetcher.shutdown()
            raise
        dev = self.tiers.get("device")
        self.copy = copier.CopyEngine(config.copy.max_inflight_bytes, device=dev.device if dev is not None else None)
        self._load_index()

    def _open_memory(self, config: Config) -> None:
        host, pol = config.tiers.host, config.policy
        self.tiers: dict[str, MemTier] = {}
        self._ipc_handle = b""
        if config.device_enabled:
            dev = config.tiers.device
            device = torch.device(dev.device)
            if device.type == "cuda" and not copier.cuda_available():
                raise RuntimeError(f"tiers.device.device is {dev.device} but CUDA is not available")
            cap = (dev.capacity // host.slot_size) * host.slot_size
            pool = torch.empty(cap, dtype=torch.uint8, device=device)
            self.tiers["device"] = MemTier("device", pool, host.slot_size, dev.high_watermark or pol.high_watermark,
                                           dev.low_watermark or pol.low_watermark)
            log.info("device tier: %d MiB on %s", cap >> 20, device)
            if device.type == "cuda":
                # Exported once, not per Hello: each export takes an IPC reference on the
                # pool's storage that is never given back.
                self._ipc_handle = copier.ipc_handle(pool)

        removed = remove_stale(host.shm_dir)
        if removed:
            log.info("removed %d stale arena file(s) from %s", len(removed), host.shm_dir)
        cap = config.host_capacity
        self.arena = SharedArena.create(host.shm_dir, cap, prefault=host.prefault)
        log.info("host arena: %d MiB in %d slots of %d KiB, %s (%.2fs to map)", cap >> 20, cap // host.slot_size,
                 host.slot_size >> 10, self.arena.path or "private memory", self.arena.prefault_s)
        # Page-locking only pays off for copies to and from a GPU pool; without one it
        # would create a CUDA context for nothing.
        dev = self.tiers.get("device")
        took = copier.pin_host(self.arena.tensor) if dev is not None and dev.device.type == "cuda" else None
        self.arena_pinned = took is not None
        if took is not None:
            log.info("host arena page-locked in %.2fs", took)
        self.tiers["host"] = MemTier("host", self.arena.tensor, host.slot_size,
                                     host.high_watermark or pol.high_watermark, host.low_watermark or pol.low_watermark,
                                     view=self.arena.view)

    @property
    def host(self) -> MemTier:
        return self.tiers["host"]

    # ------------------------------------------------------------------ lifecycle

    def _load_index(self) -> None:
        manifests, bad = self.disk.load_manifests()
        for b in bad:
            log.error("unreadable manifest skipped: %s", b)
        for m in manifests:
            seq = Seq(manifest=m, on_disk=True)
            self._seqs[m.seq_id] = seq
            self._disk_used += m.nbytes
            self._gen = max(self._gen, m.gen)
            for r in seq.refs:
                self._refcount[r] = self._refcount.get(r, 0) + 1
        if manifests:
            log.info("disk tier: %d sequence(s), %d MiB, rebuilt from manifests", len(manifests),
                     self._disk_used >> 20)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._maintain, name="kvpark-maintain", daemon=True)
        self._thread.start()

    def close(self, flush: bool | None = None) -> None:
        flush = self.config.policy.flush_on_shutdown if flush is None else flush
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
            self._space.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        if flush:
            self.flush()
        with self._lock:
            for lease in list(self._leases.values()):
                self._end_lease(lease)
        self.copy.close()
        self.disk.close()
        if self.arena_pinned:
            copier.unpin_host(self.arena.tensor)
        self.tiers.clear()
        self.arena.close(unlink=True)

    def flush(self) -> int:
        """Write every memory-only sequence to disk (keeping its memory copies)."""
        with self._lock:
            todo = [s for s in self._seqs.values() if s.res and not s.on_disk]
        total = len(todo)
        done, last = 0, time.monotonic()
        for s in todo:
            try:
                if self._write_to_disk(s):
                    done += 1
            except KVParkError as e:
                log.error("flush: sequence %r not written: %s", s.seq_id, e)
            if time.monotonic() - last > 1.0:
                log.info("flush: %d/%d sequences on disk", done, total)
                last = time.monotonic()
        self.disk.sync()
        if total:
            log.info("flush: %d/%d memory-only sequence(s) written to disk", done, total)
        return done

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("daemon is shutting down")

    def _tier_arg(self, tier: str) -> str:
        if tier not in MEM_TIERS:
            raise InvalidArgument(f"tier must be 'device' or 'host', got {tier!r}")
        if tier not in self.tiers:
            raise InvalidArgument(f"the {tier} tier is not enabled on this daemon")
        return tier

    @property
    def park_tier(self) -> str:
        """Where inline parks land: the fastest tier."""
        return "device" if "device" in self.tiers else "host"

    # ------------------------------------------------------------------ park

    def reserve(self, spec: ParkSpec, stream: bool = False, tier: str | None = None) -> Lease:
        if spec.is_batch:
            if spec.tensors or spec.refs or spec.nbytes:
                raise InvalidArgument("a batch park (empty seq_id) carries only blocks: no tensors or refs")
        else:
            validate_seq_id(spec.seq_id)
        validate_tensors(spec.tensors, spec.nbytes)
        if spec.ttl_s < 0:
            raise InvalidArgument(f"ttl_s must be >= 0, got {spec.ttl_s}")
        for r in spec.refs:
            validate_seq_id(r)
        if spec.shared and spec.refs:
            raise InvalidArgument("a shared block cannot itself reference other blocks")
        if len(spec.attrs) > 64 or any(len(k) + len(v) > 4096 for k, v in spec.attrs.items()):
            raise InvalidArgument("attrs: at most 64 entries of at most 4096 bytes each")
        if len(spec.blocks) > MAX_PARTS:
            raise InvalidArgument(f"{len(spec.blocks)} new blocks; at most {MAX_PARTS} per park")
        refs = set(spec.refs)
        for b in spec.blocks:
            validate_seq_id(b.seq_id)
            validate_tensors(b.tensors, b.nbytes)
            if b.shared and b.seq_id not in refs:
                raise InvalidArgument(f"new shared block {b.seq_id!r} is not among the sequence's refs")
            if not b.shared and not spec.is_batch:
                raise InvalidArgument(f"new block {b.seq_id!r}: only a batch park creates plain sequences")
        if len({b.seq_id for b in spec.blocks}) != len(spec.blocks):
            raise InvalidArgument("the same new block is listed twice")
        if spec.seq_id and (spec.seq_id in refs or any(b.seq_id == spec.seq_id for b in spec.blocks)):
            raise InvalidArgument(f"sequence {spec.seq_id!r} cannot reference itself as a block")
        self._check_open()
        tier = self._tier_arg(tier or self.park_tier)
        order = [tier] if tier == "host" or not stream else [tier, "host"]
        if spec.total > max(self.tiers[t].alloc.capacity for t in order):
            raise ResourceExhausted(
                f"sequence of {spec.total} bytes is larger than the {tier} tier "
                f"({self.tiers[tier].alloc.capacity} bytes)"
            )
        for t in order:  # an inline park that cannot land on device lands on host
            mem = self.tiers[t]
            deadline = time.monotonic() + (ROOM_WAIT_S if t == order[-1] else 0.0)
            while True:
                with self._lock:
                    if not spec.overwrite and spec.seq_id in self._seqs:
                        raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
                    got = self._alloc_all(mem, [b.nbytes for b in spec.blocks] + [spec.nbytes])
                    if got is not None:
                        # Write leases always expire: a stream that stalls without closing
                        # gets an idle deadline, pushed back by every chunk it sends.
                        ttl = time.monotonic() + self.config.leases.ttl_s
                        lease = Lease(secrets.token_hex(16), "write", t, ttl, spec=spec, alloc=got[-1],
                                      block_allocs=got[:-1])
                        self._leases[lease.lease_id] = lease
                        return lease
                if not self._await_room(t, spec.total, None, deadline):
                    break
        mem = self.tiers[order[-1]]
        with self._lock:
            free = mem.alloc.free_bytes
        raise ResourceExhausted(
            f"{mem.name} tier cannot take {spec.total} bytes ({free} of {mem.alloc.capacity} free) and demotion "
            f"freed too little (disk {self._disk_used}/{self.disk.capacity} bytes used, or sequences leased/pinned)"
        )

    def _alloc_all(self, mem: MemTier, sizes: list[int]) -> list[Allocation] | None:
        # REQUIRES: self._lock held. All or nothing.
        got: list[Allocation] = []
        for n in sizes:
            a = mem.alloc.alloc(n)
            if a is None:
                for g in got:
                    self._free(mem, g)
                return None
            got.append(a)
        return got

    def write_chunk(self, lease: Lease, offset: int, data: memoryview) -> None:
        """Copy inline bytes straight into the reserved slots. Chunks must arrive in order."""
        n = len(data)
        assert lease.spec is not None
        total = lease.spec.total
        if offset != lease.received:
            raise InvalidArgument(f"chunk at offset {offset}, expected {lease.received} (chunks must be in order)")
        if n == 0:
            raise InvalidArgument("empty chunk")
        if offset + n > total:
            raise InvalidArgument(f"chunk [{offset}, {offset + n}) overruns the declared {total} bytes")
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
            lease.expires_at = time.monotonic() + self.config.leases.ttl_s

    def _manifest_for(self, spec: ParkSpec) -> Manifest:
        now = time.time()
        extra: dict = {}
        if spec.refs:
            extra["refs"] = list(spec.refs)
        if spec.shared:
            extra["shared"] = True
        if spec.attrs:
            extra["attrs"] = dict(spec.attrs)
        if spec.pinned:
            extra["pinned"] = True
        if spec.ttl_s > 0:
            extra["expires_at"] = now + spec.ttl_s
        return Manifest(
            seq_id=spec.seq_id, gen=0, tensors=spec.tensors, nbytes=spec.nbytes, block_size=self.slot_size,
            fingerprint=fingerprint(spec.tensors), priority=spec.priority, created_at=now, last_access=now,
            extra=extra,
        )

    def commit(self, lease_id: str, expect_nbytes: int | None = None) -> SeqInfo:
        with self._commit_lock:
            with self._lock:
                lease = self._leases.pop(lease_id, None)
                if lease is None or lease.kind != "write":
                    raise LeaseExpired(f"write lease {lease_id!r} is gone (expired, aborted or never issued)")
                spec, alloc, mem = lease.spec, lease.alloc, self.tiers[lease.tier]
                assert spec is not None and alloc is not None
                try:
                    new_blocks = self._check_commit(lease, expect_nbytes)
                except BaseException:
                    for a in lease.write_allocs():
                        self._free(mem, a)
                    raise
                old = self._seqs.get(spec.seq_id)
                self._gen += 1
                m = self._manifest_for(spec)
                m.gen = self._gen
                seq = Seq(manifest=m, res={mem.name: alloc})
            # New blocks are published first; the sequence that references them
            # commits an instant later (if it fails, unreferenced blocks expire).
            for i, b in enumerate(new_blocks):
                try:
                    self._commit_block(b)
                except BaseException:
                    with self._lock:
                        for later in new_blocks[i:]:
                            for name, a in later.res.items():
                                self._free(self.tiers[name], a)
                            later.res.clear()
                        self._free(mem, alloc)
                    raise
            if spec.is_batch:
                with self._lock:
                    self._free(mem, alloc)  # the batch's own (empty) payload
                    if any(policy.over_high(t.alloc.used_bytes, t.alloc.capacity, t.high)
                           for t in self.tiers.values()):
                        self._wake.notify_all()
                return SeqInfo(seq_id="", nbytes=sum(b.manifest.nbytes for b in new_blocks), tier=mem.name,
                               num_tensors=0, num_blocks=len(new_blocks))
            if self.config.policy.write == "write_through":
                with self._disk_lock:
                    with self._lock:
                        freed = old.manifest.nbytes if old is not None and old.on_disk else 0
                        if self._disk_used - freed + m.nbytes > self.disk.capacity:
                            self._free(mem, alloc)
                            raise ResourceExhausted(
                                f"disk tier full: {self._disk_used} of {self.disk.capacity} bytes used, park needs "
                                f"{m.nbytes} (write_through)"
                            )
                    try:
                        self.disk.write(m, mem.views(alloc), replace=old.manifest if freed else None, sync=True)
                    except BaseException:
                        with self._lock:
                            self._free(mem, alloc)
                        raise
                    with self._lock:
                        seq.on_disk = True
                        self._disk_used += m.nbytes
                        if freed:
                            assert old is not None
                            old.on_disk = False
                            self._disk_used -= freed
                        self._publish(seq, old)
            else:
                with self._lock:
                    self._publish(seq, old)
                if old is not None and old.on_disk:
                    self._delete_from_disk(old)
            self._delete_retired()
            with self._lock:
                return self._info(seq)

    def _check_commit(self, lease: Lease, expect_nbytes: int | None) -> list[Seq]:
        """Validate a commit; returns the shared blocks to create. REQUIRES: self._lock held.

        Blocks that exist by now (another park created the same content) are dropped
        from the list and their reserved slots freed: content-addressed dedup.
        """
        spec, mem = lease.spec, self.tiers[lease.tier]
        assert spec is not None
        if expect_nbytes is not None and (lease.received != spec.total or expect_nbytes != spec.total):
            raise InvalidArgument(
                f"commit after {lease.received} bytes (commit says {expect_nbytes}); header declared {spec.total}"
            )
        old = None if spec.is_batch else self._seqs.get(spec.seq_id)
        if old is not None and not spec.overwrite:
            raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
        if old is not None and old.shared and self._refcount.get(old.seq_id):
            raise FailedPrecondition(f"shared block {spec.seq_id!r} is in use; it cannot be overwritten")
        if self._closed:
            raise Unavailable("daemon is shutting down")
        # Validate everything first: an error below leaves every allocation with the lease,
        # and the caller frees them all exactly once.
        plan: list[tuple[ParkSpec, Allocation, bool]] = []
        creating: set[str] = set()
        for b, a in zip(spec.blocks, lease.block_allocs):
            have = self._seqs.get(b.seq_id)
            if have is not None and have.shared != b.shared:
                kind = "a shared block" if have.shared else "a plain sequence"
                raise FailedPrecondition(f"{b.seq_id!r} is already parked as {kind}")
            plan.append((b, a, have is not None))
            if have is None:
                creating.add(b.seq_id)
        for r in spec.refs:
            target = self._seqs.get(r)
            if r not in creating and (target is None or not target.shared):
                raise NotFound(f"referenced shared block {r!r} is not parked")
        # Commit point: nothing below raises.
        fresh: list[Seq] = []
        for b, a, exists in plan:
            if exists:
                self._free(mem, a)  # same content is already stored: content-addressed dedup
                continue
            self._gen += 1
            m = self._manifest_for(ParkSpec(b.seq_id, b.tensors, b.nbytes, priority=spec.priority, shared=b.shared,
                                            attrs=b.attrs, pinned=spec.pinned, ttl_s=spec.ttl_s))
            m.gen = self._gen
            fresh.append(Seq(manifest=m, res={mem.name: a}))
        lease.block_allocs = []  # owned by the fresh block sequences (or freed) now
        return fresh

    def _commit_block(self, block: Seq) -> None:
        """Publish one new shared block (writing it through to disk first when configured)."""
        if self.config.policy.write == "write_through":
            with self._disk_lock:
                with self._lock:
                    if self._disk_used + block.manifest.nbytes > self.disk.capacity:
                        raise ResourceExhausted(f"disk tier full: {self._disk_used} of {self.disk.capacity} bytes")
                name, a = next(iter(block.res.items()))
                self.disk.write(block.manifest, self.tiers[name].views(a), sync=True)
                with self._lock:
                    block.on_disk = True
                    self._disk_used += block.manifest.nbytes
        with self._lock:
            if block.seq_id in self._seqs:  # a concurrent park created it first
                self._retire(block)
                self._orphans.append(block)
            else:
                self._seqs[block.seq_id] = block

    def _publish(self, seq: Seq, old: Seq | None) -> None:
        # REQUIRES: self._lock held. References are taken before the old ones go, so a
        # block shared by the old and the new version never drops to zero.
        for r in seq.refs:
            self._refcount[r] = self._refcount.get(r, 0) + 1
        if old is not None:
            self._retire(old)
        self._seqs[seq.seq_id] = seq
        if any(policy.over_high(t.alloc.used_bytes, t.alloc.capacity, t.high) for t in self.tiers.values()):
            self._wake.notify_all()

    def _retire(self, seq: Seq) -> None:
        # REQUIRES: self._lock held. Memory is freed now, or by the last reader/copy.
        seq.dropped = True
        if self._seqs.get(seq.seq_id) is seq:
            del self._seqs[seq.seq_id]
        self._release_dropped(seq)
        for r in seq.refs:
            left = self._refcount.get(r, 0) - 1
            if left > 0:
                self._refcount[r] = left
                continue
            self._refcount.pop(r, None)
            block = self._seqs.get(r)
            if block is not None and block.shared:
                self._retire(block)  # its last user is gone
                self._orphans.append(block)

    def _release_dropped(self, seq: Seq) -> None:
        # REQUIRES: self._lock held.
        if not seq.dropped or seq.moving:
            return
        for name in list(seq.res):
            if not seq.readers.get(name):
                self._free(self.tiers[name], seq.res.pop(name))

    def _free(self, mem: MemTier, alloc: Allocation) -> None:
        # REQUIRES: self._lock held.
        mem.alloc.free(alloc)
        self._space.notify_all()

    def _delete_from_disk(self, seq: Seq) -> None:
        with self._disk_lock:
            with self._lock:
                if not seq.on_disk:
                    return
                seq.on_disk = False
                self._disk_used -= seq.manifest.nbytes
            self.disk.delete(seq.manifest)

    # ------------------------------------------------------------------ leases

    def release(self, lease_id: str) -> bool:
        """End a read lease or abort an uncommitted write lease. False if already gone."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            self._end_lease(lease)
            return True

    def _end_lease(self, lease: Lease) -> None:
        # REQUIRES: self._lock held.
        self._leases.pop(lease.lease_id, None)
        if lease.kind == "write":
            with lease.lock:  # waits out a write_chunk copying into these slots right now
                lease.ended = True
                for a in lease.write_allocs():
                    self._free(self.tiers[lease.tier], a)
                lease.alloc, lease.block_allocs = None, []
        else:
            for seq, tier in lease.parts:
                seq.readers[tier] -= 1
                assert seq.readers[tier] >= 0
                self._release_dropped(seq)
            lease.parts = []

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            for lease in [l for l in self._leases.values() if l.expires_at is not None and l.expires_at < now]:
                log.warning("%s lease %s expired; freeing what it held", lease.kind, lease.lease_id[:8])
                self._end_lease(lease)
            wall = time.time()
            expired = [s.seq_id for s in self._seqs.values() if s.expires_at is not None and s.expires_at <= wall]
            # Shared blocks nobody took up (their sequence's park failed or never came).
            grace = wall - self.config.leases.ttl_s
            expired += [s.seq_id for s in self._seqs.values()
                        if s.shared and not self._refcount.get(s.seq_id) and s.manifest.created_at < grace]
        for sid in expired:
            try:
                if self.drop(sid):
                    log.info("sequence %r expired (TTL, or an unused shared block); dropped", sid)
            except FailedPrecondition:
                pass  # a shared block taken up meanwhile

    # ------------------------------------------------------------------ restore

    def acquire(self, seq_ids: str | list[str], need: str | None = None, stream: bool = False,
                expect_layout: str = "", inline_max: int = 0) -> ReadHandle:
        """Lease readable copies of one or more sequences, served as one payload.

        A sequence that references shared blocks expands to those blocks, then itself.
        ``need`` forces a memory tier (shm: host, cuda_ipc: device); otherwise each part
        is served from its fastest CPU-readable copy, or from disk. A payload of at most
        ``inline_max`` bytes is served that way even with ``need`` (the caller sends it
        inline), so it never goes host -> device -> host. With ``expect_layout``, every
        named sequence must carry ``attrs["layout"]`` equal to it.
        """
        ids = [seq_ids] if isinstance(seq_ids, str) else list(seq_ids)
        if not ids:
            raise InvalidArgument("no sequence ids given")
        if len(ids) > MAX_PARTS:
            raise InvalidArgument(f"{len(ids)} ids; at most {MAX_PARTS} per call")
        for sid in ids:
            validate_seq_id(sid)
        self._check_open()
        if need is not None:
            self._tier_arg(need)
        with self._lock:
            tops = [self._get(sid) for sid in ids]
            for t in tops:
                have = t.attrs.get("layout", "")
                if expect_layout and have != expect_layout:
                    raise LayoutMismatch(
                        f"sequence {t.seq_id!r} was parked with layout {have or '(none)'}; the caller expects "
                        f"{expect_layout}"
                    )
            comps: list[Seq] = []
            for t in tops:
                comps.extend(self._get(r) for r in t.refs)
                comps.append(t)
            now = time.time()
            for c in comps:
                c.manifest.last_access = now
                c.access_count += 1
            if need is not None and sum(c.manifest.nbytes for c in comps) <= inline_max:
                need = None
        want = need or self.config.restore_to
        if want not in self.tiers:
            want = None  # restore_to = "device" on a daemon whose device tier did not come up
        lease = Lease(secrets.token_hex(16), "read", need or "", None if stream else
                      time.monotonic() + self.config.leases.ttl_s)
        parts: list[Part] = []
        try:
            if want:
                self._promote_batch(comps, want)
            for c in comps:
                parts.append(self._acquire_part(c, need, want, lease))
        except BaseException:
            with self._lock:
                self._end_lease(lease)
            raise
        with self._lock:
            if lease.parts:
                self._leases[lease.lease_id] = lease
            info = self._info_of(tops, comps)
        return ReadHandle(info, parts, lease if lease.parts else None)

    def _acquire_part(self, seq: Seq, need: str | None, want: str | None, lease: Lease) -> Part:
        with self._lock:
            have = want in seq.res if want else bool(seq.res)
        if want and not have:
            self._promote(seq, want, make_room=need is not None)
        with self._lock:
            if seq.dropped:
                raise NotFound(f"sequence {seq.seq_id!r} was dropped or overwritten during the restore")
            if need is not None:
                if need not in seq.res:
                    raise ResourceExhausted(
                        f"sequence {seq.seq_id!r} ({seq.manifest.nbytes} bytes) is not in the {need} tier and "
                        "there is no room to stage it there (leased or pinned sequences cannot be demoted)"
                    )
                tiers: tuple[str, ...] = (need,)
            else:
                tiers = ("host", "device")  # streams read CPU memory best
            for t in tiers:
                if t in seq.res:
                    seq.readers[t] = seq.readers.get(t, 0) + 1
                    lease.parts.append((seq, t))
                    return Part(seq.manifest, seq.res[t], t, seq)
            return Part(seq.manifest, None, "disk", seq)

    def _get(self, seq_id: str) -> Seq:
        # REQUIRES: self._lock held.
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"no parked sequence {seq_id!r}")
        return seq

    def present(self, seq_ids: list[str]) -> list[bool]:
        """For each id, whether it is parked (prefix lookups and dedup)."""
        if len(seq_ids) > MAX_PARTS:
            raise InvalidArgument(f"{len(seq_ids)} ids; at most {MAX_PARTS} per call")
        for sid in seq_ids:
            validate_seq_id(sid)
        with self._lock:
            return [sid in self._seqs for sid in seq_ids]

    def _alloc_in(self, tier: str, seq: Seq, make_room: bool) -> Allocation | None:
        mem = self.tiers[tier]
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            with self._lock:
                if tier in seq.res or seq.dropped:
                    return None
                a = mem.alloc.alloc(seq.manifest.nbytes)
            if a is not None or not make_room or not self._await_room(tier, seq.manifest.nbytes, seq, deadline):
                return a

    def _promote(self, seq: Seq, to: str, make_room: bool) -> None:
        """Bring a copy of ``seq`` into memory tier ``to`` (verifying disk blocks on the way)."""
        m = seq.manifest
        if m.block_size != self.slot_size:
            return  # parked under another slot size; served from disk as it is
        with seq.move_lock:
            if to == "device" and "host" not in seq.res and "device" not in seq.res:
                self._promote_locked(seq, "host", make_room=False)  # stage via pinned host memory
            self._promote_locked(seq, to, make_room)

    def _promote_batch(self, seqs: list[Seq], to: str) -> None:
        """Promote the memory-resident ones among ``seqs`` into ``to`` with one copy job.

        A restore of many blocks would otherwise submit and wait one job per block.
        Disk-only sequences, and any this cannot place, are left to ``_promote``.
        """
        with self._lock:
            uniq = {id(s): s for s in seqs if to not in s.res and s.res and not s.dropped
                    and s.manifest.block_size == self.slot_size}
        todo = sorted(uniq.values(), key=lambda s: s.seq_id)  # one lock order for every batch
        if len(todo) < 2:
            return
        locked: list[Seq] = []
        planned: list[tuple[Seq, str, Allocation, Allocation]] = []  # (seq, src tier, src, dst)
        landed = False
        mem = self.tiers[to]
        try:
            for seq in todo:
                seq.move_lock.acquire()  # demotion only ever tries these, so no cycle
                locked.append(seq)
            for seq in todo:
                # Only what fits now: making room would wait on the move locks this batch
                # holds. The rest is promoted one by one (making room) by _acquire_part.
                a = self._alloc_in(to, seq, make_room=False)
                if a is None:
                    continue  # there already, dropped, or no room
                with self._lock:
                    src = next((t for t in MEM_TIERS if t in seq.res and t != to), None)
                    if src is None:
                        self._free(mem, a)
                        continue
                    seq.moving += 1  # the source copy cannot be freed under the copy
                    planned.append((seq, src, seq.res[src], a))
            if not planned:
                return
            pieces = [(mem.tensor(d, n), self.tiers[src].tensor(o, n))
                      for _, src, src_alloc, dst_alloc in planned
                      for o, d, n in copier.runs(src_alloc.extents, dst_alloc.extents)]
            self.copy.submit(pieces, restore=True).wait()
            landed = True
        finally:
            with self._lock:
                for seq, _, _, a in planned:
                    seq.moving -= 1
                    if landed and not seq.dropped:
                        seq.res[to] = a
                    else:
                        self._free(mem, a)
                    self._release_dropped(seq)
            for seq in locked:
                seq.move_lock.release()

    def _promote_locked(self, seq: Seq, to: str, make_room: bool) -> None:
        # REQUIRES: seq.move_lock held.
        mem = self.tiers[to]
        a = self._alloc_in(to, seq, make_room)
        if a is None:
            return
        src = next((t for t in MEM_TIERS if t in seq.res and t != to), None)
        try:
            if src is not None:
                self._copy(seq, src, to, a, restore=True)
            else:
                with self.disk.read_txn() as r:
                    for i, (off, n) in enumerate(a.extents):
                        mem.write(off, r.read_block(seq.manifest, i, n))
                with self._lock:
                    seq.promotions += 1
        except BaseException:
            with self._lock:
                self._free(mem, a)
            raise
        with self._lock:
            if seq.dropped:
                self._free(mem, a)
                return
            seq.res[to] = a

    def _copy(self, seq: Seq, src: str, dst: str, dst_alloc: Allocation, restore: bool) -> None:
        """Copy ``seq``'s bytes from memory tier ``src`` into ``dst_alloc`` and wait for it."""
        with self._lock:
            src_alloc = seq.res.get(src)
            if src_alloc is None:  # dropped (its copies freed) since the caller looked
                raise NotFound(f"sequence {seq.seq_id!r} was dropped during a move")
            seq.moving += 1  # the source copy cannot be freed under the copy
        try:
            s_mem, d_mem = self.tiers[src], self.tiers[dst]
            pieces = [(d_mem.tensor(d, n), s_mem.tensor(s, n)) for s, d, n in
                      copier.runs(src_alloc.extents, dst_alloc.extents)]
            self.copy.submit(pieces, restore=restore).wait()
        finally:
            with self._lock:
                seq.moving -= 1
                self._release_dropped(seq)

    def prefetch(self, seq_id: str, tier: str, wait: bool = False, timeout: float | None = None) -> str:
        validate_seq_id(seq_id)
        self._check_open()
        self._tier_arg(tier)
        with self._lock:
            seq = self._get(seq_id)
            if tier in seq.res:
                return seq.tier
            key = (seq_id, tier)
            fut = self._prefetches.get(key)
            if fut is None or fut.done():
                fut = self._prefetcher.submit(self._promote, seq, tier, True)
                self._prefetches[key] = fut
                fut.add_done_callback(lambda f, k=key: self._prefetch_done(k, f))
        if wait:
            try:
                fut.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                raise DeadlineExceeded(f"prefetch of {seq_id!r} to {tier} did not finish within {timeout}s") from None
            with self._lock:
                if seq.dropped:
                    raise NotFound(f"no parked sequence {seq_id!r}")
                if tier not in seq.res:
                    raise ResourceExhausted(f"no room in the {tier} tier for {seq_id!r} (leased or pinned data)")
        with self._lock:
            return seq.tier

    def _prefetch_done(self, key: tuple[str, str], fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._prefetches.get(key) is fut:
                del self._prefetches[key]
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("prefetch of %r to %s failed: %s", key[0], key[1], fut.exception())

    def iter_chunks(self, handle: ReadHandle, chunk_size: int) -> Iterator[tuple[int, list[memoryview]]]:
        """(payload offset, views) pieces of at most ``chunk_size`` bytes, in payload order.

        Disk-served parts are read inside one read transaction; each block is verified
        before any of its bytes are yielded.
        """
        def views(r: object) -> Iterator[memoryview]:
            for p in handle.parts:
                if p.alloc is not None:
                    yield from self.tiers[p.tier].views(p.alloc)
                else:
                    m = p.manifest
                    for i, n in enumerate(m.block_lengths):
                        try:
                            yield r.read_block(m, i, n)  # type: ignore[attr-defined]
                        except DataLoss:
                            if p.seq is not None and p.seq.dropped:  # deleted under us: gone, not corrupt
                                raise NotFound(f"sequence {m.seq_id!r} was dropped or overwritten during the "
                                               "restore") from None
                            raise

        if all(p.alloc is not None for p in handle.parts):
            yield from regroup(views(None), chunk_size)
            return
        with self.disk.read_txn() as r:
            yield from regroup(views(r), chunk_size)

    # ------------------------------------------------------------------ demotion

    def _evictable(self, tier: str, exclude: Seq | None = None) -> list[policy.SeqMeta]:
        # REQUIRES: self._lock held. Pinned sequences leave a tier only when a faster
        # copy remains (they are never demoted below the tier they are in).
        return [
            policy.SeqMeta(s.seq_id, s.res[tier].charged, s.manifest.last_access, s.manifest.priority,
                           s.access_count, s.manifest.created_at, s.promotions)
            for s in self._seqs.values()
            if tier in s.res and not s.readers.get(tier) and not s.moving and s is not exclude
            and (not s.pinned or s.tier != tier)
        ]

    def _await_room(self, tier: str, need: int, exclude: Seq | None, deadline: float) -> bool:
        """Demote (or wait for in-flight work to free space) so ``need`` bytes may fit in ``tier``.

        False when waiting cannot help: nothing is demotable and nothing in flight
        (a copy, a read, a reservation) will free space before ``deadline``.
        """
        if self._make_room(tier, need, exclude):
            return True
        with self._lock:
            transient = any(l.expires_at is None or l.kind == "write" for l in self._leases.values()) or any(
                s.moving or (s.move_lock.locked() and s is not exclude) for s in self._seqs.values()
            )
            if not transient or time.monotonic() >= deadline or self._closed:
                return False
            self._space.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        return True

    def _make_room(self, tier: str, need: int, exclude: Seq | None = None) -> bool:
        """Demote in policy order until ``need`` bytes fit in ``tier``. True if it fits now.

        The byte target alone is not enough: packed tails fragment slots, so the loop
        checks the allocator itself after every victim.
        """
        mem = self.tiers[tier]
        with self._lock:
            if mem.alloc.fits(need):
                return True
            order = policy.demotion_order(self.config.policy.eviction, self._evictable(tier, exclude))
        for sid in order:
            self._demote(sid, tier)
            with self._lock:
                if mem.alloc.fits(need):
                    return True
        return False

    def _demote(self, seq_id: str, tier: str) -> bool:
        """Move ``seq_id``'s copy out of ``tier`` to the next tier down. True if freed."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None or tier not in seq.res:
                return False
        if not seq.move_lock.acquire(blocking=False):
            return False  # a promotion or another demotion owns it right now
        try:
            if tier == "device" and "host" not in seq.res and not seq.on_disk:
                a = self._alloc_in("host", seq, make_room=True)
                if a is not None:
                    try:
                        self._copy(seq, "device", "host", a, restore=False)
                    except BaseException:
                        with self._lock:
                            self._free(self.host, a)
                        raise
                    with self._lock:
                        if seq.dropped:
                            self._free(self.host, a)
                        else:
                            seq.res["host"] = a
            if not any(t in seq.res for t in MEM_TIERS if t != tier):
                self._write_to_disk(seq)  # host demotion, or device when host had no room
        except KVParkError as e:
            log.warning("demotion of %r from %s failed: %s", seq_id, tier, e)
            return False
        finally:
            seq.move_lock.release()
        with self._lock:
            elsewhere = seq.on_disk or any(t in seq.res for t in MEM_TIERS if t != tier)
            if elsewhere and tier in seq.res and not seq.readers.get(tier) and not seq.moving:
                self._free(self.tiers[tier], seq.res.pop(tier))
                return True
        return False

    def _write_to_disk(self, seq: Seq) -> bool:
        """Make sure ``seq`` has a disk copy; its memory copies are kept."""
        with self._disk_lock:
            with self._lock:
                if seq.dropped or seq.on_disk or not seq.res:
                    return seq.on_disk
                if self._disk_used + seq.manifest.nbytes > self.disk.capacity:
                    raise ResourceExhausted(f"disk tier full: {self._disk_used} of {self.disk.capacity} bytes used")
                src = "host" if "host" in seq.res else "device"
                alloc = seq.res[src]
                seq.moving += 1  # pins the memory copy while we read it
            try:
                self.disk.write(seq.manifest, self.tiers[src].views(alloc))
            finally:
                with self._lock:
                    seq.moving -= 1
            with self._lock:
                seq.on_disk = True
                self._disk_used += seq.manifest.nbytes
                stale = seq.dropped
                self._release_dropped(seq)
                if stale:  # dropped or overwritten while we wrote: remove what we wrote
                    seq.on_disk = False
                    self._disk_used -= seq.manifest.nbytes
            if stale:
                self.disk.delete(seq.manifest)
                return False
            return True

    def _maintain(self) -> None:
        interval = min(1.0, max(0.05, self.config.leases.ttl_s / 4))
        while True:
            with self._lock:
                if self._closed:
                    return
                if not any(policy.over_high(t.alloc.used_bytes, t.alloc.capacity, t.high)
                           for t in self.tiers.values()):
                    self._wake.wait(interval)
                if self._closed:
                    return
            moved = 0
            try:
                self._reap()
                for name in MEM_TIERS:  # device first: its demotions may push host over
                    mem = self.tiers.get(name)
                    if mem is None:
                        continue
                    with self._lock:
                        plan = []
                        if policy.over_high(mem.alloc.used_bytes, mem.alloc.capacity, mem.high):
                            plan = policy.plan_demotion(
                                self.config.policy.eviction, self._evictable(name), mem.alloc.used_bytes,
                                mem.alloc.capacity, policy.background_target(mem.alloc.capacity, mem.low),
                            )
                    for sid in plan:
                        if self._closed:
                            break
                        moved += self._demote(sid, name)
            except Exception:  # the maintenance thread must never die
                log.exception("maintenance pass failed")
            if not moved:
                # Nothing could move (disk full, or everything leased/pinned): back off, don't spin.
                with self._lock:
                    if not self._closed:
                        self._wake.wait(interval)

    # ------------------------------------------------------------------ queries

    def drop(self, seq_id: str) -> bool:
        validate_seq_id(seq_id)
        # Serialised with commits: a commit validates refs and the sequence it replaces
        # under _lock but publishes later (after a write-through fsync); a drop in
        # between would leave refcounts or references wrong.
        with self._commit_lock:
            return self._drop(seq_id)

    def _drop(self, seq_id: str) -> bool:
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return False
            if seq.shared and self._refcount.get(seq_id):
                raise FailedPrecondition(
                    f"shared block {seq_id!r} is used by {self._refcount[seq_id]} sequence(s); drop those instead"
                )
            self._retire(seq)
        self._delete_retired(seq)
        return True

    def _delete_retired(self, seq: Seq | None = None) -> None:
        """Delete the disk copies of ``seq`` and of shared blocks retired with it."""
        with self._lock:
            todo, self._orphans = self._orphans, []
        for s in ([seq] if seq is not None else []) + todo:
            if s.on_disk:
                self._delete_from_disk(s)

    def _info(self, seq: Seq) -> SeqInfo:
        # REQUIRES: self._lock held.
        comps = [self._seqs[r] for r in seq.refs if r in self._seqs] + [seq]
        return self._info_of([seq], comps)

    def _info_of(self, tops: list[Seq], comps: list[Seq]) -> SeqInfo:
        # REQUIRES: self._lock held. A composite's tier is the slowest of its parts'.
        rank = {"device": 0, "host": 1, "disk": 2}
        top = tops[0]
        m = top.manifest
        tensors = tuple(t for c in comps for t in c.manifest.tensors)
        return SeqInfo(
            seq_id=",".join(t.seq_id for t in tops),
            nbytes=sum(c.manifest.nbytes for c in comps),
            tier=max((c.tier for c in comps), key=rank.__getitem__),
            num_tensors=len(tensors),
            tensors=tensors,
            priority=m.priority,
            created_at=m.created_at,
            last_access=m.last_access,
            num_blocks=sum(len(c.manifest.block_lengths) for c in comps),
            attrs=top.attrs,
            refs=top.refs,
            shared=top.shared,
            refcount=self._refcount.get(top.seq_id, 0),
        )

    def info(self, seq_id: str) -> SeqInfo:
        validate_seq_id(seq_id)
        with self._lock:
            return self._info(self._get(seq_id))

    def list(self) -> list[SeqInfo]:
        with self._lock:
            return [self._info(s) for s in sorted(self._seqs.values(), key=lambda s: s.seq_id)]

    def stat(self) -> Stat:
        with self._lock:
            tiers: dict[str, TierStat] = {}
            for name, mem in self.tiers.items():
                held = [s.res[name] for s in self._seqs.values() if name in s.res]
                tiers[name] = TierStat(mem.alloc.capacity, mem.alloc.used_bytes, sum(len(a.extents) for a in held),
                                       len(held))
            disk = [s for s in self._seqs.values() if s.on_disk]
            tiers["disk"] = TierStat(self.disk.capacity, self._disk_used,
                                     sum(len(s.manifest.block_lengths) for s in disk), len(disk))
            return Stat(tiers=tiers, sequences=len(self._seqs), leases=len(self._leases))

    def check_invariants(self) -> None:
        """Assert the accounting: slots, refcounts, disk bytes. For tests; raises AssertionError.

        Call it when the daemon is quiet (no park, restore or demotion in flight): a
        reservation or a copy in progress holds slots that no sequence or lease owns yet.
        """
        with self._lock:
            held: dict[str, int] = {name: 0 for name in self.tiers}
            owners = list(self._seqs.values()) + [s for l in self._leases.values() for s, _ in l.parts]
            seen: set[int] = set()
            for s in owners:  # a dropped sequence under a read lease still owns its leased copy
                if id(s) in seen:
                    continue
                seen.add(id(s))
                for name, a in s.res.items():
                    held[name] += a.charged
            for lease in self._leases.values():
                if lease.kind == "write":
                    held[lease.tier] += sum(a.charged for a in lease.write_allocs())
            for name, mem in self.tiers.items():
                assert mem.alloc.used_bytes == held[name], (
                    f"{name} tier: allocator says {mem.alloc.used_bytes} bytes used, sequences and leases hold "
                    f"{held[name]}"
                )
            want: dict[str, int] = {}
            for s in self._seqs.values():
                for r in s.refs:
                    want[r] = want.get(r, 0) + 1
            assert self._refcount == want, f"refcounts {self._refcount} != references {want}"
            for r in want:
                assert r in self._seqs and self._seqs[r].shared, f"referenced block {r!r} is not a parked shared block"
            on_disk = sum(s.manifest.nbytes for s in self._seqs.values() if s.on_disk)
            assert self._disk_used == on_disk, f"disk: {self._disk_used} bytes accounted, sequences hold {on_disk}"
            for s in self._seqs.values():
                assert not s.dropped, f"sequence {s.seq_id!r} is parked but marked dropped"
                for name, n in s.readers.items():
                    assert n >= 0, f"sequence {s.seq_id!r} has {n} readers in {name}"

    def hello(self) -> dict:
        transports = ["inline"]
        if self.arena.path:
            transports.insert(0, "shm")
        dev = self.tiers.get("device")
        handle = self._ipc_handle
        if handle:
            transports.insert(0, "cuda_ipc")
        return {
            "server_version": VERSION,
            "transports": transports,
            "chunk_size": self.config.server.chunk_size,
            "arena_path": self.arena.path,
            "arena_size": self.arena.size,
            "slot_size": self.slot_size,
            "lease_ttl_s": self.config.leases.ttl_s,
            "device": str(dev.device) if dev is not None else "",
            "device_size": dev.alloc.capacity if dev is not None else 0,
            "ipc_handle": handle,
            "device_uuid": copier.device_uuid(dev.device) if dev is not None else "",
        }
