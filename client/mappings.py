"""One mapping of each daemon arena per process, shared by every ``Client`` in it.

A vLLM worker holds two clients (the step's and the saver's), and page-locking a
multi-GiB arena takes seconds and a GPU context; each client mapping and pinning the
arena for itself doubled both, on the engine's first load. So the mapping (and its page
lock) belongs to the process: the first client to open an arena maps it, later ones
share it, and the last to let go unmaps it.

Primitives:
- ``open_arena(path, size) -> Mapping``: a use of this process's mapping of the arena
  file (one per file: its path, size, device and inode); ``.arena`` is the
  ``SharedArena``. ``OSError`` when it cannot be mapped.
- ``Mapping.close()``: this use ends (once); the last use unpins and unmaps it.
- ``Mapping.pin(device) -> bool``: page-lock the mapping once per process (under
  ``device``, so the calling thread never opens a context on another GPU); whether it is
  pinned. Never pins a mapping whose last use has ended.
- ``mapped() -> int``: mappings held now (tests).

A use that is dropped without ``close()`` (a ``Client`` never closed) is let go by the
garbage collector: the shared state is held only through its uses, and the last one to
go unpins and unmaps, as a close would.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

from kvpark.tiers import cuda
from kvpark.tiers.shm import SharedArena

__all__ = ["Mapping", "mapped", "open_arena"]

Key = tuple[str, int, int, int]


class _Shared:
    """The process's mapping of one arena file: its page lock, and its teardown."""

    def __init__(self, arena: SharedArena, key: Key) -> None:
        self.arena = arena
        self.key = key
        self.lock = threading.Lock()  # pin and teardown, one at a time
        self.pinned_on: torch.device | None = None
        self.pin_tried = False
        self.gone = False

    def teardown(self) -> None:
        # REQUIRES: no use left, and no longer findable by open_arena (see _release).
        with self.lock:
            if self.gone:
                return
            self.gone = True
            if self.pinned_on is not None:
                cuda.unpin_host(self.arena.tensor, self.pinned_on)  # before the unmap, never after
                self.pinned_on = None
        self.arena.close()


class Mapping:
    """One use of a shared arena mapping."""

    def __init__(self, shared: _Shared) -> None:
        self._shared = shared
        self.arena = shared.arena
        # A use dropped without close() ends as a close would (the GC runs this once).
        self._end = weakref.finalize(self, _release, shared)
        # Not at interpreter exit: a daemon thread may still be copying through it then,
        # and the process's end unmaps everything anyway.
        self._end.atexit = False

    def close(self) -> None:
        self._end()  # once: a finalizer runs at most once, by close or by the GC

    def pin(self, device: torch.device) -> bool:
        s = self._shared
        with s.lock:
            if not s.pin_tried and not s.gone and self._end.alive:
                s.pin_tried = True
                if cuda.pin_host(s.arena.tensor, device) is not None:
                    s.pinned_on = device
            return s.pinned_on is not None


# Reentrant: a garbage collection can start on any allocation made under it (opening a
# mapping allocates), and a dropped use's finalizer (``_release``) then runs on this
# thread and takes it again. The use being opened is counted before anything is
# allocated, so a finalizer running in between never tears its mapping down.
_lock = threading.RLock()
_shared: dict[Key, _Shared] = {}
_users: dict[int, int] = {}  # id(_Shared) -> uses not yet ended


def _release(shared: _Shared) -> None:
    """One use of ``shared`` ended; the last one tears it down."""
    with _lock:
        left = _users.get(id(shared), 0) - 1
        if left > 0:
            _users[id(shared)] = left
            return
        _users.pop(id(shared), None)
        # Unfindable before it is torn down: an open from here on maps the file afresh
        # instead of taking a use of a mapping about to be unmapped.
        if _shared.get(shared.key) is shared:
            del _shared[shared.key]
    shared.teardown()


def open_arena(path: str, size: int) -> Mapping:
    st = os.stat(path)  # a restarted daemon's arena is another file (another inode)
    key = (path, int(size), st.st_dev, st.st_ino)
    with _lock:
        s = _shared.get(key)
        if s is None:
            s = _Shared(SharedArena.open(path, size), key)
            _shared[key] = s
        _users[id(s)] = _users.get(id(s), 0) + 1
        try:
            return Mapping(s)
        except BaseException:
            _release(s)  # no use was made: give the count back (the last one tears it down)
            raise


def mapped() -> int:
    with _lock:
        return len(_shared)
