"""Daemon-private host memory: the pool of the ``private`` tier.

An anonymous, private mapping: no file names it, so no other process can open it by a
path, and the daemon never offers it (no path in ``Hello``, no IPC handle). It holds the
sequences of tenants that are not ``trusted_local``, whose bytes must never be in memory
a client maps (the shared host arena, the device pool).

Primitives:
- ``anonymous(size, prefault) -> mmap``: a private anonymous mapping, its pages touched
  at creation when ``prefault`` (as the arena's: no page fault in the hot path).
- ``PrivateMemory.create(size, prefault)``; ``.tensor`` (one flat ``torch.uint8`` tensor),
  ``.view`` (a writable ``memoryview``), ``.size``, ``.close()``.
- ``unmap(view, mm, what)``: release a mapping's view and close it, or leave it to the OS
  while a tensor still references it (the arena's ``close`` uses it too).
"""

from __future__ import annotations

import logging
import mmap

log = logging.getLogger(__name__)


def anonymous(size: int, prefault: bool) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if prefault and hasattr(mmap, "MAP_POPULATE"):
        flags |= mmap.MAP_POPULATE
    return mmap.mmap(-1, size, flags=flags)


class PrivateMemory:
    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self._mm = mm
        self.size = size
        self.view = memoryview(mm)
        import torch  # here, not at the top: ``anonymous`` is imported where torch is not (the CLI)

        self.tensor = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int, prefault: bool = True) -> "PrivateMemory":
        return cls(anonymous(size, prefault), size)

    def close(self) -> None:
        import torch

        self.tensor = torch.empty(0, dtype=torch.uint8)  # our own view of it goes first
        unmap(self.view, self._mm, "private memory")


def unmap(view: memoryview, mm: mmap.mmap, what: str) -> None:
    """Release ``view`` and close ``mm``, unless a tensor view somewhere still references
    the mapping: then the OS unmaps it at exit (closing it under a live view would crash)."""
    view.release()
    try:
        mm.close()
    except BufferError:
        log.debug("%s still referenced; left to the OS", what)
