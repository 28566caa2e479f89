"""The commit side of a park: its commit point, its disk write, its publish.

``Engine.commit`` delegates here (a windowed park goes on to ``window.py``); the engine's
state (index, leases, mover, windows, tiers, disk, remote) is read through the engine
passed in. The rules (``docs/protocol.md``, "Versions and commits"):

- **One commit point.** Every park kind (plain, ``ParkSmall``, Reserve+Commit, a batch,
  windowed) takes its generation under the index lock when it commits, from the one
  source (``Catalog.next_gen``, unique across daemons). A later commit of an id wins an
  overwrite: generations order the index and the disk alike.
- **Exactly one create wins.** A commit holds its ids *pending* from its commit point
  until it has published or failed. A create (no ``overwrite``), and a new block, wait
  for the pending commits of their id and then validate again: so of two creates one
  publishes and the other gets ``AlreadyExists``, and a dedup loser never writes its
  copy of a block over the winner's manifest. An overwrite does not wait: it is ordered
  by its generation.
- **Visible is success.** Once a park is published, a failed delete of the version it
  replaced does not fail the park: the delete is retried by the maintenance pass
  (``deletes.py``); the disk accounting has already let the old version go.

Primitives:
- ``Pending``: ids with a commit between its commit point and its publish (REQUIRES:
  index lock): ``wait(catalog, ids, deadline)``, ``add(ids)``, ``done(catalog,
  ids)``, ``close(catalog)`` (every wait then ends ``Unavailable``: a stop never waits
  out a commit that a failing disk keeps pending).
- ``waits(spec, write_through)``: the ids a commit waits for pending commits of.
- ``commit(engine, lease, expect_nbytes) -> SeqInfo``: a reserved (not windowed) park.
- ``check_disk(seqs, scan, deleting, all_on_disk)``: the index against LMDB, as assertions.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Iterable

from kvpark.proto.errors import KVParkError, ResourceExhausted, Unavailable
from kvpark.proto.types import SeqInfo
from kvpark.tiers.disk import Manifest, Scan, Write

from .catalog import Catalog
from .model import Lease, ParkSpec, Seq

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("kvpark.commit")

# How long a create waits for a pending commit of its id to publish or fail. A pending
# commit only writes to disk (one transaction), so this is a disk that has stopped.
PENDING_WAIT_S = 60.0


class Pending:
    """Ids held by commits between their commit point and their publish."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._closed = False

    def busy(self, ids: Iterable[str]) -> bool:
        return any(i in self._ids for i in ids)

    def wait(self, catalog: Catalog, ids: list[str], deadline: float) -> None:
        """Wait (the index lock released meanwhile) until no commit holds any of ``ids``.
        REQUIRES: index lock; the caller validates again after."""
        while True:
            # Checked after every wake too: a stop that came while we waited ends the wait.
            if self._closed:
                raise Unavailable("daemon is shutting down")
            if not self.busy(ids):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"a concurrent park of {ids[0]!r} did not finish in {PENDING_WAIT_S:.0f} s")
            catalog.changed.wait(min(left, 0.5))

    def close(self, catalog: Catalog) -> None:
        """The engine is closing: waiters give up now (REQUIRES: index lock)."""
        self._closed = True
        catalog.changed.notify_all()

    def add(self, ids: Iterable[str]) -> None:
        for i in ids:
            self._ids[i] = self._ids.get(i, 0) + 1

    def done(self, catalog: Catalog, ids: Iterable[str]) -> None:
        for i in ids:
            n = self._ids.get(i, 0) - 1
            if n > 0:
                self._ids[i] = n
            else:
                self._ids.pop(i, None)
        catalog.changed.notify_all()


def creates(spec: ParkSpec) -> list[str]:
    """The ids a park creates, not overwrites: they wait for pending commits of theirs."""
    own = [spec.seq_id] if not spec.is_batch and not spec.overwrite else []
    return own + [b.seq_id for b in spec.blocks]


def waits(spec: ParkSpec, write_through: bool) -> list[str]:
    """The ids a commit waits for pending commits of before it takes its generation: those
    it creates; under ``write_through``, every id it writes. One commit of an id is on
    disk at a time then, so a commit refused after its transaction (its fsync failing)
    undoes exactly its own write, and no older commit's write of the id ever loses to an
    unanswered newer one and is acknowledged without a copy."""
    if not write_through:
        return creates(spec)
    return ([spec.seq_id] if not spec.is_batch else []) + [b.seq_id for b in spec.blocks]


