"""The lease table: write reservations and read leases, their deadlines and their end.

A write lease holds the slots a park reserved until it commits or aborts; a read lease
holds readers on the memory copies a restore serves. Leases held by a live stream carry
no deadline (the stream releases them); every other lease expires after
``leases.ttl_s``, so a crashed client frees what it held. Write leases always expire:
a stalled stream gets an idle deadline that every chunk pushes back.

The table lives under the catalog's index lock (it changes readers and frees slots).

A transfer owns its lease: a lease cannot end under a chunk being copied into or out of
its slots (a data channel PUT or GET, a gRPC stream's chunk, a window being moved).
Each such copy holds ``Lease.lock`` (``copying``); ending a lease (a Release, a commit,
shutdown) first waits that copy out, *without* the index lock, marks the lease ended,
so the transfer's next copy fails typed, then frees the slots under the index lock. The
reaper never waits: a lease being copied right now is alive, and it ends only leases
still past their deadline when it gets to them. A window's end hook that fails (a
staged delete on a failing disk) is logged, and the slots are freed all the same.

Primitives:
- ``LeaseTable(catalog, LeaseConfig)``.
- ``issue_write(spec, tier, allocs) -> Lease`` and ``add(lease)`` (REQUIRES: index lock);
  ``new_read(stream) -> Lease``.
- ``get(lease_id) -> Lease`` (any kind); ``get_write(lease_id) -> Lease``; ``take_write(lease_id) -> Lease`` (REQUIRES: index
  lock): remove a write lease for its commit.
- ``require_all(lease_id)``: a write lease the data channel fills, whose commit needs
  every byte; ``required(lease_id) -> int | None``: what its commit must have received.
- ``extend(lease)``: push a write lease's idle deadline back; ``hold(lease_id)``: a read lease
  that stops expiring, taken over by the data channel transfer that ends it (never one
  past its deadline); ``copying(lease)``: a context in which one chunk is copied.
- ``end(lease, expired_before=None)``, ``release(lease_id) -> bool``: free what a lease
  holds (a windowed park's staged disk blocks too; a windowed restore's window slots).
- ``reap()``: end every expired lease, then call ``on_expired(owner)`` (when set) once
  for each sequence that read leases it ended were reading first (outside the index
  lock: a tenant's quota settles there, as after a Release). ``close()``: end them all
  (each after the chunk being copied through it).
- ``transient()``: whether an open lease may still free room; ``count``; ``held()``;
  ``open_writes()`` (REQUIRES: index lock); ``write_owner(lease_id)``;
  ``count_owned(prefix)``: open leases on a tenant's sequences (REQUIRES: index lock);
  ``slots()``: which sequence's bytes each lease's slots are for, and in which tier.
- ``gone(lease_id)``, ``write_gone(lease_id)``, ``write_idle(lease_id)``: the errors ``get``,
  ``take_write`` and ``get_write`` raise for a lease that does not exist; a tenant asking
  about another tenant's lease gets exactly these.
"""

from __future__ import annotations

import logging
import secrets
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from kvpark.proto.errors import LeaseExpired
from kvpark.tiers.arena import Allocation

from .catalog import Catalog
from .config import LeaseConfig
from .metrics import Metrics
from .model import Lease, ParkSpec, Seq

log = logging.getLogger("kvpark.leases")


def gone(lease_id: str) -> LeaseExpired:
    return LeaseExpired(f"lease {lease_id!r} is gone (expired, released or never issued)")


def write_gone(lease_id: str) -> LeaseExpired:
    return LeaseExpired(f"write lease {lease_id!r} is gone (expired, aborted or never issued)")


def write_idle(lease_id: str) -> LeaseExpired:
    return LeaseExpired(f"write lease {lease_id!r} expired (the stream was idle too long)")


