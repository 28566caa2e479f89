"""A count of in-flight uses of something that must not be torn down under them.

A client's mappings (the shm arena, a page-locked range, the device pool, data-channel
sockets) and its gRPC channel are used by calls running on other threads. ``close()``
must not pull them out from under a copy (an unmapped arena is a SIGSEGV, not an
exception), and must not wait for them either (a layer-wise consumer may close from the
very thread that holds the use). So close marks the thing closing and the teardown runs
when the last use ends; a use begun after close raises the error close was given.

Primitives:
- ``Uses``: ``enter()`` (raises once closing), ``exit()``, ``held()`` (a context manager
  of one use), ``close(teardown, error)`` (``error``: makes what a late use raises) (``teardown`` runs now when idle, else when the
  last use ends; exactly once).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class Uses:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0
        self._error: Callable[[], Exception] | None = None  # set once closing: what a new use raises
        self._teardown: Callable[[], None] | None = None

    def enter(self) -> None:
        with self._lock:
            if self._error is not None:
                # A fresh one each time: one instance raised on many threads would share
                # (and grow) one traceback.
                raise self._error()
            self._n += 1

    def exit(self) -> None:
        with self._lock:
            self._n -= 1
            teardown = self._teardown if self._n == 0 else None
            if teardown is not None:
                self._teardown = None
        if teardown is not None:
            teardown()

    @contextmanager
    def held(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def close(self, teardown: Callable[[], None], error: Callable[[], Exception]) -> None:
        with self._lock:
            if self._error is not None:
                return  # closed before: its teardown has run or is pending
            self._error = error
            if self._n:
                self._teardown = teardown  # the last use to end runs it
                return
        teardown()

