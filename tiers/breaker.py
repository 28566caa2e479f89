"""A circuit breaker for calls to a store that may be down: pure, with an injected clock.

A cache in the decode path must fail fast. After ``failures`` consecutive failed calls
the breaker opens: calls are refused at once (no connect, no timeout to wait out) for
``cooldown_s``. Then one call at a time is let through as a probe (half-open); a success
closes the breaker, a failure opens it again for another cool-down.

Primitives:
- ``Breaker(failures=3, cooldown_s=5.0, clock=time.monotonic)``.
- ``allow() -> bool``: may a call go out now? (In half-open, only one probe at a time.)
- ``success()`` / ``failure() -> bool``: report the outcome; ``failure`` returns True when
  this failure opened the breaker (so the caller logs once per outage, not per call).
- ``abandon()``: a call that ended with no verdict on the store (it was not attempted, or
  its answer is to be had another way): if it was the probe (called from the thread the
  probe was let out on), the next call may probe.
- ``trip() -> bool``: open it now, whatever the count (a store found down by a probe);
  True when it was closed.
- ``state`` (``"closed"``, ``"open"``, ``"half_open"``), ``opened_count``.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    def __init__(self, failures: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._opened_at: float | None = None
        self._probing = False
        self._prober = 0  # the thread of the probe out, while _probing
        self.opened_count = 0  # times the breaker opened, for stat

    @property
    def state(self) -> str:
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        if self._clock() - self._opened_at >= self.cooldown_s:
            return HALF_OPEN
        return OPEN

    def allow(self) -> bool:
        with self._lock:
            s = self._state()
            if s == CLOSED:
                return True
            if s == OPEN or self._probing:
                return False
            self._probing = True  # half-open: this call is the one probe
            self._prober = threading.get_ident()
            return True

    def success(self) -> bool:
        """Record a success; True when it closed an open breaker (the store is back)."""
        with self._lock:
            was_open = self._opened_at is not None
            self._consecutive = 0
            self._opened_at = None
            self._probing = False
            return was_open

    def abandon(self) -> None:
        """A call let through ended without a verdict: without this, a probe that never
        reports would keep every later call refused. Only the probe's own thread frees
        it: calls let through while closed, ending after it opened, must not let a crowd
        of probes at a store that may be down."""
        with self._lock:
            if self._probing and self._prober == threading.get_ident():
                self._probing = False

    def trip(self) -> bool:
        """Open now (an outage counted), e.g. when a start-up probe finds the store down."""
        with self._lock:
            if self._opened_at is not None:
                return False
            self._opened_at = self._clock()
            self._probing = False
            self.opened_count += 1
            return True

    def failure(self) -> bool:
        """Record a failure; True when it opened the breaker."""
        with self._lock:
            self._consecutive += 1
            if self._opened_at is not None:
                # A failed probe (or a call that was in flight when it opened): another
                # full cool-down before the next probe.
                self._opened_at = self._clock()
                self._probing = False
                return False
            if self._consecutive >= self.failures:
                self._opened_at = self._clock()
                self.opened_count += 1
                return True
            return False
