"""Offline compaction of the disk tier's LMDB file (``kvpark compact``).

LMDB reuses freed pages but never gives them back: after a burst of large sequences is
dropped, ``data.mdb`` keeps its high-water size. A copy with compaction
(``mdb_env_copy2(MDB_CP_COMPACT)``) writes only the live pages. It needs the directory to
itself: the data directory's lock is taken first (a running daemon holds it, and the
compaction is refused in words), the compact copy is written and fsynced beside the
original, then renamed over it, the old ``lock.mdb`` removed first (see ``compact``). An
interrupted compaction leaves the original intact (and a ``compact.tmp`` directory the
next run removes).

Primitives: ``compact(path) -> (bytes_before, bytes_after)``.
"""

from __future__ import annotations

import os
import shutil

import lmdb

from kvpark.proto.errors import StartupError

from . import envs
from .disk import lock_dir

_MAX_DBS = 8  # at least what ``DiskStore`` opens


def compact(path: str) -> tuple[int, int]:
    data = os.path.join(path, "data.mdb")
    if not os.path.exists(data):
        raise StartupError(f"{path}: no disk tier here (no data.mdb)")
    try:
        fd = lock_dir(path)
    except OSError as e:
        raise StartupError(f"cannot compact {path}: {e}; stop the daemon first") from None
    tmp = os.path.join(path, "compact.tmp")
    try:
        before = os.path.getsize(data)
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp, 0o700)
        envs.close(path)  # a disk-grant reader of this process: py-lmdb opens no second environment
        env = lmdb.open(path, readonly=True, max_dbs=_MAX_DBS, subdir=True, lock=False)
        try:
            env.copy(tmp, compact=True)
        finally:
            env.close()
        out = os.path.join(tmp, "data.mdb")
        with open(out, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(out, os.stat(data).st_mode & 0o777)
        # The lock file goes first: a client process may still hold the old one open (a
        # reader of disk grants), and the next daemon would then not be LMDB's first
        # opener: it would keep that file's transaction id and reader table, which
        # describe the old data file, and choose the copy's meta page by them (an empty
        # store, whose first write destroys the copy's root). A fresh lock file makes it
        # the first opener; such a client keeps reading the old inodes, whose records
        # are the same versions' bytes, until it notices the new file.
        try:
            os.unlink(os.path.join(path, "lock.mdb"))
        except FileNotFoundError:
            pass
        os.replace(out, data)
        dfd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself is durable before we say it is done
        finally:
            os.close(dfd)
        return before, os.path.getsize(data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)
