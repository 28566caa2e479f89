"""The shared-memory file behind the host arena.

Primitives:
- ``SharedArena.create(shm_dir, size, prefault, group="")``: a new file, mode 0600 (0660
  with ``group`` as its group), its memory
  reserved for real (``posix_fallocate``) before it is mapped, so neither the daemon nor
  a client that maps it can ever take SIGBUS for a page the file system cannot supply.
  Too little room raises ``StartupError`` naming the directory, its free bytes, the size
  wanted and the fixes. ``shm_dir`` must exist (never created silently); ``""`` means
  private memory and no shm transport.
- ``SharedArena.open(path, size)``: the client side: map an existing arena, pre-faulted.
- ``.tensor``: the whole arena as one flat ``torch.uint8`` tensor (device-agnostic views).
- ``.view``: the whole arena as a writable ``memoryview``.
- ``.close(unlink)``.
- ``remove_stale(shm_dir)``: delete arena files that no live daemon holds. Each daemon
  keeps an exclusive ``flock`` on its arena file for its whole life, so a file whose lock
  can be taken is stale. Never decided by pid: daemons in different PID namespaces may
  share one ``/dev/shm``.
- ``free_bytes(path)``, ``fs_type(path)``: what the directory can hold, and its file system.
- ``boot_id()``: this boot of this host; an arena is shared only within one.
- ``group_id(name) -> int``: a group's gid (``StartupError`` when unknown).

Pages are touched once at creation (``MAP_POPULATE``) so that neither the daemon nor a
client takes page faults in the hot path: a fresh buffer costs ~1.5-2 GB/s in faults
against ~14 GB/s for memcpy on the dev machine.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import mmap
import os
import re
import secrets
import time

from kvpark.proto.errors import StartupError

from .private import anonymous, unmap

log = logging.getLogger(__name__)

_NAME = re.compile(r"^kvpark-(\d+)-[0-9a-f]+\.arena$")
# File systems whose pages are memory: an arena anywhere else is a file on disk.
MEMORY_FS = ("tmpfs", "hugetlbfs", "ramfs")


def _map_flags(prefault: bool) -> int:
    flags = mmap.MAP_SHARED
    if prefault and hasattr(mmap, "MAP_POPULATE"):
        flags |= mmap.MAP_POPULATE
    return flags


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` ("" when unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def group_id(name: str) -> int:
    """The gid of group ``name`` (a number is taken as a gid); ``StartupError`` when unknown."""
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise StartupError(f"group {name!r} does not exist on this host") from None


def _no_room(shm_dir: str, size: int) -> StartupError:
    try:
        free = f"{free_bytes(shm_dir) >> 20} MiB free"
    except OSError:
        free = "free space unknown"
    return StartupError(
        f"host arena: {shm_dir} ({fs_type(shm_dir) or 'unknown fs'}, {free}) cannot hold the {size >> 20} MiB "
        "arena; set a smaller tiers.host.capacity, point tiers.host.shm_dir at a larger tmpfs, or give the "
        "container more shared memory (docker run --shm-size=...)"
    )


class SharedArena:
    def __init__(self, mm: mmap.mmap, path: str, size: int, lock_fd: int = -1) -> None:
        self._mm = mm
        self._lock_fd = lock_fd  # the daemon's flock on its own arena file: "this arena is alive"
        self.path = path
        self.size = size
        self.view = memoryview(mm)
        import torch  # here, not at the top: config (and so the CLI) uses ``free_bytes`` without torch

        self.tensor = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self.prefault_s = 0.0

    @classmethod
    def create(cls, shm_dir: str, size: int, prefault: bool = True, group: str = "") -> "SharedArena":
        t0 = time.perf_counter()
        if not shm_dir:
            log.info("tiers.host.shm_dir is empty: the host arena is private memory, shm transport off")
            arena = cls(cls._private(size, prefault), "", size)
        else:
            if not os.path.isdir(shm_dir):
                raise StartupError(f"tiers.host.shm_dir {shm_dir!r} does not exist or is not a directory; create "
                                   "it, or point it at a tmpfs such as /dev/shm")
            kind = fs_type(shm_dir)
            if kind not in MEMORY_FS:
                log.warning("tiers.host.shm_dir %s is on %s, not tmpfs/hugetlbfs: the arena is a file on disk",
                            shm_dir, kind or "an unknown file system")
            try:
                arena = cls._create_file(shm_dir, size, prefault, group)
            except PermissionError as e:
                log.warning("shared-memory arena unavailable in %s (%s); using private memory, shm transport off",
                            shm_dir, e)
                arena = cls(cls._private(size, prefault), "", size)
        arena.prefault_s = time.perf_counter() - t0
        return arena

    @classmethod
    def _create_file(cls, shm_dir: str, size: int, prefault: bool, group: str = "") -> "SharedArena":
        token = secrets.token_hex(6)
        # Made under a name remove_stale() ignores, locked, then renamed: no other daemon
        # can see it unlocked.
        tmp = os.path.join(shm_dir, f".kvpark-{os.getpid()}-{token}.creating")
        path = os.path.join(shm_dir, f"kvpark-{os.getpid()}-{token}.arena")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)  # the umask may only remove bits; make the mode exact
            if group:
                # Before the rename: the file is never visible under its name with a wider mode.
                try:
                    os.fchown(fd, -1, group_id(group))
                except PermissionError:
                    raise StartupError(f"tiers.host.group: this user may not give files to group {group!r} "
                                       "(it must be one of the daemon user's groups)") from None
                os.fchmod(fd, 0o660)
            try:
                # Reserve every page now: on tmpfs this fails with ENOSPC up front instead
                # of a SIGBUS in whichever process first touches a page that is not there.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise _no_room(shm_dir, size) from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                log.warning("%s cannot reserve space (%s); the arena is sized but not reserved", shm_dir, e)
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=_map_flags(prefault), prot=mmap.PROT_READ | mmap.PROT_WRITE)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return cls(mm, path, size, lock_fd=fd)

    @staticmethod
    def _private(size: int, prefault: bool) -> mmap.mmap:
        return anonymous(size, prefault)

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
        import torch

        self.tensor = torch.empty(0, dtype=torch.uint8)  # our own view of it goes first
        unmap(self.view, self._mm, "arena mapping")
        if unlink and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock: the file (if left) reads as stale
            self._lock_fd = -1


def remove_stale(shm_dir: str) -> list[str]:
    """Delete arena files whose lock no process holds (their daemon is gone)."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not _NAME.match(name):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live daemon holds it, whatever its pid looks like from here
        try:
            os.unlink(path)  # under our lock: its owner cannot be starting up on it
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def boot_id() -> str:
    """This boot of this host (empty where unknown): an arena file is shared only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""