def commit(engine: "Engine", lease: Lease, expect_nbytes: int | None) -> SeqInfo:
    """Publish a reserved park (the caller took the lease and marked it ended): validate
    and take the generation under the index lock, write disk without it, publish."""
    catalog, pending = engine.catalog, engine.pending
    spec, alloc, tier = lease.spec, lease.alloc, lease.tier
    assert spec is not None and alloc is not None
    held: list[str] = []
    with catalog.lock:
        try:
            engine.check_open()
            pending.wait(catalog, waits(spec, engine.write_through), time.monotonic() + PENDING_WAIT_S)
            blocks, _old = catalog.plan_commit(lease, expect_nbytes, engine.slot_size)
        except BaseException:
            for a in lease.write_allocs():
                catalog.free(tier, a)
            raise
        seq = None
        if spec.is_batch:
            catalog.free(tier, alloc)  # the batch's own (empty) payload
        else:
            catalog.pin_refs(spec.refs)  # the blocks it names stay until it publishes or fails
            seq = Seq(manifest=spec.manifest(catalog.next_gen(), engine.slot_size), res={tier: alloc})
        held = [b.seq_id for b in blocks] + ([spec.seq_id] if seq is not None else [])
        pending.add(held)
        # Neither an open lease nor indexed until its publish: counted as committing
        # meanwhile, or a tenant's next park would be admitted against its quota as if
        # these bytes were not there.
        catalog.committing.update(blocks + ([seq] if seq is not None else []))
        # The version this replaces keeps its disk records through our write: it is deleted
        # after we publish (``Deletes``), once no read lease reads it. Deleting it in our
        # write transaction would pull it from under a restore that leased it meanwhile.
        replace = None
    mine = blocks + ([seq] if seq is not None else [])
    try:
        if engine.write_through:
            engine.mover.evict_disk(sum(s.manifest.nbytes for s in mine), exclude=seq)
            write_through_disk(engine, blocks, seq, replace)
    except BaseException:
        with catalog.lock:
            catalog.committing.difference_update(mine)
            for s in mine:
                for name, a in s.res.items():
                    catalog.free(name, a)
                s.res.clear()
            if seq is not None:
                catalog.unpin_refs(spec.refs)
        # Written and committed, then its fsync failed: the park is refused, so what it
        # wrote must not come back at the next start (nor stay charged to nobody). Our ids
        # stay pending until that is done: the next commit of them waits for it (``waits``).
        free = list(held)
        try:
            for s in mine:
                # An undo that failed is queued and keeps (owns) its id's hold until
                # ``retry`` redoes it; every other id is released here, exactly once.
                if engine.disk.holds(s.manifest) and engine.deletes.delete_written(s.manifest, refused=True, hold=True):
                    free.remove(s.seq_id)
        finally:
            with catalog.lock:
                pending.done(catalog, free)
        hint = engine.remote_down()
        if hint and isinstance(sys.exc_info()[1], ResourceExhausted):
            raise ResourceExhausted(f"{sys.exc_info()[1]}; {hint}") from None  # why eviction could not help
        raise
    failed: KVParkError | None = None
    undo: Manifest | None = None
    with catalog.lock:
        catalog.committing.difference_update(mine)  # indexed (or refused) in this same step
        catalog.publish_blocks(blocks)
        gone: list[Seq] = []
        if seq is None:
            info = SeqInfo(seq_id="", nbytes=sum(b.manifest.nbytes for b in blocks), tier=tier,
                           num_tensors=0, num_blocks=len(blocks))
        else:
            try:
                gone = catalog.publish_commit(seq, spec, replace)
                info = catalog.info(seq) if not seq.dropped else catalog.info_of([seq], [seq])
            except KVParkError as e:  # a concurrent commit or drop changed what we validated
                failed = e
                catalog.unpin_refs(spec.refs)
                seq.dropped = True
                catalog.release_dropped(seq)
                # Written under write_through, its manifest replaced the version that stays
                # indexed: undone exactly (that manifest put back), never a plain delete.
                undo = seq.manifest if seq.on_disk else None
                seq.on_disk = False
        orphans = catalog.take_orphans()
        forget = engine.retire_remote(gone)
        engine.deletes.claim(gone + orphans)  # shared blocks left unreferenced: absent from now on
    free = list(held)
    try:
        try:
            try:
                if undo is not None and engine.deletes.delete_written(undo, refused=True, hold=True):
                    free.remove(undo.seq_id)  # its queued undo owns that hold now
            finally:
                engine.deletes.delete_all(gone + orphans)  # a failure is retried: the park is visible
        finally:
            engine.disk.settle([s.manifest for s in mine])  # nothing of ours is undone from here on
            with catalog.lock:
                pending.done(catalog, free)
        # Still claimed: the replaced versions' tombstones go to disk first, or a drop of the
        # id answered meanwhile, then a crash, would let the restart adopt them from Redis.
        engine.forget_remote(forget)
    finally:
        engine.deletes.unclaim(gone + orphans)
    if failed is not None:
        raise failed
    if engine.remote is not None and engine.remote.write_through:
        engine.mover.copy_to_remote_later(blocks + ([seq] if seq is not None and not seq.dropped else []))
    return info