class LeaseTable:
    def __init__(self, catalog: Catalog, config: LeaseConfig, metrics: Metrics | None = None) -> None:
        self.catalog = catalog
        self.metrics = metrics
        self.ttl_s = config.ttl_s
        self._leases: dict[str, Lease] = {}
        # Told which sequence an expired read lease read first (``Tenants``: the owner's quota
        # settles, since a reader that never released its lease never settles it).
        self.on_expired: Callable[[str], None] | None = None

    @property
    def count(self) -> int:
        return len(self._leases)

    def issue_write(self, spec: ParkSpec, tier: str, allocs: list[Allocation]) -> Lease:
        # REQUIRES: index lock. ``allocs``: the new blocks' slots, then the sequence's.
        lease = Lease(secrets.token_hex(16), "write", tier, time.monotonic() + self.ttl_s, spec=spec,
                      alloc=allocs[-1], block_allocs=allocs[:-1])
        self._leases[lease.lease_id] = lease
        return lease

    def new_read(self, stream: bool) -> Lease:
        """A read lease to fill with parts; ``add`` makes it visible once it holds any."""
        return Lease(secrets.token_hex(16), "read", "", None if stream else time.monotonic() + self.ttl_s)

    def add(self, lease: Lease) -> None:
        # REQUIRES: index lock.
        self._leases[lease.lease_id] = lease

    def get(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise gone(lease_id)
        return lease

    def get_write(self, lease_id: str) -> Lease:
        """An open write lease (a dict read: no lock needed for one lookup per chunk)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind != "write":
            raise write_idle(lease_id)
        return lease

    def take_write(self, lease_id: str) -> Lease:
        # REQUIRES: index lock.
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind != "write":
            raise write_gone(lease_id)
        del self._leases[lease_id]
        return lease

    def hold(self, lease_id: str) -> Lease | None:
        """A live read lease, taken over by a transfer that ends it: it no longer expires
        under the reader (the data channel streams from its slots). None if it is gone,
        ended, or past its deadline (the reaper may be ending it right now)."""
        now = time.monotonic()
        with self.catalog.lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.kind != "read" or lease.ended:
                return None
            if lease.expires_at is not None and lease.expires_at < now:
                return None
            lease.expires_at = None
            return lease

    @contextmanager
    def copying(self, lease: Lease | None) -> Iterator[None]:
        """Copy into or out of ``lease``'s slots (a chunk of a transfer). Nothing ends the
        lease meanwhile: ``end`` (a Release, the reaper, shutdown) waits out this copy, and
        the copy after it raises ``LeaseExpired``. None: a restore served from disk."""
        if lease is None:
            yield
            return
        with lease.lock:
            if lease.ended:
                raise LeaseExpired(f"{lease.kind} lease {lease.lease_id[:8]} ended during the transfer "
                                   "(released, expired or the daemon is stopping)")
            yield

    def require_all(self, lease_id: str) -> None:
        """Mark a write lease whose bytes come through this process on its own (the data
        channel): its commit must find every byte received, whoever asks for it."""
        self.get_write(lease_id).fill_here = True

    def required(self, lease_id: str) -> int | None:
        """The bytes a commit of this write lease must have received; None when its bytes
        were written where the daemon cannot count them (shm, cuda_ipc) or it is gone."""
        lease = self._leases.get(lease_id)  # one dict read
        if lease is None or lease.kind != "write" or not lease.fill_here or lease.spec is None:
            return None
        return lease.spec.total

    def extend(self, lease: Lease) -> None:
        lease.expires_at = time.monotonic() + self.ttl_s

    def release(self, lease_id: str) -> bool:
        """End a read lease or abort an uncommitted write lease. False if already gone."""
        with self.catalog.lock:
            lease = self._leases.get(lease_id)
        if lease is None:
            return False
        return self.end(lease)

    def end(self, lease: Lease, expired_before: float | None = None) -> bool:
        """Free what ``lease`` holds. False if someone else ended it first.

        Waits out a chunk being copied into or out of its slots (``Lease.lock``), so no
        slot is freed under a copy. ``expired_before`` (the reaper): end it only if it is
        still past that deadline, and never wait: a lease being copied right now is alive
        (a transfer's lease stops expiring; a write's is extended after each chunk).
        """
        if not lease.lock.acquire(blocking=expired_before is None):
            return False
        try:
            if lease.ended:
                return False
            if expired_before is not None and (lease.expires_at is None or lease.expires_at >= expired_before):
                return False  # held by a transfer, or extended, since the reaper looked
            lease.ended = True
        finally:
            lease.lock.release()
        if lease.kind == "write":
            if lease.window is not None and lease.window.on_end is not None:
                # Before the slots go: waits out the window being written to disk, then
                # deletes what was staged (never published, never visible).
                self._on_end(lease)
            with self.catalog.lock:
                self._leases.pop(lease.lease_id, None)
                for a in lease.write_allocs():
                    self.catalog.free(lease.tier, a)
                lease.alloc, lease.block_allocs = None, []
                if lease.window is not None:
                    lease.window.alloc = None
            return True
        if lease.window is not None and lease.window.on_end is not None:
            self._on_end(lease)  # before the slots go: the read in flight lands, the snapshot ends
        with self.catalog.lock:
            if self._leases.pop(lease.lease_id, None) is None and not lease.parts:
                return False
            self.end_read(lease)
        return True

    @staticmethod
    def _on_end(lease: Lease) -> None:
        """A window's end hook. Its I/O in flight has landed once it returns or raises
        (``Window.settle`` first), so the slots may go either way: a failed delete of
        staged blocks (EIO, EROFS, a full map) leaves records no manifest names, which the
        next start deletes; the slots must not stay lost until then."""
        assert lease.window is not None and lease.window.on_end is not None
        try:
            lease.window.on_end()
        except Exception as e:  # noqa: BLE001 - logged; the lease still ends
            log.error("%s lease %s: its window's end failed (%s: %s); freeing its slots anyway",
                      lease.kind, lease.lease_id[:8], type(e).__name__, e)

    def end_read(self, lease: Lease) -> None:
        # REQUIRES: index lock.
        self._leases.pop(lease.lease_id, None)
        for seq, tier in lease.parts:
            seq.drop_reader(tier)
            self.catalog.release_dropped(seq)
        lease.parts = []
        w = lease.window
        if w is not None and w.alloc is not None:
            self.catalog.free(w.tier, w.alloc)
            w.alloc = None
        self.catalog.notify()  # a copy without readers may be demoted now

    def reap(self) -> None:
        now = time.monotonic()
        with self.catalog.lock:
            expired = [(l, self.owner(l.lease_id)) for l in self._leases.values()
                       if l.expires_at is not None and l.expires_at < now]
        owners: dict[str, None] = {}
        for lease, owner in expired:
            if self.end(lease, expired_before=now):
                log.warning("%s lease %s expired: its client neither finished nor released it within leases.ttl_s "
                            "(it went away or hangs); freeing what it held", lease.kind, lease.lease_id[:8])
                if self.metrics is not None:
                    self.metrics.lease_expired()
                if lease.kind == "read" and owner:
                    owners[owner] = None
        if self.on_expired is not None:
            for owner in owners:
                self.on_expired(owner)

    def close(self) -> None:
        with self.catalog.lock:
            todo = list(self._leases.values())
        for lease in todo:
            self.end(lease)

    def transient(self) -> bool:
        """An open lease will end by itself (a stream's, or a write reservation)."""
        # REQUIRES: index lock.
        return any(l.expires_at is None or l.kind == "write" for l in self._leases.values())

    def write_owner(self, lease_id: str) -> str | None:
        """The sequence (or first new block) an open write lease parks; None if no such lease."""
        lease = self._leases.get(lease_id)  # one dict read
        if lease is None or lease.kind != "write" or lease.spec is None:
            return None
        return lease.spec.seq_id or (lease.spec.blocks[0].seq_id if lease.spec.blocks else "")

    def owner(self, lease_id: str) -> str | None:
        """The sequence a lease parks (write) or reads first (read); None if no such lease."""
        lease = self._leases.get(lease_id)  # one dict read
        if lease is None:
            return None
        if lease.kind == "write":
            return self.write_owner(lease_id)
        return lease.parts[0][0].seq_id if lease.parts else None

    def count_owned(self, prefix: str) -> int:
        """Open leases whose sequence (parked, or read first) is in namespace ``prefix``."""
        # REQUIRES: index lock.
        return sum(1 for lid in list(self._leases) if (self.owner(lid) or "").startswith(prefix))

    def open_writes(self) -> list[Lease]:
        """Write leases not yet committed or aborted (quota accounting counts them)."""
        # REQUIRES: index lock.
        return [l for l in self._leases.values() if l.kind == "write"]

    def slots(self) -> list[tuple[str, str]]:
        """``(sequence, tier)`` for every lease holding slots: a write lease's (the sequence or
        first new block it parks), a windowed restore's window (the sequence it reads)."""
        # REQUIRES: index lock.
        out = []
        for l in self._leases.values():
            if l.kind == "write" and l.spec is not None:
                out.append((l.spec.owner, l.window.tier if l.window is not None else l.tier))
            elif l.window is not None and l.window.alloc is not None and l.window.seq is not None:
                out.append((l.window.seq.seq_id, l.window.tier))
        return out

    def held(self) -> tuple[list[list[tuple[str, Allocation]]], dict[tuple[int, str], int], list[Seq]]:
        """What open leases hold: write slots per lease, readers per ``(id(seq), tier)``,
        and the sequences read leases hold (dropped ones among them)."""
        # REQUIRES: index lock.
        writes: list[list[tuple[str, Allocation]]] = []
        readers: dict[tuple[int, str], int] = {}
        leased: dict[int, Seq] = {}
        for l in self._leases.values():
            if l.kind == "write":
                writes.append([(l.tier, a) for a in l.write_allocs()])
            elif l.window is not None and l.window.alloc is not None:
                writes.append([(l.window.tier, l.window.alloc)])  # a windowed restore's slots
            for seq, tier in l.parts:
                readers[(id(seq), tier)] = readers.get((id(seq), tier), 0) + 1
                leased[id(seq)] = seq
        return writes, readers, list(leased.values())
