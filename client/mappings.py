"""One mapping of each daemon arena per process, shared by every ``Client`` in it.

A vLLM worker holds two clients (the step's and the saver's), and page-locking a
multi-GiB arena takes seconds and a GPU context; each client mapping and pinning the
arena for itself doubled both, on the engine's first load. So the mapping (and its page
lock) belongs to the process: the first client to open an arena maps it, later ones
share it, and the last to let go unmaps it.

Primitives:
- ``open_arena(path, size) -> SharedArena``: this process's mapping of the arena file
  (one per file: its path, device and inode), counted; ``OSError`` when it cannot be mapped.
- ``close_arena(arena)``: one user fewer; the last unpins and unmaps it.
- ``pin_arena(arena, device) -> bool``: page-lock the mapping once (under ``device``, so
  the calling thread never opens a context on another GPU); whether it is pinned.
- ``mapped() -> int``: mappings held now (tests).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from kvpark.tiers import cuda
from kvpark.tiers.shm import SharedArena

__all__ = ["close_arena", "mapped", "open_arena", "pin_arena"]


@dataclass
class _Mapping:
    arena: SharedArena
    key: tuple[str, int, int, int]
    users: int = 1
    pinned_on: torch.device | None = None  # the device it was page-locked under
    pin_tried: bool = False
    pin_lock: threading.Lock = field(default_factory=threading.Lock)


_lock = threading.Lock()
_by_key: dict[tuple[str, int, int, int], _Mapping] = {}
_by_arena: dict[int, _Mapping] = {}  # id(arena) -> its mapping


def open_arena(path: str, size: int) -> SharedArena:
    st = os.stat(path)  # a restarted daemon's arena is another file (another inode)
    key = (path, int(size), st.st_dev, st.st_ino)
    with _lock:
        m = _by_key.get(key)
        if m is not None:
            m.users += 1
            return m.arena
        arena = SharedArena.open(path, size)
        m = _Mapping(arena, key)
        _by_key[key] = m
        _by_arena[id(arena)] = m
        return arena


def close_arena(arena: SharedArena) -> None:
    with _lock:
        m = _by_arena.get(id(arena))
        if m is None:
            return
        m.users -= 1
        if m.users > 0:
            return
        del _by_arena[id(arena)]
        _by_key.pop(m.key, None)
    with m.pin_lock:
        if m.pinned_on is not None:
            cuda.unpin_host(arena.tensor, m.pinned_on)
            m.pinned_on = None
    arena.close()


def pin_arena(arena: SharedArena, device: torch.device) -> bool:
    """Page-lock ``arena`` once for this process (the first GPU caller's device guards
    the call; the registration is portable, so it serves every GPU)."""
    with _lock:
        m = _by_arena.get(id(arena))
    if m is None:
        return False
    with m.pin_lock:
        if not m.pin_tried:
            m.pin_tried = True
            if cuda.pin_host(arena.tensor, device) is not None:
                m.pinned_on = device
        return m.pinned_on is not None


def mapped() -> int:
    with _lock:
        return len(_by_key)
