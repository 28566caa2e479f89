"""The mover's side of the remote tier: sequences read from and copied to Redis.

``remote_tier.py`` is the daemon's policy around the Redis store (miss-safe lookups,
background writes); this module is what the mover does with it: fetch a sequence known
only from remote onto the local disk or into memory (verified by the store), and copy a
sequence to remote (``write_through``). A value that is bad or gone unindexes the
sequence here too.

Locks as in ``mover.py``: ``Seq.move_lock`` serialises the moves of one sequence;
metadata changes happen under the index lock, never held across a Redis call.

Primitives:
- ``fetch_remote_locked(mover, seq)``: bring ``seq`` from remote onto the local disk
  (REQUIRES: ``seq.move_lock`` held).
- ``remote_blocks(mover, seq) -> list[memoryview]``: ``seq``'s blocks from remote, verified.
- ``remote_guard(mover, seq, read) -> T``: run a remote read; NotFound/DataLoss retire ``seq``
  (and delete the local disk copies of the shared blocks that leaves unreferenced).
- ``copy_to_remote(mover, seq)``: copy ``seq`` (from memory, else from disk) to remote.
- ``put_disk_copy(mover, manifest)``: a generation to Redis from its disk records;
  ``end_copy(mover, seq, written) -> bool`` (dropped meanwhile): ends a copy that
  ``RemoteTier.put_begin`` announced (also the disk eviction's, ``disk_evict.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypeVar

from kvpark.proto.errors import DataLoss, NotFound, Unavailable
from kvpark.tiers.disk import Manifest

from .model import Seq

if TYPE_CHECKING:
    from .mover import Mover

T = TypeVar("T")


def fetch_remote_locked(mover: "Mover", seq: Seq) -> None:
    # REQUIRES: seq.move_lock held. The store verifies every chunk; a bad or vanished
    # value unindexes the sequence here too.
    if mover.remote is None:
        return
    with mover.catalog.lock:
        if seq.dropped or seq.res or seq.on_disk or not seq.on_remote:
            return
        if mover.deletes.deleting(seq):
            # Its old disk copy (the same record keys) is being deleted right now.
            raise Unavailable(f"sequence {seq.seq_id!r}: its earlier disk copy is being deleted; retry shortly")
        # A queued delete of its old disk copy (an eviction's that failed, or one a read
        # lease deferred) is ours for the write: the retry must not take what we write.
        own = mover.deletes.take_own(seq)
        # A disk write of it in flight: a pin meanwhile waits for it to land (``Engine.pin``),
        # or the manifest written here would miss that pin.
        mover.catalog.copy_begin(seq)
    m = seq.manifest
    written = False
    try:
        blocks = remote_blocks(mover, seq)
        mover.evict_disk(m.nbytes, exclude=seq)
        written = mover.disk.write(m, blocks, live=lambda: not seq.dropped)
    finally:
        with mover.catalog.lock:
            mover.catalog.copy_end(seq)
            mover.catalog.release_dropped(seq)
            stale = seq.dropped
            if written and not stale:
                seq.on_disk = True
                seq.promotions += 1
                mover.catalog.touch(seq, "disk")  # its place in the disk's eviction order
            mover.deletes.taken_over(own, landed=written and not stale)
            if written and stale:
                mover.cleanups += 1
            mover.catalog.notify()
    if written and stale:
        try:
            mover.deletes.delete_written(m)  # remove what we wrote
        finally:
            mover.cleaned()


def remote_blocks(mover: "Mover", seq: Seq) -> list[memoryview]:
    """``seq``'s blocks, fetched from remote and verified. A value that is bad or gone
    unindexes the sequence here too (the store deleted a bad one from Redis)."""
    assert mover.remote is not None
    m = seq.manifest
    view = memoryview(remote_guard(mover, seq, lambda: mover.remote.fetch(m)))
    blocks, off = [], 0
    for n in m.block_lengths:
        blocks.append(view[off:off + n])
        off += n
    return blocks


def remote_guard(mover: "Mover", seq: Seq, read: Callable[[], T]) -> T:
    """Run a remote read of ``seq``; a value that is bad or gone unindexes it here too."""
    try:
        return read()
    except (NotFound, DataLoss):
        with mover.catalog.lock:
            mine = mover.catalog.find(seq.seq_id) is seq
            if mine:
                mover.catalog.retire(seq)
            orphans = mover.catalog.take_orphans()
            mover.deletes.claim(orphans + ([seq] if mine else []))  # absence waits for these deletes
        # Shared blocks it was the last user of leave the index; those held here lose
        # their disk copies too (memory went with ``retire``). Their remote copies stay:
        # other daemons' sequences may use them.
        mover.delete_all(orphans, claimed=True)  # every one tried; a failure is logged and retried later
        # Its stub (a disk eviction moved it to Redis) would index it again at a restart.
        kept = mine and not mover.remote.unstub([seq.manifest])
        if mine:
            # Its own old disk copy, if an eviction's failed delete left it in LMDB (queued,
            # or taken over by the fetch that met this): the manifest goes before we answer
            # that the sequence is gone, or a crash would bring it back. Failing that, the
            # answer is the disk's error, not NOT_FOUND.
            err = mover.delete_all([seq], claimed=True)
            if err is not None:
                raise err from None
        if kept:
            raise Unavailable(f"sequence {seq.seq_id!r}: its remote copy is gone, and the disk's record that it "
                              "was moved there could not be removed; ask again") from None
        raise


def copy_to_remote(mover: "Mover", seq: Seq) -> None:
    """write_through: copy ``seq`` to remote from memory (its copy pinned meanwhile), else
    from disk; a sequence dropped or overwritten meanwhile has its remote copy deleted."""
    assert mover.remote is not None
    with mover.catalog.lock:
        if seq.dropped or seq.on_remote:
            return
        src = seq.cpu_copy
        if src is None and not seq.on_disk:
            return
        alloc = seq.res[src] if src is not None else None
        if src is not None:
            mover.catalog.copy_begin(seq)  # pins the memory copy while we read it
        mover.remote.put_begin(seq.manifest)  # a drop from here on tombstones it
    m = seq.manifest
    written = False
    try:
        if src is not None:
            assert alloc is not None
            mover.remote.put(m, mover.tiers[src].views(alloc))
        else:
            put_disk_copy(mover, m)
        written = True
    finally:
        if src is not None:
            with mover.catalog.lock:
                mover.catalog.copy_end(seq)
                mover.catalog.release_dropped(seq)
                mover.catalog.notify()
        end_copy(mover, seq, written)


def put_disk_copy(mover: "Mover", m: Manifest) -> None:
    """Write generation ``m`` to Redis from its disk records (verified as they are read)."""
    assert mover.remote is not None
    with mover.disk.read_txn() as r:
        mover.remote.put(m, [r.read_block(m, i, n) for i, n in enumerate(m.block_lengths)])


def end_copy(mover: "Mover", seq: Seq, written: bool) -> bool:
    """End a copy of ``seq`` to Redis that ``RemoteTier.put_begin`` announced: it is known
    there if it was written and is still indexed; one dropped or overwritten meanwhile is
    forgotten again (its drop's delete may have run before the copy landed). Returns
    whether it was dropped meanwhile."""
    assert mover.remote is not None
    m = seq.manifest
    with mover.catalog.lock:
        stale = seq.dropped
        seq.on_remote = written and not stale
        mover.remote.put_end(m)
    if stale:
        mover.remote.forget([m])
    return stale
