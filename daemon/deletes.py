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
- ``delete_written(m)``: the record of a write that lost to a drop or an overwrite
  while it ran; a failure is retried.
- ``retry() -> int``: delete again what failed, and what no read lease reads any more
  (the maintenance pass); how many went.
- ``pending``: records waiting for a retry; ``held()``: which (REQUIRES: index lock).
"""

from __future__ import annotations

import logging

from kvpark.proto.errors import KVParkError
from kvpark.tiers.disk import DiskStore, Manifest

from .catalog import Catalog
from .model import Seq

log = logging.getLogger("kvpark.mover")


class Deletes:
    def __init__(self, catalog: Catalog, disk: DiskStore) -> None:
        self.catalog = catalog
        self.disk = disk
        # Records still to delete: failed deletes (no Seq), and retired copies a read lease
        # still reads (their Seq: deleted once its disk readers are gone). REQUIRES: index lock.
        self._undeleted: list[tuple[Manifest, Seq | None]] = []

    def delete(self, seq: Seq) -> None:
        with self.catalog.lock:
            if not seq.on_disk:
                return
            seq.on_disk = False
            if seq.readers.get("disk"):
                # A read lease reads this copy (a restore served from disk that an
                # overwrite or drop retired after it leased): it reads the version it
                # leased. The record goes once the lease is over (``retry``); the
                # accounting lets go now, as it follows the index.
                self._undeleted.append((seq.manifest, seq))
                self.disk.release(seq.manifest)
                return
        self.disk.delete(seq.manifest)

    def delete_all(self, seqs: list[Seq]) -> KVParkError | None:
        first: KVParkError | None = None
        for s in seqs:
            try:
                self.delete(s)
            except KVParkError as e:
                log.warning("delete of %r from disk failed (retried later): %s", s.seq_id, e)
                with self.catalog.lock:
                    self._undeleted.append((s.manifest, None))
                first = first or e
        return first

    def delete_written(self, m: Manifest) -> None:
        """Delete a record just written for a version retired meanwhile (a demotion, a
        flush or a fetch that lost to a drop or an overwrite). Nobody reads it: it was
        never on disk for the index. A delete that fails is retried, never left behind."""
        try:
            self.disk.delete(m)
        except KVParkError as e:
            log.warning("delete of %r from disk failed (retried later): %s", m.seq_id, e)
            with self.catalog.lock:
                self._undeleted.append((m, None))

    def retry(self) -> int:
        with self.catalog.lock:
            todo = [(m, s) for m, s in self._undeleted if s is None or not s.readers.get("disk")]
            self._undeleted = [(m, s) for m, s in self._undeleted if s is not None and s.readers.get("disk")]
        for i, (m, _) in enumerate(todo):
            try:
                self.disk.delete(m)  # generation-exact: never touches a newer version of the id
            except KVParkError as e:
                log.warning("delete of %r from disk failed again: %s", m.seq_id, e)
                with self.catalog.lock:
                    self._undeleted.extend((m, None) for m, _ in todo[i:])
                return i
        return len(todo)

    def held(self) -> set[tuple[str, int]]:
        """(id, key generation) of the records waiting for a retry or for their readers
        (``check_invariants`` allows them on disk). REQUIRES: index lock."""
        return {(m.seq_id, m.key_gen) for m, _ in self._undeleted}

    @property
    def pending(self) -> int:
        with self.catalog.lock:
            return len(self._undeleted)
