"""One LMDB environment per data directory per process, shared by a daemon's disk store
and the clients that read the disk tier directly (disk grants).

LMDB must not open one environment twice in a process: its locks on ``lock.mdb`` are
POSIX locks, which belong to the process, and closing either handle drops them all, so
another process could then take itself for the first opener and reset the reader table
under live readers (letting the writer reuse pages they still read). A daemon and a
client often share a process (an embedded daemon, ``kvpark bench``, tests), so both go
through here:

- the daemon's store opens its environment inside ``owning(path)``, which first closes
  this process's reader environment on that directory (once its reads are over), and
  publishes its own read transactions; ``disown`` withdraws them once it has closed;
- a client's ``reading(path)`` reads through the store's transactions when this process
  holds one, else through a read-only environment opened on first use and kept (its
  reader slots registered in ``lock.mdb``, so the daemon's writer never reuses a page an
  open read transaction can see). ``refresh(path)`` reopens that environment when the
  data file is no longer the one it maps (a directory recreated, a compaction).

Primitives: ``owning(path)`` (a context yielding ``publish(read)``, ``read()`` a context
yielding ``(txn, blocks_db)``), ``disown(path, read)``, ``reading(path)`` (a context
yielding ``(txn, blocks_db)``; ``OSError``/``lmdb.Error`` when the files cannot be
opened), ``refresh(path) -> bool``, ``CLOSE_WAIT_S``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator

import lmdb

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0  # how long closing a reader environment waits for its reads
Read = Callable[[], ContextManager[tuple[Any, Any]]]

_cv = threading.Condition()
_stores: dict[str, Read] = {}


class _Own:
    """A read-only environment this process opened for direct reads."""

    __slots__ = ("env", "db", "ino", "uses")

    def __init__(self, path: str) -> None:
        self.env = lmdb.open(path, readonly=True, lock=True, subdir=True, create=False, max_dbs=6,
                             max_readers=1024, readahead=False)
        try:
            # Not inside a transaction of ours: a handle opened in a read-only transaction
            # closes with it (every later get answers EINVAL).
            self.db = self.env.open_db(b"blocks", create=False)
        except BaseException:
            self.env.close()
            raise
        self.ino = _data_ino(path)
        self.uses = 0


_own: dict[str, _Own] = {}


def _key(path: str) -> str:
    return os.path.realpath(path)


def _data_ino(path: str) -> tuple[int, int]:
    st = os.stat(os.path.join(path, "data.mdb"))
    return st.st_dev, st.st_ino


def _close_own(key: str) -> None:
    """Close this process's reader environment on ``key`` once no read uses it. REQUIRES: _cv."""
    own = _own.pop(key, None)
    if own is None:
        return
    deadline = time.monotonic() + CLOSE_WAIT_S
    while own.uses and (left := deadline - time.monotonic()) > 0:
        _cv.wait(left)
    if own.uses:
        # A read stalled past the wait: closing would unmap its views. Leak the handle
        # (until the process exits) rather than crash the reader.
        log.error("disk reader on %s: %d read(s) still running after %.0f s; left open", key, own.uses,
                  CLOSE_WAIT_S)
        return
    own.env.close()


@contextmanager
def owning(path: str) -> Iterator[Callable[[Read], None]]:
    """For the daemon's store: open its environment inside this block (under the registry
    lock, with no reader environment of this process on the directory), then
    ``publish(read)`` its read transactions."""
    key = _key(path)
    with _cv:
        _close_own(key)

        def publish(read: Read) -> None:
            _stores[key] = read

        yield publish


def disown(path: str, read: Read) -> None:
    """The store has closed its environment: clients of this process open their own."""
    with _cv:
        if _stores.get(_key(path)) is read:
            del _stores[_key(path)]


@contextmanager
def reading(path: str) -> Iterator[tuple[Any, Any]]:
    """A read transaction (zero-copy buffers) on the disk tier at ``path`` and its blocks database."""
    key = _key(path)
    with _cv:
        store = _stores.get(key)
        own = None
        if store is None:
            own = _own.get(key)
            if own is None:
                own = _own[key] = _Own(key)
            own.uses += 1
    if store is not None:
        with store() as pair:
            yield pair
        return
    assert own is not None
    try:
        try:
            txn = own.env.begin(buffers=True)
        except lmdb.MapResizedError:
            own.env.set_mapsize(0)  # the daemon grew the map: adopt its size
            txn = own.env.begin(buffers=True)
        with txn:
            yield txn, own.db
    finally:
        with _cv:
            own.uses -= 1
            _cv.notify_all()


def refresh(path: str) -> bool:
    """Reopen this process's reader environment on ``path`` if the data file it maps was
    replaced; True when it did (a read that missed may find the records now)."""
    key = _key(path)
    with _cv:
        own = _own.get(key)
        if own is None:
            return False
        try:
            if _data_ino(key) == own.ino:
                return False
        except OSError:
            pass
        _close_own(key)
        return True