def write_through_disk(engine: "Engine", blocks: list[Seq], seq: Seq | None, replace: Manifest | None) -> None:
    """Every new sequence of one commit in one transaction, and one fsync.

    No other commit of these ids is under way (``waits``), so a write skipped for a newer
    generation on disk lost to a version adopted from another daemon: acknowledged only
    when that one stands in the index, else the park is refused (never answered without
    a copy on disk)."""
    todo = blocks + ([seq] if seq is not None else [])
    writes = []
    for s in todo:
        name, a = next(iter(s.res.items()))
        writes.append(Write(s.manifest, engine.tiers[name].views(a), replace if s is seq else None))
    done = engine.disk.write_many(writes, sync=True)
    with engine.catalog.lock:
        for s, ok in zip(todo, done):
            s.on_disk = ok
        lost = [s for s, ok in zip(todo, done) if not ok and not _superseded(engine.catalog, s)]
    if lost:
        raise Unavailable(f"park of {lost[0].seq_id!r}: a newer generation of it on disk that no version in "
                          "the index stands for kept its write out; park it again")


def _superseded(catalog: Catalog, s: Seq) -> bool:
    """A newer version of ``s``'s id is published. REQUIRES: index lock."""
    cur = catalog.find(s.seq_id)
    return cur is not None and cur.gen > s.gen


def check_disk(seqs: list[Seq], scan: Scan, deleting: set[tuple[str, int]], all_on_disk: bool) -> None:
    """Assert that the index and LMDB agree. REQUIRES: a quiet engine.

    Each sequence indexed on disk has its manifest, at its generation, and every block
    record; every manifest in LMDB is such a sequence's; every block record belongs to a
    manifest (or to a windowed park under way, or to a version whose delete is queued).
    ``all_on_disk`` (write_through, and the disk has evicted nothing): every sequence
    parked here is on disk.
    """
    indexed = {s.seq_id: s for s in seqs if s.on_disk}
    for s in seqs:
        assert s.on_disk or s.on_remote or not all_on_disk, f"{s.seq_id}: acknowledged under write_through, not on disk"
    for sid, s in indexed.items():
        m = scan.manifests.get(sid)
        assert m is not None, f"{sid}: indexed on disk, no manifest in LMDB"
        assert m.gen == s.gen, f"{sid}: indexed generation {s.gen}, LMDB's manifest {m.gen}"
        have = scan.records.get((sid, m.key_gen), set())
        want = set(range(len(m.block_lengths)))
        assert have == want, f"{sid}: LMDB holds blocks {sorted(have)[:8]} of {len(want)}"
    for sid, m in scan.manifests.items():
        if (sid, m.key_gen) in deleting:
            continue
        assert sid in indexed, f"{sid}: a manifest in LMDB (generation {m.gen}) the index does not hold on disk"
    owned = {(sid, m.key_gen) for sid, m in scan.manifests.items()} | scan.staged | deleting
    stray = [k for k in scan.records if k not in owned]
    assert not stray, f"block records no manifest owns: {stray[:8]}"
