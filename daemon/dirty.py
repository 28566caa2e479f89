"""Dirty data under write_back: parked sequences with no disk copy, oldest first.

Under ``policy.write = "write_back"`` a park is acknowledged from memory and reaches the
disk only when it is demoted, or when the daemon stops (the flush). A daemon holding a
million memory-only blocks then took a minute to stop, and a crash lost all of them.
The dirty bounds cap both, as Linux caps dirty page-cache pages: the maintenance pass
writes back (``flush.write_back``) the oldest memory-only sequences past either bound, so
a stop drains at most that much:

- ``policy.max_dirty_s``: a sequence memory-only for longer is written back;
- ``policy.max_dirty_bytes``, ``policy.max_dirty_sequences``: while more than this is
  memory-only, the oldest is written back.

Write-back only fills free disk space (below the disk's low watermark): it never evicts
from the disk to make room, so it never costs a cold disk-only sequence its place.
Under pressure the old rules hold unchanged (demotion, and the flush at stop).

The set is exact: a sequence enters when it is published without a disk copy, or when
it loses its disk copy while it keeps a memory one (disk eviction); it leaves when it
gets a disk copy (any path) or leaves the index. Its age is counted from the moment it
entered (``Seq.dirty_since``; sequences entering within ``SHARE_S`` of each other share
one stamp). Membership is that field; the order is a queue of references, in which a
sequence that left stays as a stale entry until the pass skips it or the queue is
compacted (when stale entries outnumber live ones): about 16 bytes a dirty sequence,
against ~70 for a dict entry and a float. ``clean`` is checked again when a sequence is
picked, as a guard.

Primitives (REQUIRES: index lock, for every call):
- ``Dirty(max_s, max_bytes, max_seqs)``; ``enabled``: any bound set.
- ``track(seq, now)``: ``seq`` is memory-only now (a no-op when it is not, or is tracked).
- ``untrack(seq)``: it got a disk copy, or left the index.
- ``due(now, room, count, nbytes) -> list[Seq]``: take (untrack) the oldest past a bound,
  at most ``count`` sequences and ``nbytes`` in all; one larger than what is left of
  ``room`` is passed over (demotion or the stop's flush writes it), not waited on.
- ``requeue(seqs, now)``: give back those the pass could not write (their age restarts).
- ``over(now) -> bool``: whether the oldest is past a bound.
- ``bytes``, ``sequences``: what is memory-only now.
- ``take_cleaned() -> list[str]``: the ids untracked since the last call (the index's
  freeze pass looks at them again: ``Catalog.freeze_idle``).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from .model import Seq

# Ages are kept to this precision (the maintenance pass runs about once a second).
SHARE_S = 0.05
# The queue is compacted when it holds this many more entries than twice the live ones.
SLACK = 1024


def clean(seq: Seq) -> bool:
    """Nothing to write back: dropped, on disk already, or no memory copy to write from."""
    return seq.dropped or seq.on_disk or not seq.res


class Dirty:
    def __init__(self, max_s: float = 0.0, max_bytes: int = 0, max_seqs: int = 0) -> None:
        self.max_s, self.max_bytes, self.max_seqs = max_s, max_bytes, max_seqs
        self.enabled = max_s > 0 or max_bytes > 0 or max_seqs > 0
        self._q: deque[Seq] = deque()  # age order; entries whose dirty_since is 0 are stale
        self.bytes = 0
        self.sequences = 0
        self._stamp = -1.0
        # Ids that left the set since the index last looked (``take_cleaned``): the index
        # makes rows only of clean records, and looks at these again then.
        self._cleaned: list[str] = []

    def take_cleaned(self) -> list[str]:
        out, self._cleaned = self._cleaned, []
        return out

    def track(self, seq: Seq, now: float) -> None:
        if self.enabled and not seq.dirty_since and not clean(seq):
            if now - self._stamp > SHARE_S:
                self._stamp = now
            seq.dirty_since = max(self._stamp, 1e-9)  # never 0.0, which means "not in the set"
            self._q.append(seq)
            self.bytes += seq.manifest.nbytes
            self.sequences += 1

    def untrack(self, seq: Seq) -> None:
        if seq.dirty_since:
            seq.dirty_since = 0.0
            self.bytes -= seq.manifest.nbytes
            self.sequences -= 1
            self._cleaned.append(seq.seq_id)
            if len(self._q) > 2 * self.sequences + SLACK:
                self._q = deque(s for s in self._q if s.dirty_since)

    def _prune(self) -> None:
        q = self._q
        while q and not q[0].dirty_since:
            q.popleft()

    def _bound(self, now: float, since: float, left: int, nbytes: int) -> bool:
        return ((self.max_s > 0 and now - since >= self.max_s)
                or (self.max_bytes > 0 and nbytes > self.max_bytes)
                or (self.max_seqs > 0 and left > self.max_seqs))

    def over(self, now: float) -> bool:
        self._prune()
        return bool(self._q) and self._bound(now, self._q[0].dirty_since, self.sequences, self.bytes)

    def due(self, now: float, room: int, count: int, nbytes: int) -> list[Seq]:
        self._prune()
        out: list[Seq] = []
        gone: list[Seq] = []
        taken: set[int] = set()  # a sequence that left and came back has two entries
        size, left, left_bytes = 0, self.sequences, self.bytes
        for seq in self._q:
            if len(out) >= count:
                break
            since = seq.dirty_since
            if not since or id(seq) in taken:
                continue  # stale
            n = seq.manifest.nbytes
            if clean(seq):  # a guard: every path that cleans one untracks it
                gone.append(seq)
                taken.add(id(seq))
                left, left_bytes = left - 1, left_bytes - n
                continue
            if not self._bound(now, since, left, left_bytes):
                break
            if size + n > room:
                continue  # no free disk for this one now: younger ones may fit
            if out and size + n > nbytes:
                break
            out.append(seq)
            taken.add(id(seq))
            size += n
            left, left_bytes = left - 1, left_bytes - n  # so the bounds see what is left
        for seq in gone + out:
            self.untrack(seq)
        self._prune()
        return out

    def requeue(self, seqs: Iterable[Seq], now: float) -> None:
        for s in seqs:
            self.track(s, now)
