"""Sequences larger than a memory tier: parks and restores through one window of slots.

A park whose payload is larger than the memory tier it is bound for cannot land there
whole. It streams to disk instead, one window at a time: the write lease holds one
window of slots (``tiers.host.window_size``); the client (shm, cuda_ipc) or the inline
stream fills it; the daemon writes those blocks to the disk tier *staged* (checksummed
records with no manifest: invisible, and deleted at the next start if the daemon dies),
and the same slots take the next window. The commit writes the manifest in one
transaction: the sequence becomes visible whole or not at all. An aborted or expired
park deletes what it staged. The only limit is the disk tier's capacity.

A restore of such a sequence into that tier (shm, cuda_ipc) reads it back the same way:
a read lease holds one window of slots, a reader on the sequence's disk copy (disk
eviction skips it) and one LMDB read transaction (a snapshot: a drop or overwrite
meanwhile does not change what it reads), and each window is read from that snapshot
(verified) into the slots before the client copies it out. The inline stream needs none of this: it reads disk records
straight into its messages. Such a sequence is never promoted into a tier it cannot fit
(``Mover`` checks the size first); it stays on disk.

Primitives:
- ``Windows(catalog, leases, disk, mover, tiers, slot_size, window_size, write_through,
  forget_remote)``; ``forget_remote(seqs)`` deletes replaced versions' remote copies.
- ``size_for(tier) -> int``: the window of ``tier``: ``window_size`` (0: a quarter of the
  tier, at most ``AUTO_MAX``), whole slots, at least one slot, at most the tier.
- ``needed(nbytes, tier) -> bool``: a payload larger than the tier.
- ``reserve(spec, tier) -> Reservation``: a windowed write lease, window 0's segments.
- ``write(lease, offset, data)``: inline bytes into the window; a full window goes to disk.
- ``move(lease, index) -> segments``: a park: stage the window the client filled and
  hand out window ``index`` (the next); a restore: read window ``index`` into the slots.
- ``commit(lease, expect_nbytes) -> SeqInfo``: stage the last window and publish; the
  versions it retires lose their disk (and remote) copies.
- ``open_read(tops, seq, tier) -> ReadHandle``: a windowed read lease with window 0 read.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import Callable

from kvpark.proto.errors import AlreadyExists, InvalidArgument, KVParkError, LeaseExpired, NotFound, \
    ResourceExhausted
from kvpark.proto.types import SeqInfo
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import DiskStore
from kvpark.tiers.memory import MemTier

from .catalog import Catalog
from .leases import LeaseTable
from .model import Lease, ParkSpec, Part, ReadHandle, Reservation, Seq, Window
from .mover import ROOM_WAIT_S, Mover

log = logging.getLogger("kvpark.window")

AUTO_MAX = 256 << 20  # an auto window never takes more than this (a quarter of the tier below 1 GiB)


class Windows:
    def __init__(self, catalog: Catalog, leases: LeaseTable, disk: DiskStore, mover: Mover,
                 tiers: dict[str, MemTier], slot_size: int, window_size: int, write_through: bool,
                 forget_remote: Callable[[list[Seq]], None]) -> None:
        self.catalog = catalog
        self.leases = leases
        self.disk = disk
        self.mover = mover
        self.tiers = tiers
        self.slot_size = slot_size
        self.window_size = window_size
        self.write_through = write_through
        self.forget_remote = forget_remote

    def size_for(self, tier: str) -> int:
        cap = self.tiers[tier].alloc.capacity
        want = self.window_size or min(cap // 4, AUTO_MAX)
        bs = self.slot_size
        return max(bs, min(want, cap) // bs * bs)

    def needed(self, nbytes: int, tier: str) -> bool:
        return nbytes > self.tiers[tier].alloc.capacity

    # ------------------------------------------------------------------ park

    def reserve(self, spec: ParkSpec, tier: str) -> Reservation:
        cap = self.tiers[tier].alloc.capacity
        if spec.blocks or spec.refs:
            raise ResourceExhausted(
                f"sequence of {spec.total} bytes is larger than the {tier} tier ({cap} bytes); a park that large "
                "streams to disk, and then cannot create or reference shared blocks"
            )
        if spec.nbytes > self.disk.capacity:
            raise ResourceExhausted(
                f"sequence of {spec.nbytes} bytes is larger than the {tier} tier ({cap} bytes) and than the disk "
                f"tier ({self.disk.capacity} bytes)"
            )
        with self.catalog.lock:
            if not spec.overwrite and self.catalog.find(spec.seq_id) is not None:
                raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
            m = spec.manifest(self.catalog.next_gen(), self.slot_size)
        self.mover.evict_disk(m.nbytes)  # by policy: the coldest leave the disk so this fits
        try:
            self.disk.stage_begin(m)
        except ResourceExhausted as e:
            raise ResourceExhausted(f"sequence of {m.nbytes} bytes is larger than the {tier} tier ({cap} bytes) and "
                                    f"does not fit on disk: {e.message}") from None
        try:
            size = self.size_for(tier)
            a = self._alloc(tier, min(size, -(-m.nbytes // self.slot_size) * self.slot_size))
            with self.catalog.lock:
                lease = self.leases.issue_write(spec, tier, [a])
                w = lease.window = Window(m, tier, a, size, on_end=lambda: self.disk.stage_abort(m))
                segs = tuple(w.segments())
        except BaseException:
            self.disk.stage_abort(m)
            raise
        log.debug("windowed park of %r: %d bytes in %d window(s) of %d", spec.seq_id, m.nbytes, w.count, size)
        return Reservation(lease.lease_id, tier, segs, self.leases.ttl_s, window_size=size)  # type: ignore[arg-type]

    def _alloc(self, tier: str, n: int) -> Allocation:
        """One window of slots in ``tier``, making room as a park does."""
        mem = self.tiers[tier]
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            with self.catalog.lock:
                a = mem.alloc.alloc(n)
            if a is not None:
                return a
            if not self.mover.await_room(tier, n, None, deadline):
                raise ResourceExhausted(f"no room for a {n}-byte window in the {tier} tier "
                                        f"({mem.alloc.free_bytes} of {mem.alloc.capacity} free; leased or pinned)")

    def write(self, lease: Lease, offset: int, data: memoryview) -> None:
        """Inline bytes at payload ``offset`` (the caller checked order and bounds)."""
        w = lease.window
        assert w is not None
        mem = self.tiers[lease.tier]
        n = len(data)
        with lease.lock:
            if lease.ended:
                raise LeaseExpired(f"write lease {lease.lease_id!r} expired (the stream was idle too long)")
            pos = 0
            while pos < n:
                start, length = w.span(w.index)
                within = offset + pos - start
                take = min(length - within, n - pos)
                self._put(mem, w, within, data[pos:pos + take])
                pos += take
                if within + take == length and w.index + 1 < w.count:
                    self._stage(w)
                    w.index += 1
            lease.received += n
            self.leases.extend(lease)

    def _put(self, mem: MemTier, w: Window, within: int, data: memoryview) -> None:
        assert w.alloc is not None
        bs, pos = self.slot_size, 0
        while pos < len(data):
            blk, off = divmod(within + pos, bs)
            base, ln = w.alloc.extents[blk]
            take = min(ln - off, len(data) - pos)
            mem.write(base + off, data[pos:pos + take])
            pos += take

    def _stage(self, w: Window) -> None:
        """Write the current window's blocks to disk (staged). REQUIRES: the lease's lock."""
        assert w.alloc is not None
        start, length = w.span(w.index)
        if w.staged > start:
            return  # already on disk (a retried call)
        first = start // self.slot_size
        lengths = w.manifest.block_lengths[first:first + -(-length // self.slot_size)]
        views = self.tiers[w.tier].views(w.alloc)
        self.disk.stage_blocks(w.manifest, first, [v[:n] for v, n in zip(views, lengths)])
        w.staged = start + length

    def move(self, lease: Lease, index: int) -> list[tuple[int, int]]:
        """Window ``index`` into the lease's slots; returns where it lies."""
        w = lease.window
        assert w is not None
        with lease.lock:
            if lease.ended or w.alloc is None:
                raise LeaseExpired(f"lease {lease.lease_id!r} is gone (expired or released)")
            if not 0 <= index < w.count:
                raise InvalidArgument(f"window {index} of a {w.count}-window sequence")
            if w.reading:
                self._read(w, index)
            else:
                if index != w.index + 1:
                    raise InvalidArgument(f"window {index} asked after window {w.index}: a park's windows go in order")
                self._stage(w)
                w.index = index
            self.leases.extend(lease)
            return w.segments()

    def commit(self, lease: Lease, expect_nbytes: int | None) -> SeqInfo:
        """Publish a windowed park. The caller took the lease and marked it ended."""
        w, spec = lease.window, lease.spec
        assert w is not None and spec is not None
        m = w.manifest
        try:
            if expect_nbytes is not None:  # inline: every byte arrived
                if lease.received != m.nbytes or expect_nbytes != m.nbytes:
                    raise InvalidArgument(f"commit after {lease.received} bytes (commit says {expect_nbytes}); "
                                          f"header declared {m.nbytes}")
            elif w.index != w.count - 1:
                raise InvalidArgument(f"commit after window {w.index} of {w.count}: every window must be written")
            self._stage(w)
        except BaseException:
            self._free(lease)
            self.disk.stage_abort(m)
            raise
        self._free(lease)
        seq = Seq(manifest=m, on_disk=True)
        with self.catalog.lock:
            old = self.catalog.find(m.seq_id)
            if old is not None and not spec.overwrite:
                self.disk.stage_abort(m)  # small I/O under the lock on a path that fails anyway
                raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
            replace = old.manifest if old is not None and old.on_disk else None
        won = self.disk.stage_commit(m, replace, sync=self.write_through)
        failed: KVParkError | None = None
        gone: list[Seq] = []
        with self.catalog.lock:
            if not won:  # a newer generation of the id reached the disk first: it stands
                seq.on_disk, seq.dropped = False, True
                info = self.catalog.info_of([seq], [seq])
            else:
                try:
                    gone = self.catalog.publish_commit(seq, spec, replace)
                    info = self.catalog.info(seq) if not seq.dropped else self.catalog.info_of([seq], [seq])
                except KVParkError as e:  # a concurrent commit or drop changed what we checked
                    failed, seq.dropped, gone = e, True, [seq]
            orphans = self.catalog.take_orphans()
        for s in gone + orphans:
            self.mover.delete_from_disk(s)
        self.forget_remote(gone)  # not the orphaned blocks: other daemons' sequences may use them
        if failed is not None:
            raise failed
        remote = self.mover.remote
        if remote is not None and remote.write_through and not seq.dropped:
            self.mover.copy_to_remote_later([seq])
        return info

    def _free(self, lease: Lease) -> None:
        with self.catalog.lock:
            if lease.alloc is not None:
                self.catalog.free(lease.tier, lease.alloc)
            lease.alloc = None
            assert lease.window is not None
            lease.window.alloc = None

    # ------------------------------------------------------------------ restore

    def open_read(self, tops: list[Seq], seq: Seq, tier: str) -> ReadHandle:
        self.mover.fetch_remote(seq)  # known only from the remote tier: onto disk first
        lease = self.leases.new_read(stream=False)
        with self.catalog.lock:
            if seq.dropped or not seq.on_disk:
                raise NotFound(f"sequence {seq.seq_id!r} was dropped during the restore")
            # A reader on the disk copy: disk eviction leaves it alone while the lease lasts.
            seq.readers["disk"] = seq.readers.get("disk", 0) + 1
            lease.parts.append((seq, "disk"))
        snapshot = ExitStack()
        try:
            size = self.size_for(tier)
            a = self._alloc(tier, min(size, -(-seq.manifest.nbytes // self.slot_size) * self.slot_size))
            # One read transaction for the whole restore: every window comes from the
            # version leased, even if the sequence is dropped or overwritten meanwhile.
            txn = snapshot.enter_context(self.disk.read_txn())
            lease.window = Window(seq.manifest, tier, a, size, reading=True, seq=seq, txn=txn, on_end=snapshot.close)
            with lease.lock:
                self._read(lease.window, 0)
            with self.catalog.lock:
                self.leases.add(lease)
                info = self.catalog.info_of(tops, [seq])
        except BaseException:
            with self.catalog.lock:
                self.leases.end_read(lease)
            snapshot.close()
            raise
        return ReadHandle(info, [Part(seq.manifest, None, "disk", seq)], lease)

    def _read(self, w: Window, index: int) -> None:
        """Read window ``index`` from disk into the slots, verified. REQUIRES: the lease's lock."""
        assert w.alloc is not None
        m, bs, mem = w.manifest, self.slot_size, self.tiers[w.tier]
        start, length = w.span(index)
        first = start // bs
        assert w.txn is not None
        for j, n in enumerate(m.block_lengths[first:first + -(-length // bs)]):
            mem.write(w.alloc.extents[j][0], w.txn.read_block(m, first + j, n))
        w.index = index
