"""The shared-memory file behind the host arena.

Primitives:
- ``SharedArena.create(shm_dir, size, prefault)``: a new file, mode 0600, mapped once.
  Falls back to anonymous memory (``path == ""``; no shm transport) when the directory
  is unusable.
- ``SharedArena.open(path, size)``: the client side: map an existing arena, pre-faulted.
- ``.tensor``: the whole arena as one flat ``torch.uint8`` tensor (device-agnostic views).
- ``.view``: the whole arena as a writable ``memoryview``.
- ``.close(unlink)``.
- ``remove_stale(shm_dir)``: delete arena files left by daemons that died (their pid is gone).

Pages are touched once at creation (``MAP_POPULATE``) so that neither the daemon nor a
client takes page faults in the hot path: a fresh buffer costs ~1.5-2 GB/s in faults
against ~14 GB/s for memcpy on the dev machine.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import time

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^kvpark-(\d+)-[0-9a-f]+\.arena$")


def _map_flags(prefault: bool) -> int:
    flags = mmap.MAP_SHARED
    if prefault and hasattr(mmap, "MAP_POPULATE"):
        flags |= mmap.MAP_POPULATE
    return flags


class SharedArena:
    def __init__(self, mm: mmap.mmap, path: str, size: int) -> None:
        self._mm = mm
        self.path = path
        self.size = size
        self.view = memoryview(mm)
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self.prefault_s = 0.0

    @classmethod
    def create(cls, shm_dir: str, size: int, prefault: bool = True) -> "SharedArena":
        t0 = time.perf_counter()
        path = ""
        try:
            os.makedirs(shm_dir, exist_ok=True)
            path = os.path.join(shm_dir, f"kvpark-{os.getpid()}-{secrets.token_hex(6)}.arena")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)  # the umask may only remove bits; make the mode exact
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size, flags=_map_flags(prefault), prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as e:
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            log.warning("shared-memory arena unavailable in %s (%s); using private memory, shm transport off",
                        shm_dir, e)
            path = ""
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (
                mmap.MAP_POPULATE if prefault and hasattr(mmap, "MAP_POPULATE") else 0))
        arena = cls(mm, path, size)
        arena.prefault_s = time.perf_counter() - t0
        return arena

    @classmethod
    def open(cls, path: str, size: int) -> "SharedArena":
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise OSError(f"arena file {path} has size {os.fstat(fd).st_size}, expected {size}")
            mm = mmap.mmap(fd, size, flags=_map_flags(True), prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(mm, path, size)

    def close(self, unlink: bool = False) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.view.release()
        try:
            self._mm.close()
        except BufferError:
            # A tensor view still references the mapping; the OS unmaps it at exit.
            log.debug("arena mapping still referenced; left to the OS")
        if unlink and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def remove_stale(shm_dir: str) -> list[str]:
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except OSError:
            pass
    return removed
