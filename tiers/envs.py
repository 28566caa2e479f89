"""One LMDB environment per data directory per process, shared by a daemon's disk store
and the clients that read the disk tier directly (disk grants).

LMDB must not open one environment twice in a process: its locks on ``lock.mdb`` are
POSIX locks, which belong to the process, and closing either handle drops them all, so
another process could then take itself for the first opener and reset the reader table
under live readers (letting the writer reuse pages they still read). A daemon and a
client often share a process (an embedded daemon, ``kvpark bench``, tests), so both go
through here:

- the daemon's store opens its environment inside ``owning(path)``, which first closes
  this process's reader environment on that directory (once its reads are over; no new
  one opens meanwhile), and publishes its own read transactions; ``disown`` withdraws
  them once it has closed;
- a client's ``reading(path)`` reads through the store's transactions when this process
  holds one, else through a read-only environment opened on first use and kept (its
  reader slots registered in ``lock.mdb``, so the daemon's writer never reuses a page an
  open read transaction can see).

A reader environment maps ``READER_MAP`` bytes of address space (or the data file's
size, if larger): the daemon's file grows as it writes, and a read past the mapping is
refused by LMDB (``MapResizedError``). Growing a mapping in place would move it under
the views other threads' reads hold, so it is never done: the environment is retired
(no new read uses it; the last read out closes it), reads meanwhile answer ``Again``
(the client asks the daemon instead), and the next read after it opens a fresh one
mapping the file as it is now. ``refresh(path)`` retires it the same way when the data
file is no longer the one mapped (a directory recreated, a compaction).

Primitives: ``owning(path)`` (a context yielding ``publish(read)``, ``read()`` a context
yielding ``(txn, blocks_db)``), ``disown(path, read)``, ``reading(path)`` (a context
yielding ``(txn, blocks_db)``; ``OSError``/``lmdb.Error`` when the files cannot be
opened; ``Again`` while this process's reader environment is being replaced),
``refresh(path) -> bool``, ``close(path)`` (before opening the files some other way),
``CLOSE_WAIT_S``, ``READER_MAP``.
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

CLOSE_WAIT_S = 60.0  # how long closing a reader environment waits for its reads
READER_MAP = 1 << 40  # address space a reader environment maps (not memory)
Read = Callable[[], ContextManager[tuple[Any, Any]]]

_cv = threading.Condition()
_stores: dict[str, Read] = {}
_opening: set[str] = set()  # directories a store of this process is opening right now


class Again(Exception):
    """This process's reader environment is being replaced: read through the daemon this time."""


class _Own:
    """A read-only environment this process opened for direct reads."""

    __slots__ = ("env", "db", "ino", "uses", "retired")

    def __init__(self, path: str) -> None:
        size = max(READER_MAP, os.path.getsize(os.path.join(path, "data.mdb")) * 2)
        self.env = lmdb.open(path, readonly=True, lock=True, subdir=True, create=False, max_dbs=6,
                             max_readers=1024, readahead=False, map_size=size)
        try:
            # Not inside a transaction of ours: a handle opened in a read-only transaction
            # closes with it (every later get answers EINVAL).
            self.db = self.env.open_db(b"blocks", create=False)
        except BaseException:
            self.env.close()
            raise
        self.ino = _data_ino(path)
        self.uses = 0
        self.retired = False  # no new reads; closed by the last one out


_own: dict[str, _Own] = {}


def _key(path: str) -> str:
    return os.path.realpath(path)


def _data_ino(path: str) -> tuple[int, int]:
    st = os.stat(os.path.join(path, "data.mdb"))
    return st.st_dev, st.st_ino


def _retire(key: str, own: _Own) -> None:
    """No new read uses ``own``; it closes once the reads using it are over (py-lmdb opens
    no second environment on the directory before that). REQUIRES: _cv."""
    own.retired = True
    if not own.uses:
        own.env.close()
        if _own.get(key) is own:
            del _own[key]


def _close_own(key: str) -> None:
    """Close this process's reader environment on ``key`` once no read uses it (waiting
    for them, at most ``CLOSE_WAIT_S``). REQUIRES: _cv."""
    own = _own.get(key)
    if own is None:
        return
    _retire(key, own)
    deadline = time.monotonic() + CLOSE_WAIT_S
    while _own.get(key) is own and (left := deadline - time.monotonic()) > 0:
        _cv.wait(left)
    if _own.get(key) is own:
        # A read stalled past the wait: closing would unmap its views. It stays open
        # (until the process exits), and a store opening here fails to open its own.
        log.error("disk reader on %s: %d read(s) still running after %.0f s; left open", key, own.uses,
                  CLOSE_WAIT_S)


@contextmanager
def owning(path: str) -> Iterator[Callable[[Read], None]]:
    """For the daemon's store: open its environment inside this block (under the registry
    lock, with no reader environment of this process on the directory), then
    ``publish(read)`` its read transactions."""
    key = _key(path)
    with _cv:
        _opening.add(key)  # no reader environment opens while the last one closes
        try:
            _close_own(key)

            def publish(read: Read) -> None:
                _stores[key] = read

            yield publish
        finally:
            _opening.discard(key)
            _cv.notify_all()


def disown(path: str, read: Read) -> None:
    """The store has closed its environment: clients of this process open their own."""
    with _cv:
        if _stores.get(_key(path)) is read:
            del _stores[_key(path)]


def _use(key: str) -> tuple[Read | None, _Own | None]:
    """The store's reads, or a reader environment with one use taken. REQUIRES: _cv."""
    deadline = time.monotonic() + CLOSE_WAIT_S
    while key in _opening and (left := deadline - time.monotonic()) > 0:
        _cv.wait(left)
    store = _stores.get(key)
    if store is not None:
        return store, None
    own = _own.get(key)
    if own is not None and own.retired:
        raise Again(f"the reader environment on {key} is being replaced")
    if own is None:
        own = _own[key] = _Own(key)
    own.uses += 1
    return None, own


def _unuse(key: str, own: _Own) -> None:
    with _cv:
        own.uses -= 1
        if own.retired and not own.uses:
            _retire(key, own)
        _cv.notify_all()


@contextmanager
def reading(path: str) -> Iterator[tuple[Any, Any]]:
    """A read transaction (zero-copy buffers) on the disk tier at ``path`` and its blocks
    database. ``Again`` when this process's reader environment is being replaced."""
    key = _key(path)
    with _cv:
        store, own = _use(key)
    if store is not None:
        with store() as pair:
            yield pair
        return
    assert own is not None
    try:
        try:
            txn = own.env.begin(buffers=True)
        except lmdb.MapResizedError:
            # The file grew past this mapping. Growing it in place would move it under
            # the views other threads' reads hold: it is retired instead, and the next
            # read after the last of those opens a fresh one.
            with _cv:
                own.retired = True
            raise Again(f"the disk tier's file at {key} grew past this process's mapping") from None
        with txn:
            yield txn, own.db
    finally:
        _unuse(key, own)


def close(path: str) -> None:
    """Close this process's reader environment on ``path`` once its reads are over: for
    code of this process that opens the files itself (py-lmdb refuses a second open)."""
    with _cv:
        _close_own(_key(path))


def refresh(path: str) -> bool:
    """Retire this process's reader environment on ``path`` if the data file it maps was
    replaced (the next read opens the new one); True when it did."""
    key = _key(path)
    with _cv:
        own = _own.get(key)
        if own is None or own.retired:
            return False
        try:
            if _data_ino(key) == own.ino:
                return False
        except OSError:
            pass
        _retire(key, own)
        return True
