"""Sequences larger than a memory tier: parks and restores through one window of slots.

A park whose payload is larger than the memory tier it is bound for cannot land there
whole. It streams to disk instead, one window at a time: the write lease holds two
windows of slots (``tiers.host.window_size`` each; one when the tier cannot hold two);
the client (shm, cuda_ipc) or the inline stream fills one while the daemon writes the
other's blocks to the disk tier *staged* (checksummed records with no manifest:
invisible, and deleted at the next start if the daemon dies), then they swap. The commit writes the manifest in one
transaction: the sequence becomes visible whole or not at all. An aborted or expired
park deletes what it staged. The only limit is the disk tier's capacity.

A restore of such a sequence into that tier (shm, cuda_ipc) reads it back the same way:
a read lease holds the windows' slots, a reader on the sequence's disk copy (disk
eviction skips it) and one LMDB read transaction (a snapshot: a drop or overwrite
meanwhile does not change what it reads); each window is read from that snapshot
(verified) into its slots, the next one while the client copies the current one out. The inline stream needs none of this: it reads disk records
straight into its messages. Such a sequence is never promoted into a tier it cannot fit
(``Mover`` checks the size first); it stays on disk.

Primitives:
- ``Windows(catalog, leases, disk, mover, tiers, slot_size, window_size, write_through,
  pending, deletes)``; replaced versions' remote copies are tombstoned and deleted through
  ``mover.remote`` (``remote_tier.py``); ``pending``: the commit side's (``commit.py``); ``deletes``: the mover's (``deletes.py``).
- ``close()``: after the lease table's (its I/O threads end).
- ``size_for(tier) -> int``: the window of ``tier``: ``window_size`` (0: a quarter of the
  tier, at most ``AUTO_MAX``), whole slots, at least one slot, at most the tier;
  ``buffers_for(tier)``: 2 when two such windows fit in the tier, else 1.
- ``needed(nbytes, tier) -> bool``: a payload larger than the tier.
- ``reserve(spec, tier) -> Reservation``: a windowed write lease, window 0's segments.
- ``write(lease, offset, data)``: inline bytes into the window; a full window goes to disk.
- ``move(lease, index) -> segments``: a park: hand the window the client filled to the
  disk and hand out window ``index`` (the next); a restore: window ``index``, read
  into its slots (already, when it is the one read ahead).
- ``commit(lease, expect_nbytes) -> SeqInfo``: stage the last window, take the
  generation (the commit point, as every park kind: the blocks keep the one they were
  staged under, ``Manifest.data_gen``) and publish; the versions it retires lose their
  disk (and remote) copies.
- ``open_read(tops, seq, tier) -> ReadHandle``: a windowed read lease with window 0 read.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from kvpark.proto.errors import AlreadyExists, InvalidArgument, KVParkError, LeaseExpired, NotFound, \
    ResourceExhausted, Unavailable
from kvpark.proto.types import SeqInfo
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import DiskStore
from kvpark.tiers.memory import MemTier

from .catalog import Catalog
from .commit import PENDING_WAIT_S, Pending, waits
from .deletes import Deletes
from .leases import LeaseTable
from .model import Lease, ParkSpec, Part, ReadHandle, Reservation, Seq, Window
from .mover import ROOM_WAIT_S, Mover

log = logging.getLogger("kvpark.window")

AUTO_MAX = 256 << 20  # an auto window never takes more than this (a quarter of the tier below 1 GiB)


class Windows:
    def __init__(self, catalog: Catalog, leases: LeaseTable, disk: DiskStore, mover: Mover,
                 tiers: dict[str, MemTier], slot_size: int, window_size: int, write_through: bool,
                 pending: Pending, deletes: Deletes) -> None:
        self.catalog = catalog
        self.leases = leases
        self.disk = disk
        self.mover = mover
        self.tiers = tiers
        self.slot_size = slot_size
        self.window_size = window_size
        self.write_through = write_through
        self.pending = pending
        self.deletes = deletes
        # Disk writes and reads of windows, beside the calls that move them (threads start on first use).
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvpark-window")

    def close(self) -> None:
        """After every lease has ended: no window I/O is left in flight."""
        self._io.shutdown(wait=True)

    def size_for(self, tier: str) -> int:
        cap = self.tiers[tier].alloc.capacity
        want = self.window_size or min(cap // 4, AUTO_MAX)
        bs = self.slot_size
        return max(bs, min(want, cap) // bs * bs)

    def buffers_for(self, tier: str) -> int:
        return 2 if 2 * self.size_for(tier) <= self.tiers[tier].alloc.capacity else 1

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
            if not spec.overwrite and spec.seq_id in self.catalog:
                raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
            # The generation its blocks are staged under (unique: no other version's
            # records share it); the version's own comes at commit.
            m = spec.manifest(self.catalog.next_gen(), self.slot_size)
        self.mover.evict_disk(m.nbytes)  # by policy: the coldest leave the disk so this fits
        try:
            self.disk.stage_begin(m)
        except ResourceExhausted as e:
            raise ResourceExhausted(f"sequence of {m.nbytes} bytes is larger than the {tier} tier ({cap} bytes) and "
                                    f"does not fit on disk: {e.message}") from None
        try:
            size, buffers = self.size_for(tier), self.buffers_for(tier)
            a = self._alloc(tier, buffers * size)
            w = Window(m, tier, a, size, buffers)

            def abort() -> None:
                w.settle()  # the window write in flight lands first, so nothing is left behind
                self.disk.stage_abort(m)

            w.on_end = abort
            with self.catalog.lock:
                lease = self.leases.issue_write(spec, tier, [a])
                lease.window = w
                segs = tuple(w.segments())
        except BaseException:
            self.disk.stage_abort(m)
            raise
        log.debug("windowed park of %r: %d bytes in %d window(s) of %d", spec.seq_id, m.nbytes, w.count, size)
        return Reservation(lease.lease_id, tier, segs, self.leases.ttl_s, window_size=size)  # type: ignore[arg-type]

    def _alloc(self, tier: str, n: int) -> Allocation:
        """``n`` bytes of slots in ``tier`` for the windows, making room as a park does."""
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
                self._put(mem, w.extents(w.index), within, data[pos:pos + take])
                pos += take
                if within + take == length and w.index + 1 < w.count:
                    self._hand_off(w)
                    w.index += 1
            lease.received += n
            self.leases.extend(lease)

    def _put(self, mem: MemTier, extents: list[tuple[int, int]], within: int, data: memoryview) -> None:
        bs, pos = self.slot_size, 0
        while pos < len(data):
            blk, off = divmod(within + pos, bs)
            base, ln = extents[blk]
            take = min(ln - off, len(data) - pos)
            mem.write(base + off, data[pos:pos + take])
            pos += take

    @staticmethod
    def _wait(w: Window) -> int | None:
        """The disk I/O in flight landed; its window (or None). Raises what it raised."""
        job, w.pending = w.pending, None
        return job.result() if job is not None else None

    def _hand_off(self, w: Window) -> None:
        """Write the current window to disk; beside the next one's filling when there are
        two buffers. REQUIRES: the lease's lock."""
        self._wait(w)  # the previous window's write landed: its half is free to refill
        if w.buffers == 1:
            self._stage(w, w.index)
        else:
            w.pending = self._io.submit(self._stage, w, w.index)

    def _stage(self, w: Window, index: int) -> int:
        """Write window ``index``'s blocks to disk, staged."""
        first = w.span(index)[0] // self.slot_size
        self.disk.stage_blocks(w.manifest, first, self.tiers[w.tier].views_at(w.extents(index)))
        return index

    def move(self, lease: Lease, index: int) -> list[tuple[int, int]]:
        """Window ``index`` into the lease's slots; returns where it lies."""
        w = lease.window
        if w is None:
            raise InvalidArgument(f"lease {lease.lease_id!r} is not windowed (its payload fits its tier)")
        with lease.lock:
            if lease.ended or w.alloc is None:
                raise LeaseExpired(f"lease {lease.lease_id!r} is gone (expired or released)")
            if not 0 <= index < w.count:
                raise InvalidArgument(f"window {index} of a {w.count}-window sequence")
            if w.reading:
                self._read_window(w, index)
            else:
                if index != w.index + 1:
                    raise InvalidArgument(f"window {index} asked after window {w.index}: a park's windows go in order")
                self._hand_off(w)
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
            self._wait(w)
            self._stage(w, w.index)
        except BaseException:
            w.settle()
            self._free(lease)
            self.disk.stage_abort(m)
            raise
        self._free(lease)
        catalog, ids = self.catalog, [m.seq_id]
        refused: BaseException | None = None
        with catalog.lock:
            try:
                # Every windowed park writes its disk copy at its commit, whatever the write
                # mode: so as under write_through, one such commit of an id at a time, and a
                # refused one undoes exactly its own write (two refused at once under
                # write_back: the second put back the first's manifest, which was gone).
                self.pending.wait(catalog, waits(spec, True), time.monotonic() + PENDING_WAIT_S)
            except BaseException as e:
                refused = e
            else:
                if not spec.overwrite and m.seq_id in catalog:
                    refused = AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
                else:
                    # As in ``commit.py``: the version replaced is deleted after the publish
                    # (``Deletes``), once no read lease reads its disk copy, not in our transaction.
                    replace = None
                    # The commit point: the generation of this version, as for every park kind.
                    final = m.replace(gen=catalog.next_gen(), data_gen=m.key_gen)
                    self.pending.add(ids)
                    # Its lease has ended and it is not indexed yet: counted as committing
                    # until its publish, or its tenant's disk quota would not see it.
                    seq = Seq(manifest=final, on_disk=True)
                    catalog.committing.add(seq)
        if refused is not None:
            # The abort is an LMDB write transaction: never under the index lock, which
            # every call needs (a slow disk would stall the whole daemon behind it).
            self.disk.stage_abort(m)
            raise refused
        try:
            won = self.disk.stage_commit(final, replace, sync=self.write_through)
        except BaseException:
            with catalog.lock:
                catalog.committing.discard(seq)
            owned = False
            try:
                if not self.disk.holds(final):  # the transaction failed (not a sync after it): nothing published
                    self.disk.stage_abort(m)
                else:  # committed, then its fsync failed: refused, so it must not come back at a restart
                    # The version it replaced stays; an undo that failed owns our hold.
                    owned = self.deletes.delete_written(final, refused=True, hold=True)
            finally:
                # Pending until the refusal is undone on disk (the next commit of the id
                # waits for that); released here unless a queued undo owns it.
                if not owned:
                    with catalog.lock:
                        self.pending.done(catalog, ids)
            raise
        failed: KVParkError | None = None
        gone: list[Seq] = []
        with self.catalog.lock:
            self.catalog.committing.discard(seq)  # indexed (or refused) in this same step
            if not won:
                # A newer generation of the id reached the disk first (a flushed overwrite,
                # or one adopted from another daemon). Ours is gone from disk: superseded
                # when a newer version stands in the index, else refused, in either write
                # mode (one that is not standing may yet be refused: acknowledging ours as
                # superseded by it would be a success that never took effect).
                cur = catalog.find(m.seq_id)
                if cur is None or cur.gen < final.gen:
                    self.pending.done(catalog, ids)
                    raise Unavailable(f"park of {m.seq_id!r}: a newer generation of it on disk that no version "
                                      "in the index stands for kept its write out; park it again")
                seq.on_disk, seq.dropped = False, True
                info = self.catalog.info_of([seq], [seq])
            else:
                try:
                    gone = self.catalog.publish_commit(seq, spec, replace)
                    info = self.catalog.info(seq) if not seq.dropped else self.catalog.info_of([seq], [seq])
                except KVParkError as e:  # a concurrent commit or drop changed what we checked
                    # Its manifest replaced the version that stays indexed: undone exactly
                    # (that manifest put back), never a plain delete.
                    failed, seq.dropped, seq.on_disk = e, True, False
            orphans = self.catalog.take_orphans()
            remote = self.mover.remote
            forget = remote.retired(gone) if remote is not None else []
            self.deletes.claim(gone + orphans)  # shared blocks left unreferenced: absent from now on
        owned = False
        try:
            try:
                try:
                    if failed is not None:
                        owned = self.deletes.delete_written(final, refused=True, hold=True)
                finally:
                    self.deletes.delete_all(gone + orphans)
            finally:
                self.disk.settle([final])
                if not owned:
                    with catalog.lock:
                        self.pending.done(catalog, ids)
            if remote is not None:
                # Not the orphaned blocks: other daemons' sequences may use them. Still
                # claimed: the tombstones are on disk before a drop of the id may answer.
                remote.forget(forget)
        finally:
            self.deletes.unclaim(gone + orphans)
        if failed is not None:
            raise failed
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
            seq.add_reader("disk")
            lease.parts.append((seq, "disk"))
        snapshot = ExitStack()
        w: Window | None = None
        try:
            size, buffers = self.size_for(tier), self.buffers_for(tier)
            a = self._alloc(tier, buffers * size)
            # One read transaction for the whole restore: every window comes from the
            # version leased, even if the sequence is dropped or overwritten meanwhile.
            try:
                txn = snapshot.enter_context(self.disk.read_txn())
            except BaseException:
                with self.catalog.lock:
                    self.catalog.free(tier, a)  # not the lease's yet: end_read would not free it
                raise
            w = lease.window = Window(seq.manifest, tier, a, size, buffers, reading=True, seq=seq, txn=txn)

            def end() -> None:
                assert w is not None
                w.settle()  # the read ahead lands before its slots or its snapshot go
                snapshot.close()

            w.on_end = end
            with lease.lock:
                self._read_window(w, 0)
            with self.catalog.lock:
                self.leases.add(lease)
                info = self.catalog.info_of(tops, [seq])
        except BaseException:
            if w is not None:
                w.settle()
            with self.catalog.lock:
                self.leases.end_read(lease)
            snapshot.close()
            raise
        return ReadHandle(info, [Part(seq.manifest, None, "disk", seq)], lease)

    def _read_window(self, w: Window, index: int) -> None:
        """Window ``index`` in its slots, and the next one read ahead into the other
        buffer (the client copies this one meanwhile). REQUIRES: the lease's lock."""
        if self._wait(w) != index:
            self._read(w, index)
        w.index = index
        if w.buffers == 2 and index + 1 < w.count:
            w.pending = self._io.submit(self._read, w, index + 1)

    def _read(self, w: Window, index: int) -> int:
        """Read window ``index`` from the snapshot into its slots, verified."""
        assert w.txn is not None
        m, mem = w.manifest, self.tiers[w.tier]
        first = w.span(index)[0] // self.slot_size
        for j, (off, n) in enumerate(w.extents(index)):
            mem.write(off, w.txn.read_block(m, first + j, n))
        return index
