"""Deleting disk copies, totally: every delete of a batch is tried, and a record a
failed delete left on disk is deleted again later.

A drop (or an eviction, or an expiry) that retires a sequence and the shared blocks it
left unreferenced deletes all their disk copies after the index lock. One failed delete
(the disk unwritable for a moment) must not leave the rest undone: their records would
stay on disk, charged to nobody, and come back at the next start. The disk store's
accounting follows the index at once (``DiskStore.delete`` forgets a generation even
when its delete fails); the record itself waits here until a retry deletes it.

Primitives:
- ``Deletes(catalog, disk)``.
- ``delete(seq)``: delete ``seq``'s disk copy if it has one (``on_disk`` cleared under
  the index lock first, so nothing else deletes or reads it as present). A copy a read
  lease still reads is deleted after the lease (``retry``), so the read gets the
  version it leased, never a record missing under it.
- ``delete_all(seqs) -> KVParkError | None``: every one tried; the first failure returned.
- ``delete_written(m, refused=True, hold=True) -> queued``, ``on_undone``: a refused
  write whose undo failed keeps its id pending until ``retry`` undoes it (the queued undo
  owns the hold: exactly one release); a delete of another version of the id deletes
  that refused manifest too.
- ``deleting(seq)``: its generation's delete is under way (REQUIRES: index lock); a
  writer of its disk copy leaves it to a later pass. ``take_own(seq)`` /
  ``taken_over(entries, landed)``: a writer of its disk copy takes its queued deletes
  over for the write (the retry never deletes records written after it looked).
- ``delete_written(m, refused=False)``: the record of a write that lost to a drop or an
  overwrite while it ran, or of a refused park (``refused``: the manifest it replaced is
  put back); a failure is retried.
- ``retry() -> int``: delete again what failed, and what no read lease reads any more
  (the maintenance pass); how many went.
- ``pending``: records waiting for a retry or being retried; ``held()``: which wait
  (REQUIRES: index lock).
- ``claim(seqs)`` (REQUIRES: index lock, in the step that retired them) and
  ``delete_all(seqs, claimed=True)`` or ``unclaim(seqs)``: their ids count as being
  deleted from the moment they leave the index, not only once their delete starts.
- ``settle(seq_ids)``: absence made durable before it is answered. For each id, wait for
  the deletes under way of any version of it (``Unavailable`` past ``SETTLE_WAIT_S``),
  then delete the manifests queued deletes of it may have left in LMDB (``Unavailable``
  if that fails): a crash after the answer never brings a retired version back. O(1)
  for an id with nothing under way or queued (every miss of a prefix lookup asks).
- ``close()``: the stop has begun; waits in ``settle`` end.
- ``adoptable(manifests, deadline)``: adopting remote versions waits for the deletes
  under way of their generations (REQUIRES: index lock). A version adopted again under a
  retired one's generation (the same record keys) keeps its records: no delete of the
  retired one touches them.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvpark.proto.errors import KVParkError, Unavailable
from kvpark.tiers.disk import DiskStore, Manifest

from .catalog import Catalog
from .model import Seq

log = logging.getLogger("kvpark.mover")

# How long an answer of absence waits for a delete under way of a version of that id
# (one LMDB transaction: only a stalled disk takes this long) before UNAVAILABLE.
SETTLE_WAIT_S = 10.0


class Deletes:
    def __init__(self, catalog: Catalog, disk: DiskStore) -> None:
        self.catalog = catalog
        self.disk = disk
        # (id, generation) of the deletes under way. Adopting a version from the remote
        # tier waits for its own (``adoptable``): a version adopted again under a retired
        # one's generation (its twin: the same record keys) is then never deleted by the
        # retired one's delete, which checks for a twin first. REQUIRES: index lock.
        self._busy: dict[tuple[str, int], int] = {}  # how many deletes of each are under way
        # Per id, per generation: deletes under way (``_begin``). ``settle`` waits while an
        # id has any whose manifest is not known gone. REQUIRES: index lock.
        self._ids_busy: dict[str, dict[int, int]] = {}
        # Per id: versions retired and claimed (``claim``) whose retiring call has not
        # finished making their absence durable (its deletes, a drop's remote tombstones).
        # ``settle`` waits while an id has any, whatever it already deleted. REQUIRES:
        # index lock.
        self._ids_claimed: dict[str, int] = {}
        # Per id: entries of ``_undeleted``; ``settle`` looks at an id's entries only when
        # it has some. REQUIRES: index lock.
        self._ids_queued: dict[str, int] = {}
        # (id, generation) of queued or busy deletes whose manifest is known gone from LMDB
        # (an unpublish of it landed): ``settle`` neither waits for them nor unpublishes
        # again. A conservative hint: an entry queued afresh after a failure, or a version
        # adopted again, clears its key; a key neither queued nor busy leaves. REQUIRES:
        # index lock.
        self._gone: set[tuple[str, int]] = set()
        # Records still to delete: failed deletes (no Seq), and retired copies a read lease
        # still reads (their Seq: deleted once its disk readers are gone). REQUIRES: index lock.
        self._undeleted: list[tuple[Manifest, Seq | None]] = []
        # How many entries of ``_undeleted`` each (id, generation) has: a drop asks on its
        # hot path (``_queued``), so not a scan. REQUIRES: index lock.
        self._queued_n: dict[tuple[str, int], int] = {}
        # The same, for entries with their Seq, by its identity (``take_own``; each entry
        # holds its Seq, so the identity is not reused while queued). REQUIRES: index lock.
        self._queued_seqs: dict[int, int] = {}
        # Queued deletes a writer has taken over for its write (``take_own``), by (id,
        # generation): still queued for a drop (``_queued``), which must delete the manifest
        # they left in LMDB before it answers. REQUIRES: index lock.
        self._taken: dict[tuple[str, int], int] = {}
        # Queued undos of refused writes whose first try failed: (id, generation) -> the
        # manifest to put back (``DiskStore.revert``), so the retry is the same undo and
        # never a plain delete of the manifest. REQUIRES: index lock.
        self._reverts: dict[tuple[str, int], tuple[Manifest, Manifest | None, bool]] = {}
        # Called (index lock held) with the ids whose queued undo went through: the commit
        # that was refused kept them pending until then (``commit.py``), so nothing else
        # of the id touches the disk while a refused manifest may still be current.
        self.on_undone: Callable[[list[str]], None] | None = None
        # Records a ``retry`` took out of ``_undeleted`` and is deleting now: still
        # pending, so a caller waiting for ``pending == 0`` waits for their delete too.
        # REQUIRES: index lock.
        self._retrying = 0
        # The daemon is stopping: a ``settle`` waiting for a delete gives up (UNAVAILABLE),
        # so its handler leaves before the stop's grace runs out. REQUIRES: index lock.
        self._closed = False

    def delete(self, seq: Seq) -> None:
        """Delete ``seq``'s disk copy; raises the disk's typed error when that fails (the
        records are then queued for ``retry``, or left to the lease or the write that
        holds them)."""
        m = seq.manifest
        with self.catalog.lock:
            # A refused write of this id whose undo failed may still own the current
            # manifest: it goes with this delete, before the caller answers (its records
            # go with the queued undo), or a crash would show the refused bytes.
            refused = [e[0] for (sid, g), e in self._reverts.items() if sid == seq.seq_id and g != seq.gen]
        try:
            self._delete(seq, m)
        finally:
            for rm in refused:
                self.disk.unpublish(rm)  # generation-exact; a failure is the caller's answer

    def _delete(self, seq: Seq, m: Manifest) -> None:
        with self.catalog.lock:
            # Another record of this generation (adopted again from the remote tier after
            # this one was retired): the records are shared with it. Never the sequence
            # itself: a disk eviction of a live sequence deletes its records now (its
            # rewrite waits for that: ``deleting``).
            twin = self._twin(m)
            twin = None if twin is seq else twin
            if not seq.on_disk:
                # Not on disk for the index, but a retired version's write may be under
                # way (its generation held): that write either sees the retirement inside
                # its transaction (``Write.live``) or published before we looked, and then
                # its manifest goes now, before the drop is acknowledged, not after the
                # write's own ``delete_written`` (a crash in between would bring it back).
                # Or a delete of its disk copy (an eviction) failed, or is under way, or is
                # being retried: its manifest may still be in LMDB, and goes now for the
                # same reason.
                if not seq.dropped or twin is not None or not (
                        self.disk.holds(m) or self._queued(m) or (m.seq_id, m.gen) in self._busy):
                    return
                how = "unpublish"
            else:
                seq.on_disk = False
                self.catalog.dirty.track(seq, time.monotonic())  # a disk eviction of a copy also in memory
                how = "delete"
                if seq.readers.get("disk") or twin is not None:
                    # A read lease reads this copy (a restore served from disk that an
                    # overwrite or drop retired after it leased): it reads the version it
                    # leased, and the records go once the lease is over (``retry``).
                    self._later(m, seq)
                    if twin is not None:
                        return  # the manifest on disk is the twin's version too: it stays
                    how = "unpublish"
            self._begin([m])
        try:
            if how == "delete":
                self.disk.delete(m)
            else:
                # The manifest goes now, in its own transaction, the records later (the
                # lease's ``retry``, or the write's ``delete_written``): a crash in between
                # never indexes the version again, and the next start sweeps the records.
                # A failure is the drop's answer (UNAVAILABLE): the manifest then goes with
                # those records.
                self.disk.unpublish(m)
                with self.catalog.lock:
                    self._unpublished([m])
        except Exception:  # typed or not: what failed stays queued, never forgotten
            with self.catalog.lock:
                if how == "delete":
                    self._enqueue([(m, seq)])
                elif not self._queued(m):
                    # A write's manifest (its ``delete_written`` comes later): queued too,
                    # so until a retry or a ``settle`` deletes it nobody is told the id is
                    # gone while its manifest is still in LMDB.
                    self._enqueue([(m, None)])
            raise
        finally:
            self._done([m])

    def deleting(self, seq: Seq) -> bool:
        """Whether ``seq``'s generation is being deleted from disk now: a writer of its disk
        copy (the same record keys) waits for a later pass. REQUIRES: index lock."""
        return (seq.seq_id, seq.gen) in self._busy

    def take_own(self, seq: Seq) -> list[tuple[Manifest, Seq | None]]:
        """Take ``seq``'s own queued deletes out of the queue (a disk eviction of it whose
        delete failed, or one a read lease deferred): a writer about to write its disk
        copy again, under the same record keys, takes them over, so no ``retry`` deletes
        the records it writes between its check and its transaction. Hand them back with
        ``taken_over``. REQUIRES: index lock (and not ``deleting(seq)``)."""
        if id(seq) not in self._queued_seqs:
            return []
        mine = [e for e in self._undeleted if e[1] is seq]
        self._undeleted = [e for e in self._undeleted if e[1] is not seq]
        for m, s in mine:
            key = (m.seq_id, m.gen)
            _uncount(self._queued_n, key)
            _uncount(self._queued_seqs, id(s))
            _uncount(self._ids_queued, m.seq_id)
            self._taken[key] = self._taken.get(key, 0) + 1
        return mine

    def taken_over(self, entries: list[tuple[Manifest, Seq | None]], landed: bool) -> None:
        """The write that took ``entries`` over (``take_own``) is over: ``landed``, its
        records are the sequence's own disk copy now (kept no more); else queued again.
        REQUIRES: index lock."""
        for m, _ in entries:
            _uncount(self._taken, (m.seq_id, m.gen))
        if landed:
            for m, _ in entries:
                self.disk.unkeep(m)
        else:
            self._enqueue(entries, fresh=False)  # the write published nothing of them

    def claim(self, seqs: list[Seq]) -> None:
        """Count ``seqs`` (just retired, in this lock step) as being deleted until
        ``delete_all(seqs, claimed=True)`` has tried each: an answer of absence for their
        ids waits from the moment they left the index. REQUIRES: index lock."""
        for s in seqs:
            self._ids_claimed[s.seq_id] = self._ids_claimed.get(s.seq_id, 0) + 1

    def unclaim(self, seqs: list[Seq]) -> None:
        """End the claims ``claim(seqs)`` took (a caller that deletes with
        ``delete_all(seqs)`` and has more to make durable before absence may be answered:
        a drop's remote tombstones)."""
        with self.catalog.lock:
            for s in seqs:
                _uncount(self._ids_claimed, s.seq_id)
            self.catalog.changed.notify_all()

    def delete_all(self, seqs: list[Seq], claimed: bool = False) -> KVParkError | None:
        first: KVParkError | None = None
        for s in seqs:
            try:
                self.delete(s)
            except Exception as e:  # noqa: BLE001 (every one is tried; an untyped failure too)
                log.warning("delete of %r from disk failed (retried later): %s", s.seq_id, e,
                            exc_info=not isinstance(e, KVParkError))
                first = first or (e if isinstance(e, KVParkError) else
                                  Unavailable(f"the disk delete of {s.seq_id!r} failed: {e}"))
            finally:
                if claimed:
                    self.unclaim([s])
        return first

    def settle(self, seq_ids: list[str]) -> None:
        """Make the absence of these ids durable before a caller answers it (a drop that
        found nothing or just dropped, ``present`` False, NOT_FOUND): wait for the deletes
        under way of any version of each, then unpublish what queued deletes of it may
        have left in LMDB (generation-exact: never a newer version's manifest, never a
        twin's). ``Unavailable`` when the wait runs out or an unpublish fails: the id may
        still come back at a crash, so absence is not the answer yet. Call without the
        index lock."""
        with self.catalog.lock:
            ids = [sid for sid in dict.fromkeys(seq_ids)
                   if sid in self._ids_busy or sid in self._ids_queued or sid in self._ids_claimed]
        if not ids:
            return
        deadline = time.monotonic() + SETTLE_WAIT_S
        for sid in ids:
            while True:
                with self.catalog.lock:
                    while sid in self._ids_claimed or self._unsettled_busy(sid):
                        if self._closed:
                            raise Unavailable(f"sequence {sid!r}: the daemon is stopping; ask again")
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise Unavailable(f"sequence {sid!r}: the delete of a retired version of it has not "
                                              f"landed in {SETTLE_WAIT_S:.0f} s; ask again")
                        self.catalog.changed.wait(left)
                    # Not a twin's manifest (adopted again under that generation), and not a
                    # refused write's while the id is indexed: its queued undo puts the
                    # version that stands back (``revert``), which an unpublish would defeat.
                    indexed = self.catalog.find(sid) is not None
                    todo = list({(m.seq_id, m.gen): m for m, _ in self._undeleted
                                 if m.seq_id == sid and (sid, m.gen) not in self._gone and self._twin(m) is None
                                 and not (indexed and (sid, m.gen) in self._reverts)}.values()
                                ) if sid in self._ids_queued else []
                    if not todo:
                        break
                    self._begin(todo)  # a writer or an adoption of the generation waits for it
                try:
                    for m in todo:
                        self.disk.unpublish(m)
                except Exception as e:  # noqa: BLE001 (typed or not: not durable yet, ask again)
                    raise Unavailable(f"sequence {sid!r}: the manifest of a retired version of it could not be "
                                      f"deleted yet ({e}); ask again") from None
                else:
                    with self.catalog.lock:
                        self._unpublished(todo)
                finally:
                    self._done(todo)

    def close(self) -> None:
        """The stop has begun: ``settle`` waits end (UNAVAILABLE). REQUIRES: index lock."""
        self._closed = True
        self.catalog.changed.notify_all()

    def _unpublished(self, ms: list[Manifest]) -> None:
        """These generations' manifests are gone from LMDB: their queued entries and
        deletes under way, if any, hold no ``settle`` up. REQUIRES: index lock."""
        for m in ms:
            key = (m.seq_id, m.gen)
            if key in self._queued_n or m.gen in self._ids_busy.get(m.seq_id, ()):
                self._gone.add(key)

    def _unsettled_busy(self, sid: str) -> bool:
        """A delete of a version of ``sid`` is under way whose manifest may still be in
        LMDB. REQUIRES: index lock."""
        return any((sid, g) not in self._gone for g in self._ids_busy.get(sid, ()))

    def _busy_add(self, sid: str, gen: int) -> None:
        gens = self._ids_busy.setdefault(sid, {})
        gens[gen] = gens.get(gen, 0) + 1

    def _busy_sub(self, sid: str, gen: int) -> None:
        """REQUIRES: index lock. A generation neither busy nor queued drops its gone mark."""
        gens = self._ids_busy.get(sid)
        if gens is None:
            return
        _uncount(gens, gen)
        if not gens:
            del self._ids_busy[sid]
        if gen not in gens and (sid, gen) not in self._queued_n:
            self._gone.discard((sid, gen))

    def delete_written(self, m: Manifest, refused: bool = False, hold: bool = False) -> bool:
        """Delete a record just written for a version retired meanwhile (a demotion, a
        flush or a fetch that lost to a drop or an overwrite). Nobody reads it: it was
        never on disk for the index. A delete that fails is retried, never left behind.
        ``refused``: a park whose write committed and whose fsync or publish failed: undone
        (``DiskStore.revert``: the manifest its transaction replaced is put back). Returns
        True when that undo failed and was queued; with ``hold``, the queued undo then owns
        the commit's pending hold of the id and releases it (``on_undone``) once ``retry``
        has undone it: exactly one of the two releases it."""
        with self.catalog.lock:
            if self._twin(m) is not None:
                self._later(m, None)
                return False
            self._begin([m])
            previous = self.disk.take_replaced(m) if refused else None
            pinned = self._pin_of(previous)
        try:
            if refused:
                self.disk.revert(m, previous, pinned=pinned)
            else:
                self.disk.delete(m)
            return False
        except Exception as e:  # noqa: BLE001 (any failure: the undo must not be lost)
            log.warning("delete of %r from disk failed (retried later): %s", m.seq_id, e,
                        exc_info=not isinstance(e, KVParkError))
            with self.catalog.lock:
                if refused:
                    self._reverts[(m.seq_id, m.gen)] = (m, previous, hold)  # retried as the same undo
                self._enqueue([(m, None)])
            return refused
        finally:
            self._done([m])

    def _undone(self, m: Manifest) -> None:
        """A queued undo is over (done, or its records are another version's now): release
        the hold it owns. REQUIRES: index lock."""
        entry = self._reverts.pop((m.seq_id, m.gen), None)
        if entry is not None and entry[2] and self.on_undone is not None:
            self.on_undone([m.seq_id])

    def retry(self) -> int:
        with self.catalog.lock:
            todo, keep = [], []
            for m, s in self._undeleted:
                cur = self._twin(m)  # the indexed version of this generation, if any
                if cur is not None and cur.on_disk:
                    self.disk.unkeep(m)  # written again (same keys): the records are its own now
                    self._undone(m)
                    continue
                # Kept: records a read lease still reads, or those a twin adopted again from
                # the remote tier may need. The live version itself, not on disk (a failed
                # eviction delete), is no twin: its records go now.
                twin = cur if cur is not s else None
                (keep if twin is not None or s is not None and s.readers.get("disk") else todo).append((m, s))
            self._undeleted = []
            self._queued_n.clear()
            self._queued_seqs.clear()
            self._ids_queued.clear()
            self._enqueue(keep, fresh=False)
            self._begin([m for m, _ in todo])
            self._retrying += len(todo)
        try:
            for i, (m, _) in enumerate(todo):
                try:
                    key = (m.seq_id, m.gen)
                    if key in self._reverts:  # a refused write: undone, its replaced manifest back
                        with self.catalog.lock:
                            previous = self._reverts[key][1]
                            pinned = self._pin_of(previous)
                        self.disk.revert(m, previous, pinned=pinned)
                        with self.catalog.lock:
                            self._undone(m)
                    else:
                        self.disk.delete(m)  # generation-exact: never touches a newer version of the id
                except Exception as e:  # noqa: BLE001 (any failure: what is left stays queued)
                    log.warning("delete of %r from disk failed again: %s", m.seq_id, e,
                                exc_info=not isinstance(e, KVParkError))
                    with self.catalog.lock:
                        self._enqueue(todo[i:], fresh=False)
                    return i
            return len(todo)
        finally:
            with self.catalog.lock:
                self._retrying -= len(todo)
                # Marks of generations no longer queued nor busy go.
                self._gone = {k for k in self._gone if k in self._queued_n or k[1] in self._ids_busy.get(k[0], ())}
            self._done([m for m, _ in todo])

    def adoptable(self, manifests: list[Manifest], deadline: float) -> None:
        """Wait (until ``deadline``, ``time.monotonic``) for the deletes under way of the
        generations about to be adopted. REQUIRES: index lock (released while waiting)."""
        while any((m.seq_id, m.gen) in self._busy for m in manifests):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.catalog.changed.wait(left)
        for m in manifests:  # adopted again under that generation: its manifest may come back
            self._gone.discard((m.seq_id, m.gen))

    def _begin(self, ms: list[Manifest]) -> None:
        """Count deletes of these generations as under way. REQUIRES: index lock."""
        for m in ms:
            key = (m.seq_id, m.gen)
            self._busy[key] = self._busy.get(key, 0) + 1
            self._busy_add(m.seq_id, m.gen)

    def _done(self, ms: list[Manifest]) -> None:
        with self.catalog.lock:
            for m in ms:
                _uncount(self._busy, (m.seq_id, m.gen))
                self._busy_sub(m.seq_id, m.gen)
            self.catalog.changed.notify_all()

    def _queued(self, m: Manifest) -> bool:
        """A delete of ``m``'s generation waits in the queue (it failed once, or a lease
        reads the copy), or a writer has taken it over for its write. REQUIRES: index lock."""
        key = (m.seq_id, m.gen)
        return key in self._queued_n or key in self._taken

    def _enqueue(self, entries: list[tuple[Manifest, Seq | None]], fresh: bool = True) -> None:
        """Queue records for ``retry``. ``fresh``: queued after a failure, so their
        manifests may be in LMDB (``settle`` looks); else queued again as they were.
        REQUIRES: index lock."""
        for m, s in entries:
            self._undeleted.append((m, s))
            key = (m.seq_id, m.gen)
            self._queued_n[key] = self._queued_n.get(key, 0) + 1
            self._ids_queued[m.seq_id] = self._ids_queued.get(m.seq_id, 0) + 1
            if fresh:
                self._gone.discard(key)
            if s is not None:
                self._queued_seqs[id(s)] = self._queued_seqs.get(id(s), 0) + 1

    def _pin_of(self, previous: Manifest | None) -> Callable[[], bool] | None:
        """The pin of ``previous``'s generation as the index has it when an undo puts that
        manifest back (asked inside the undo's transaction: a pin acknowledged while the
        refused manifest was current wrote nothing to disk). REQUIRES: index lock."""
        cur = self.catalog.find(previous.seq_id) if previous is not None else None
        if cur is None or previous is None or cur.gen != previous.gen:
            return None
        return lambda: cur.manifest.pinned  # attribute reads: no lock inside the transaction

    def _twin(self, m: Manifest) -> Seq | None:
        """The indexed version of ``m``'s id if it has ``m``'s generation (adopted again
        from the remote tier after ``m``'s version was retired here). REQUIRES: index lock."""
        cur = self.catalog.find(m.seq_id)
        return cur if cur is not None and cur.gen == m.gen else None

    def _later(self, m: Manifest, seq: Seq | None) -> None:
        """Delete ``m``'s records at a later ``retry``. REQUIRES: index lock."""
        twin = self._twin(m)
        if twin is not None and twin is not seq and twin.on_disk:
            return  # its twin wrote them again: records and charge are the twin's
        self._enqueue([(m, seq)])
        # The accounting follows the index now; a reader's records are kept from the
        # orphan sweep in the same step (never a moment neither held nor kept).
        self.disk.release(m, keep=seq is not None and bool(seq.readers.get("disk")))

    def held(self) -> set[tuple[str, int]]:
        """(id, key generation) of the records waiting for a retry or for their readers
        (``check_invariants`` allows them on disk). REQUIRES: index lock."""
        return {(m.seq_id, m.key_gen) for m, _ in self._undeleted}

    @property
    def pending(self) -> int:
        """Records waiting for a retry, and those a retry is deleting now."""
        with self.catalog.lock:
            return len(self._undeleted) + self._retrying


def _uncount(counts: dict, key: object) -> None:
    """One fewer of ``key`` in ``counts``; a count that reaches 0 leaves the dict (a
    membership test is the question asked of these). REQUIRES: the index lock."""
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
