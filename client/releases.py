"""Read leases a restore has finished with, whose Release is not waited for.

A shm restore whose copies landed well before its lease's deadline needs no answer from
its Release (``transport._usable_until``: the lease cannot have been reaped under the
copy). Waiting for one anyway is a round trip per restore, about as long as the
``Acquire``. So the lease id is handed here instead, and it ends at the daemon by
whichever comes first:

- the next ``Acquire`` or ``Reserve`` on this connection carries it (``take()``): the
  daemon ends it before that call's own work, in the same round trip;
- any other unary call on this connection sends it first (``flush()``), so what a caller
  asks after a restore (``stat``, ``drop``, a quota check) finds the lease ended, as if
  the restore had waited;
- a background thread sends it once it has waited ``DELAY_S`` (a client that goes idle
  after a restore holds its lease that much longer, not until the TTL);
- ``close()`` sends what is left.

A release that fails (a daemon gone or slow) is not retried: the lease's TTL frees it.
The thread ends after ``IDLE_EXIT_S`` with nothing to send (the next ``add`` starts
another), so a client that is never closed is not kept alive by it.

Primitives:
- ``Releases(send)``: ``send(lease_id, until)`` makes one Release call, waiting for its
  answer at most until ``until`` (``time.monotonic()``); what it raises is dropped.
- ``add(lease_id)``; ``take() -> list[str]``: up to ``MAX_CARRIED`` ids for a call that
  carries them; ``put_back(ids)``: a carrying call that may not have reached the daemon;
  ``flush(limit)``: send what is pending and wait for the releases being sent, all
  within ``limit`` seconds; ``wait_sent(limit)``: only the latter (a carrying call must
  not overtake a release already on its way); ``pending``: how many are not yet sent;
  ``sending``: how many are being sent; ``close(limit)``: flush, and send any added
  later at once.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from kvpark.proto.errors import KVParkError

# How long a finished lease waits for a call to carry it before the thread sends it: well
# above the gap between the restores of one scheduler step, well below anything a
# tier's watermark or a tenant's quota would notice.
DELAY_S = 0.02
# The most releases one call carries (the daemon refuses more).
MAX_CARRIED = 64
# How long the thread waits with nothing to send before it ends.
IDLE_EXIT_S = 1.0
# The bound on one batch of releases the thread sends.
SEND_S = 5.0


class Releases:
    def __init__(self, send: Callable[[str, float], None]) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._pending: list[tuple[str, float]] = []  # (lease id, when it was added)
        self._sending = 0  # releases the thread or a flush is sending right now
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits for a first pending release (else it sleeps on a timer)
        self._closed = False

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def sending(self) -> int:
        return self._sending

    def add(self, lease_id: str) -> None:
        with self._cond:
            closed = self._closed
            if not closed:
                self._pending.append((lease_id, time.monotonic()))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvpark-releases", daemon=True)
                    self._thread.start()
                elif self._idle:
                    # Only an idle thread is woken: one on its timer finds this one then, so
                    # restores in a row cost it one wake-up per DELAY_S, not one each.
                    self._cond.notify_all()
        if closed:
            self._quietly([lease_id], time.monotonic() + SEND_S)

    def take(self) -> list[str]:
        if not self._pending:  # one read, no lock: the common case has nothing to carry
            return []
        with self._cond:
            ids = [lid for lid, _ in self._pending[:MAX_CARRIED]]
            del self._pending[:MAX_CARRIED]
            return ids

    def put_back(self, ids: list[str]) -> None:
        """Ids a carrying call took whose call failed before the daemon surely saw them:
        sent again (ending a lease twice is harmless: the second finds it gone)."""
        if not ids:
            return
        with self._cond:
            closed = self._closed
            if not closed:
                now = time.monotonic()
                self._pending[:0] = [(lid, now) for lid in ids]
                self._cond.notify_all()
        if closed:
            self._quietly(ids, time.monotonic() + SEND_S)

    def flush(self, limit: float) -> None:
        end = time.monotonic() + limit
        if self._pending:
            with self._cond:
                ids = [lid for lid, _ in self._pending]
                self._pending.clear()
                self._sending += len(ids)
            try:
                self._quietly(ids, end)
            finally:
                with self._cond:
                    self._sending -= len(ids)
                    self._cond.notify_all()
        self._wait_sent(end)

    def wait_sent(self, limit: float) -> None:
        self._wait_sent(time.monotonic() + limit)

    def _wait_sent(self, end: float) -> None:
        if self._sending:
            with self._cond:
                # The sends under way (the thread's, another caller's flush): a caller's
                # next call must find them done.
                while self._sending and (left := end - time.monotonic()) > 0:
                    self._cond.wait(left)

    def close(self, limit: float) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.flush(limit)

    def _quietly(self, ids: list[str], until: float) -> None:
        for lid in ids:
            try:
                self._send(lid, until)
            except (KVParkError, ValueError):
                pass  # the daemon is gone or slow, or the channel closed: the lease's TTL frees it

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle = True
                idle_until = time.monotonic() + IDLE_EXIT_S
                while not self._pending and not self._closed and (left := idle_until - time.monotonic()) > 0:
                    self._cond.wait(left)
                self._idle = False
                if self._closed or not self._pending:
                    self._thread = None  # the next add starts another
                    return
                due = self._pending[0][1] + DELAY_S
                left = due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)  # a call may carry them meanwhile
                    continue
                # The oldest has waited long enough: all go (the newer ones only end sooner).
                ids = [lid for lid, _ in self._pending]
                self._pending.clear()
                self._sending += len(ids)
            try:
                self._quietly(ids, time.monotonic() + SEND_S)
            finally:
                with self._cond:
                    self._sending -= len(ids)
                    self._cond.notify_all()
