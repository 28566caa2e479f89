"""Work that waits for a lull in reads and parks: the promotions after disk grants.

A disk grant lets a client read a sequence's records itself; ``policy.promote_on_restore``
then asks for a copy in memory for next time. Run at once, that promotion reads and
copies the same bytes while the client is still reading them, and takes the core and
the memory bandwidth the client's next restores need (``restore_many`` from disk with a
daemon in its own process: docs/BENCHMARKS.md, 2026-12-04). So it waits until no read or
park has started for ``QUIET_S``, or until it has waited ``MAX_WAIT_S`` (a daemon that
is never quiet still promotes, a batch at a time).

Nothing here is needed for correctness: a promotion that never runs leaves the
sequence on disk, where the next restore reads it. So work past ``MAX_QUEUED`` (counted
by weight: the ids a promotion names) drops the oldest, and ``close`` drops whatever has
not started, including the rest of a batch the thread has taken: the engine closes its
tiers right after, and nothing may call into them then.

Primitives:
- ``due(last_busy, oldest, quiet_s, max_wait_s) -> float``: when the oldest queued work
  may run (pure; a time already past: now).
- ``IdleWork(quiet_s, max_wait_s, max_queued)``: ``busy()`` (a read or park started:
  cheap, no lock), ``add(fn, weight=1)`` (run ``fn()`` on this object's thread once due;
  what it raises is logged), ``pending`` (items queued), ``closed``, ``close()`` (returns
  once the item running, if any, has returned, at most ``CLOSE_WAIT_S``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("kvpark.mover")

# Longer than the gap between the restores of one scheduler step (a client copying a
# sequence out, then asking for the next), short enough that the copy for next time is
# there well before a chat's next turn.
QUIET_S = 0.05
MAX_WAIT_S = 1.0
MAX_QUEUED = 1 << 16  # weight (ids) held at once: what one restore_many may name
CLOSE_WAIT_S = 5.0


def due(last_busy: float, oldest: float, quiet_s: float, max_wait_s: float) -> float:
    """When the oldest queued work may run: after ``quiet_s`` without a read or park
    starting, or once it has waited ``max_wait_s``, whichever comes first."""
    return min(last_busy + quiet_s, oldest + max_wait_s)


class IdleWork:
    def __init__(self, quiet_s: float = QUIET_S, max_wait_s: float = MAX_WAIT_S, max_queued: int = MAX_QUEUED) -> None:
        self.quiet_s = quiet_s
        self.max_wait_s = max_wait_s
        self._max = max_queued
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[float, int, Callable[[], None]]] = collections.deque()
        self._weight = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        # Written without the lock on every read and park (a float store is atomic under
        # the GIL); the thread reads it when it wakes, so a late write only delays work.
        self._last_busy = 0.0

    def busy(self) -> None:
        self._last_busy = time.monotonic()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def closed(self) -> bool:
        """Whether ``close`` has been called (nothing queued runs after)."""
        return self._closed

    def add(self, fn: Callable[[], None], weight: int = 1) -> None:
        with self._cond:
            if self._closed:
                return
            weight = max(1, weight)
            self._queue.append((time.monotonic(), weight, fn))
            self._weight += weight
            while self._weight > self._max and len(self._queue) > 1:
                _, w, _ = self._queue.popleft()  # a promotion not made: the sequence stays on disk
                self._weight -= w
                log.debug("idle work: past %d queued, the oldest dropped", self._max)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvpark-idle", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Drop what is queued; the thread ends once the work it is running returns."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._weight = 0
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(CLOSE_WAIT_S)  # the item running checks ``closed`` between its ids

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if not self._queue:
                        self._cond.wait()
                        continue
                    now = time.monotonic()
                    at = due(self._last_busy, self._queue[0][0], self.quiet_s, self.max_wait_s)
                    if at <= now:
                        break
                    self._cond.wait(at - now)
                # Everything queued is due with the oldest; taken one at a time, so a
                # close between two items drops the rest.
                _, w, fn = self._queue.popleft()
                self._weight -= w
            try:
                fn()
            except Exception:  # noqa: BLE001 - one item's failure must not stop the others
                log.exception("idle work failed")
