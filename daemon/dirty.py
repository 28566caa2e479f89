"""Dirty data under write_back: parked sequences with no disk copy yet, oldest first.

Under ``policy.write = "write_back"`` a park is acknowledged from memory and reaches the
disk only when it is demoted, or when the daemon stops (the flush). A daemon holding a
million memory-only blocks then took a minute to stop, and a crash lost all of them.
The dirty bounds cap both, as Linux caps dirty page-cache pages: the maintenance pass
writes back (``flush.write_back``) the oldest memory-only sequences past either bound, so
a stop drains at most that much:

- ``policy.max_dirty_s``: a sequence memory-only for longer is written back;
- ``policy.max_dirty_bytes``, ``policy.max_dirty_sequences``: while more than this is
  memory-only, the oldest is written back.

Write-back only fills free disk space (below the disk's high watermark): it never evicts
from the disk to make room, so it never costs a cold disk-only sequence its place.
Under pressure the old rules hold unchanged (demotion, and the flush at stop).

The queue is in publish order. A sequence that gets its disk copy some other way (a
demotion, a flush) or is dropped stays counted until the pass reaches it and lets it go:
the counts can run high, never low, so a bound is never missed, and the pass moves on
from such an entry without writing anything.

Primitives (REQUIRES: index lock, for every call):
- ``Dirty(max_s, max_bytes, max_seqs)``; ``enabled``: any bound set.
- ``track(seq)``: a newly published sequence with no disk copy.
- ``due(now, room, count, nbytes) -> list[Seq]``: take the oldest that are past a bound,
  at most ``count`` sequences and ``nbytes`` (and never more than ``room``) in all.
- ``requeue(seqs)``: give back those the pass could not write, at the front, in order.
- ``over(now) -> bool``: whether the oldest memory-only sequence is past a bound.
- ``bytes``, ``sequences``: what is counted dirty now.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from .model import Seq


def clean(seq: Seq) -> bool:
    """Nothing to write back: dropped, on disk already, or no memory copy to write from."""
    return seq.dropped or seq.on_disk or not seq.res


class Dirty:
    def __init__(self, max_s: float = 0.0, max_bytes: int = 0, max_seqs: int = 0) -> None:
        self.max_s, self.max_bytes, self.max_seqs = max_s, max_bytes, max_seqs
        self.enabled = max_s > 0 or max_bytes > 0 or max_seqs > 0
        self._q: deque[Seq] = deque()
        self.bytes = 0

    @property
    def sequences(self) -> int:
        return len(self._q)

    def track(self, seq: Seq) -> None:
        if self.enabled and not clean(seq):
            self._q.append(seq)
            self.bytes += seq.manifest.nbytes

    def _over(self, now: float, seq: Seq) -> bool:
        return ((self.max_s > 0 and now - seq.manifest.created_at >= self.max_s)
                or (self.max_bytes > 0 and self.bytes > self.max_bytes)
                or (self.max_seqs > 0 and len(self._q) > self.max_seqs))

    def over(self, now: float) -> bool:
        q = self._q
        while q and clean(q[0]):
            self.bytes -= q.popleft().manifest.nbytes
        return bool(q) and self._over(now, q[0])

    def due(self, now: float, room: int, count: int, nbytes: int) -> list[Seq]:
        out: list[Seq] = []
        size = 0
        q = self._q
        while q and len(out) < count:
            s = q[0]
            n = s.manifest.nbytes
            if clean(s):
                q.popleft()
                self.bytes -= n
                continue
            if not self._over(now, s) or size + n > room or (out and size + n > nbytes):
                break
            q.popleft()
            self.bytes -= n
            out.append(s)
            size += n
        return out

    def requeue(self, seqs: Iterable[Seq]) -> None:
        for s in reversed(list(seqs)):
            if not clean(s):
                self._q.appendleft(s)
                self.bytes += s.manifest.nbytes
