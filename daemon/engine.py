"""The engine: sequences, their placement on the host and disk tiers, and leases.

Speaks dataclasses only (protobuf stops at the servicer). All decisions about *what* to
demote come from ``kvpark.tiers.policy``; this module applies them.

Primitives:
- ``Engine(config)``; ``start()``; ``close(flush=...)``.
- Park, two-phase: ``reserve(ParkSpec, stream=False) -> Lease`` (host slots under a
  write lease), ``write_chunk(lease, offset, data)`` for inline bytes,
  ``commit(lease_id) -> SeqInfo`` (publish), ``release(lease_id)`` (abort).
- Restore: ``acquire(seq_id, need_host, stream) -> ReadHandle`` (host-resident and
  read-leased, or served from disk), ``iter_chunks(handle, size)``, ``release(lease_id)``.
- ``drop``, ``info``, ``list``, ``stat``, ``hello``.

Invariants:
- A sequence is visible only after commit; a failed or abandoned park frees its slots.
- Host slots of a sequence with readers are never freed or reused; dropping or
  overwriting such a sequence defers the free to the last release.
- Every disk write, delete and the publish of a write-through park happen under
  ``_disk_lock``; metadata changes happen under ``_lock``, which is never held across
  I/O. Lock order: ``_commit_lock`` -> ``_disk_lock`` -> ``_lock``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from kvpark.proto import VERSION
from kvpark.proto.errors import (
    AlreadyExists,
    DataLoss,
    InvalidArgument,
    KVParkError,
    LeaseExpired,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvpark.proto.layout import TensorMeta, fingerprint, validate_seq_id, validate_tensors
from kvpark.proto.types import SeqInfo, Stat, TierStat
from kvpark.proto.wire import regroup
from kvpark.tiers import policy
from kvpark.tiers.arena import Allocation, SlotAllocator
from kvpark.tiers.disk import DiskStore, Manifest
from kvpark.tiers.shm import SharedArena, remove_stale

from .config import Config

log = logging.getLogger("kvpark.engine")

# How long a park waits for in-flight work (demotions, reads, other reservations) to
# free host room before it gives up with RESOURCE_EXHAUSTED.
ROOM_WAIT_S = 10.0


@dataclass(frozen=True)
class ParkSpec:
    seq_id: str
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    priority: int = 0
    overwrite: bool = False


@dataclass(eq=False)
class Seq:
    manifest: Manifest
    host: Allocation | None = None
    on_disk: bool = False
    readers: int = 0
    demoting: bool = False
    dropped: bool = False
    access_count: int = 0
    promote_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def seq_id(self) -> str:
        return self.manifest.seq_id

    @property
    def tier(self) -> str:
        return "host" if self.host is not None else "disk"


@dataclass(eq=False)
class Lease:
    lease_id: str
    kind: str  # "write" | "read"
    expires_at: float | None  # None: held by a live stream, released by it
    seq: Seq | None = None  # read leases
    spec: ParkSpec | None = None  # write leases
    alloc: Allocation | None = None  # write leases
    received: int = 0  # inline bytes written so far


@dataclass
class ReadHandle:
    """What a restore reads: host extents under a read lease, or disk records."""

    info: SeqInfo
    manifest: Manifest
    lease: Lease | None  # set when host-resident
    alloc: Allocation | None


class Engine:
    def __init__(self, config: Config) -> None:
        self.config = config
        host = config.tiers.host
        self.slot_size = host.slot_size
        self._lock = threading.Lock()
        self._disk_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._space = threading.Condition(self._lock)  # notified whenever host slots are freed
        self._seqs: dict[str, Seq] = {}
        self._leases: dict[str, Lease] = {}
        self._gen = 0
        self._disk_used = 0
        self._closed = False
        self._thread: threading.Thread | None = None

        removed = remove_stale(host.shm_dir)
        if removed:
            log.info("removed %d stale arena file(s) from %s", len(removed), host.shm_dir)
        cap = config.host_capacity
        self.arena = SharedArena.create(host.shm_dir, cap, prefault=host.prefault)
        log.info("host arena: %d MiB in %d slots of %d KiB, %s (%.2fs to map)", cap >> 20, cap // host.slot_size,
                 host.slot_size >> 10, self.arena.path or "private memory", self.arena.prefault_s)
        self.alloc = SlotAllocator(cap, host.slot_size)
        self.disk = DiskStore(config.tiers.disk.path, config.disk_capacity, writemap=config.tiers.disk.writemap)
        self._load_index()

    # ------------------------------------------------------------------ lifecycle

    def _load_index(self) -> None:
        manifests, bad = self.disk.load_manifests()
        for b in bad:
            log.error("unreadable manifest skipped: %s", b)
        for m in manifests:
            self._seqs[m.seq_id] = Seq(manifest=m, on_disk=True)
            self._disk_used += m.nbytes
            self._gen = max(self._gen, m.gen)
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
        if self._thread is not None:
            self._thread.join()
        if flush:
            self.flush()
        with self._lock:
            for lease in list(self._leases.values()):
                self._end_lease(lease)
        self.disk.close()
        self.arena.close(unlink=True)

    def flush(self) -> int:
        """Write every host-only sequence to disk (keeping the host copy). Returns how many."""
        with self._lock:
            todo = [s for s in self._seqs.values() if s.host is not None and not s.on_disk]
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
            log.info("flush: %d/%d host-only sequence(s) written to disk", done, total)
        return done

    # ------------------------------------------------------------------ park

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("daemon is shutting down")

    def reserve(self, spec: ParkSpec, stream: bool = False) -> Lease:
        validate_seq_id(spec.seq_id)
        validate_tensors(spec.tensors, spec.nbytes)
        self._check_open()
        if spec.nbytes > self.alloc.capacity:
            raise ResourceExhausted(
                f"sequence of {spec.nbytes} bytes is larger than the host tier ({self.alloc.capacity} bytes)"
            )
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            with self._lock:
                if not spec.overwrite and spec.seq_id in self._seqs:
                    raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
                a = self.alloc.alloc(spec.nbytes)
                if a is not None:
                    ttl = None if stream else time.monotonic() + self.config.leases.ttl_s
                    lease = Lease(secrets.token_hex(16), "write", ttl, spec=spec, alloc=a)
                    self._leases[lease.lease_id] = lease
                    return lease
            if not self._await_room(spec.nbytes, None, deadline):
                break
        with self._lock:
            free = self.alloc.free_bytes
        raise ResourceExhausted(
            f"host tier cannot take {spec.nbytes} bytes ({free} of {self.alloc.capacity} free) and demotion to "
            f"disk freed too little (disk {self._disk_used}/{self.disk.capacity} bytes used, or sequences leased)"
        )

    def write_chunk(self, lease: Lease, offset: int, data: memoryview) -> None:
        """Copy inline bytes straight into the reserved slots. Chunks must arrive in order."""
        n = len(data)
        assert lease.spec is not None and lease.alloc is not None
        if offset != lease.received:
            raise InvalidArgument(f"chunk at offset {offset}, expected {lease.received} (chunks must be in order)")
        if n == 0:
            raise InvalidArgument("empty chunk")
        if offset + n > lease.spec.nbytes:
            raise InvalidArgument(f"chunk [{offset}, {offset + n}) overruns the declared {lease.spec.nbytes} bytes")
        view = self.arena.view
        pos = 0
        bs = self.slot_size
        while pos < n:
            o = offset + pos
            blk, within = divmod(o, bs)
            base, ln = lease.alloc.extents[blk]
            take = min(ln - within, n - pos)
            view[base + within : base + within + take] = data[pos : pos + take]
            pos += take
        lease.received += n

    def _manifest_for(self, spec: ParkSpec) -> Manifest:
        now = time.time()
        return Manifest(
            seq_id=spec.seq_id,
            gen=0,
            tensors=spec.tensors,
            nbytes=spec.nbytes,
            block_size=self.slot_size,
            fingerprint=fingerprint(spec.tensors),
            priority=spec.priority,
            created_at=now,
            last_access=now,
        )

    def commit(self, lease_id: str, expect_nbytes: int | None = None) -> SeqInfo:
        with self._commit_lock:
            with self._lock:
                lease = self._leases.pop(lease_id, None)
                if lease is None or lease.kind != "write":
                    raise LeaseExpired(f"write lease {lease_id!r} is gone (expired, aborted or never issued)")
                spec, alloc = lease.spec, lease.alloc
                assert spec is not None and alloc is not None
                if expect_nbytes is not None and (lease.received != spec.nbytes or expect_nbytes != spec.nbytes):
                    self._free_host(alloc)
                    raise InvalidArgument(
                        f"commit after {lease.received} bytes (commit says {expect_nbytes}); header declared "
                        f"{spec.nbytes}"
                    )
                old = self._seqs.get(spec.seq_id)
                if old is not None and not spec.overwrite:
                    self._free_host(alloc)
                    raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
                if self._closed:
                    self._free_host(alloc)
                    raise Unavailable("daemon is shutting down")
                self._gen += 1
                m = self._manifest_for(spec)
                m.gen = self._gen
                seq = Seq(manifest=m, host=alloc)
            if self.config.policy.write == "write_through":
                with self._disk_lock:
                    with self._lock:
                        freed = old.manifest.nbytes if old is not None and old.on_disk else 0
                        if self._disk_used - freed + m.nbytes > self.disk.capacity:
                            self._free_host(alloc)
                            raise ResourceExhausted(
                                f"disk tier full: {self._disk_used} of {self.disk.capacity} bytes used, park needs "
                                f"{m.nbytes} (write_through)"
                            )
                    try:
                        self.disk.write(m, self._views(alloc), replace=old.manifest if freed else None, sync=True)
                    except BaseException:
                        with self._lock:
                            self._free_host(alloc)
                        raise
                    with self._lock:
                        seq.on_disk = True
                        self._disk_used += m.nbytes
                        if freed:
                            old.on_disk = False
                            self._disk_used -= freed
                        self._publish(seq, old)
            else:
                with self._lock:
                    self._publish(seq, old)
                if old is not None and old.on_disk:
                    self._delete_from_disk(old)
            return self._info(seq)

    def _publish(self, seq: Seq, old: Seq | None) -> None:
        # REQUIRES: self._lock held.
        if old is not None:
            self._retire(old)
        self._seqs[seq.seq_id] = seq
        if policy.over_high(self.alloc.used_bytes, self.alloc.capacity, self.config.policy.high_watermark):
            self._wake.notify_all()

    def _retire(self, seq: Seq) -> None:
        # REQUIRES: self._lock held. Host slots are freed now, or by the last reader.
        seq.dropped = True
        if self._seqs.get(seq.seq_id) is seq:
            del self._seqs[seq.seq_id]
        self._maybe_free_host(seq)

    def _maybe_free_host(self, seq: Seq) -> None:
        if seq.dropped and seq.readers == 0 and not seq.demoting and seq.host is not None:
            self._free_host(seq.host)
            seq.host = None

    def _free_host(self, alloc: Allocation) -> None:
        # REQUIRES: self._lock held.
        self.alloc.free(alloc)
        self._space.notify_all()

    def _delete_from_disk(self, seq: Seq) -> None:
        with self._disk_lock:
            with self._lock:
                if not seq.on_disk:
                    return
                seq.on_disk = False
                self._disk_used -= seq.manifest.nbytes
            self.disk.delete(seq.manifest)

    def _views(self, alloc: Allocation) -> list[memoryview]:
        v = self.arena.view
        return [v[o : o + n] for o, n in alloc.extents]

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
            if lease.alloc is not None:
                self._free_host(lease.alloc)
                lease.alloc = None
        elif lease.seq is not None:
            lease.seq.readers -= 1
            assert lease.seq.readers >= 0
            self._maybe_free_host(lease.seq)
            lease.seq = None

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            for lease in [l for l in self._leases.values() if l.expires_at is not None and l.expires_at < now]:
                log.warning("%s lease %s expired; freeing what it held", lease.kind, lease.lease_id[:8])
                self._end_lease(lease)

    # ------------------------------------------------------------------ restore

    def acquire(self, seq_id: str, need_host: bool = False, stream: bool = False) -> ReadHandle:
        validate_seq_id(seq_id)
        self._check_open()
        for _ in range(3):
            with self._lock:
                seq = self._seqs.get(seq_id)
                if seq is None:
                    raise NotFound(f"no parked sequence {seq_id!r}")
                seq.manifest.last_access = time.time()
                seq.access_count += 1
                if seq.host is not None:
                    return self._lease_read(seq, stream)
            if need_host or self.config.policy.promote_on_restore:
                self._promote(seq, make_room=need_host)
            with self._lock:
                if seq.dropped:
                    continue  # overwritten or dropped meanwhile: look it up again
                if seq.host is not None:
                    return self._lease_read(seq, stream)
            if need_host:
                raise ResourceExhausted(
                    f"sequence {seq_id!r} ({seq.manifest.nbytes} bytes) is on disk and the host tier has no room "
                    "to stage it (leased sequences cannot be demoted)"
                )
            with self._lock:
                return ReadHandle(self._info(seq), seq.manifest, None, None)
        raise NotFound(f"no parked sequence {seq_id!r}")

    def _lease_read(self, seq: Seq, stream: bool) -> ReadHandle:
        # REQUIRES: self._lock held and seq.host set.
        ttl = None if stream else time.monotonic() + self.config.leases.ttl_s
        lease = Lease(secrets.token_hex(16), "read", ttl, seq=seq)
        seq.readers += 1
        self._leases[lease.lease_id] = lease
        return ReadHandle(self._info(seq), seq.manifest, lease, seq.host)

    def _promote(self, seq: Seq, make_room: bool) -> None:
        """Copy a disk-resident sequence into host slots (verifying every block)."""
        m = seq.manifest
        if m.block_size != self.slot_size:
            return  # parked under another slot size; served from disk as it is
        with seq.promote_lock:
            alloc = None
            deadline = time.monotonic() + ROOM_WAIT_S
            while True:
                with self._lock:
                    if seq.host is not None or seq.dropped:
                        return
                    alloc = self.alloc.alloc(m.nbytes)
                if alloc is not None or not make_room or not self._await_room(m.nbytes, seq, deadline):
                    break
            if alloc is None:
                return
            try:
                view = self.arena.view
                with self.disk.read_txn() as r:
                    for i, (off, n) in enumerate(alloc.extents):
                        view[off : off + n] = r.read_block(m, i, n)
            except BaseException:
                with self._lock:
                    self._free_host(alloc)
                raise
            with self._lock:
                if seq.dropped:
                    self._free_host(alloc)
                    return
                seq.host = alloc

    def iter_chunks(self, handle: ReadHandle, chunk_size: int) -> Iterator[tuple[int, list[memoryview]]]:
        """(payload offset, views) pieces of at most ``chunk_size`` bytes, in payload order.

        Disk-served sequences are read inside one read transaction; each block is verified
        before any of its bytes are yielded.
        """
        m = handle.manifest
        if handle.alloc is not None:
            yield from regroup(self._views(handle.alloc), chunk_size)
            return
        lengths = m.block_lengths
        with self.disk.read_txn() as r:
            yield from regroup((r.read_block(m, i, n) for i, n in enumerate(lengths)), chunk_size)

    # ------------------------------------------------------------------ demotion

    def _evictable(self, exclude: Seq | None = None) -> list[policy.SeqMeta]:
        # REQUIRES: self._lock held.
        return [
            policy.SeqMeta(s.seq_id, s.host.charged, s.manifest.last_access, s.manifest.priority, s.access_count,
                           s.manifest.created_at)
            for s in self._seqs.values()
            if s.host is not None and s.readers == 0 and not s.demoting and s is not exclude
        ]

    def _await_room(self, need: int, exclude: Seq | None, deadline: float) -> bool:
        """Demote (or wait for in-flight work to free space) so ``need`` bytes may fit.

        False when waiting cannot help: nothing is demotable and nothing in flight
        (a demotion, a read, a reservation) will free space before ``deadline``.
        """
        if self._make_room(need, exclude):
            return True
        with self._lock:
            transient = any(l.expires_at is None or l.kind == "write" for l in self._leases.values()) or any(
                s.demoting for s in self._seqs.values()
            )
            if not transient or time.monotonic() >= deadline or self._closed:
                return False
            self._space.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        return True

    def _make_room(self, need: int, exclude: Seq | None = None) -> bool:
        """Demote in policy order until ``need`` bytes fit. True if it fits now.

        The byte target alone is not enough: packed tails fragment slots, so the loop
        checks the allocator itself after every victim.
        """
        with self._lock:
            if self.alloc.fits(need):
                return True
            order = policy.plan_demotion(
                self.config.policy.eviction, self._evictable(exclude), self.alloc.used_bytes,
                self.alloc.capacity, target=-1,
            )
        for sid in order:
            self._demote(sid)
            with self._lock:
                if self.alloc.fits(need):
                    return True
        return False

    def _demote(self, seq_id: str) -> bool:
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None or seq.host is None:
                return False
        try:
            self._write_to_disk(seq)
        except KVParkError as e:
            log.warning("demotion of %r failed: %s", seq_id, e)
            return False
        with self._lock:
            if seq.on_disk and seq.readers == 0 and not seq.demoting and seq.host is not None:
                self._free_host(seq.host)
                seq.host = None
                return True
        return False

    def _write_to_disk(self, seq: Seq) -> bool:
        """Make sure ``seq`` has a durable-enough disk copy; its host copy is kept."""
        with self._disk_lock:
            with self._lock:
                if seq.dropped or seq.host is None or seq.on_disk or seq.demoting:
                    return seq.on_disk
                if self._disk_used + seq.manifest.nbytes > self.disk.capacity:
                    raise ResourceExhausted(
                        f"disk tier full: {self._disk_used} of {self.disk.capacity} bytes used"
                    )
                seq.demoting = True  # pins the host copy while we read it
            try:
                self.disk.write(seq.manifest, self._views(seq.host))
            finally:
                with self._lock:
                    seq.demoting = False
            with self._lock:
                seq.on_disk = True
                self._disk_used += seq.manifest.nbytes
                if seq.dropped:
                    stale = True
                    self._maybe_free_host(seq)
                else:
                    stale = False
            if stale:  # dropped or overwritten while we wrote: remove what we wrote
                with self._lock:
                    seq.on_disk = False
                    self._disk_used -= seq.manifest.nbytes
                self.disk.delete(seq.manifest)
                return False
            return True

    def _maintain(self) -> None:
        interval = min(1.0, max(0.05, self.config.leases.ttl_s / 4))
        cfg = self.config.policy
        while True:
            with self._lock:
                if self._closed:
                    return
                if not policy.over_high(self.alloc.used_bytes, self.alloc.capacity, cfg.high_watermark):
                    self._wake.wait(interval)
                if self._closed:
                    return
            try:
                self._reap()
                with self._lock:
                    plan = []
                    if policy.over_high(self.alloc.used_bytes, self.alloc.capacity, cfg.high_watermark):
                        plan = policy.plan_demotion(
                            cfg.eviction, self._evictable(), self.alloc.used_bytes, self.alloc.capacity,
                            policy.background_target(self.alloc.capacity, cfg.low_watermark),
                        )
                moved = 0
                for sid in plan:
                    if self._closed:
                        break
                    moved += self._demote(sid)
                if not moved:
                    # Nothing could move (disk full, or everything leased): back off, don't spin.
                    with self._lock:
                        if not self._closed:
                            self._wake.wait(interval)
            except Exception:  # the maintenance thread must never die
                log.exception("maintenance pass failed")

    # ------------------------------------------------------------------ queries

    def drop(self, seq_id: str) -> bool:
        validate_seq_id(seq_id)
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return False
            self._retire(seq)
        if seq.on_disk:
            self._delete_from_disk(seq)
        return True

    def _info(self, seq: Seq) -> SeqInfo:
        m = seq.manifest
        return SeqInfo(
            seq_id=m.seq_id,
            nbytes=m.nbytes,
            tier=seq.tier,
            num_tensors=len(m.tensors),
            tensors=m.tensors,
            priority=m.priority,
            created_at=m.created_at,
            last_access=m.last_access,
            num_blocks=len(m.block_lengths),
        )

    def info(self, seq_id: str) -> SeqInfo:
        validate_seq_id(seq_id)
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise NotFound(f"no parked sequence {seq_id!r}")
            return self._info(seq)

    def list(self) -> list[SeqInfo]:
        with self._lock:
            return [self._info(s) for s in sorted(self._seqs.values(), key=lambda s: s.seq_id)]

    def stat(self) -> Stat:
        with self._lock:
            host = [s for s in self._seqs.values() if s.host is not None]
            disk = [s for s in self._seqs.values() if s.on_disk]
            return Stat(
                tiers={
                    "host": TierStat(
                        self.alloc.capacity,
                        self.alloc.used_bytes,
                        sum(len(s.host.extents) for s in host),  # type: ignore[union-attr]
                        len(host),
                    ),
                    "disk": TierStat(
                        self.disk.capacity,
                        self._disk_used,
                        sum(len(s.manifest.block_lengths) for s in disk),
                        len(disk),
                    ),
                },
                sequences=len(self._seqs),
                leases=len(self._leases),
            )

    def hello(self) -> dict:
        return {
            "server_version": VERSION,
            "transports": ["shm", "inline"] if self.arena.path else ["inline"],
            "chunk_size": self.config.server.chunk_size,
            "arena_path": self.arena.path,
            "arena_size": self.arena.size,
            "slot_size": self.slot_size,
            "lease_ttl_s": self.config.leases.ttl_s,
        }


__all__ = ["Engine", "ParkSpec", "Lease", "ReadHandle", "DataLoss"]
