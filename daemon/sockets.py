"""Unix socket paths the daemon binds: claimed for its life, never taken from another.

gRPC unlinks any socket file at its unix path before it binds, so a second daemon
started on a running one's path would silently take the name: clients would reach the
newcomer and find nothing of what they parked. A path is claimed before anything binds
it, and the claim is held until the daemon stops, so two starts cannot both pass the
check (the claim is an ``flock`` on ``<path>.lock``; the file stays, as lock files must).

Primitives:
- ``unix_path(listen)``: the file a ``unix:`` address names, read as gRPC reads it
  (``unix:rel``, ``unix:/abs``, ``unix:///abs``); ``ValueError`` for the forms gRPC reads
  differently from a plain path (``unix://name`` names a host; ``%``, ``?``, ``#`` and
  ``,`` mean something else in its URIs), for ``//`` at the start, and for an empty path.
- ``claim_unix_path(path) -> UnixClaim``: returns once ``path`` is this process's to
  bind: its lock taken, and nothing there or a socket nobody answers on (a daemon that
  died; removed). Raises ``OSError`` with the reason in words: the path is longer than
  a unix socket address holds, its directory does not exist, another daemon holds the
  lock, a process answers on it, or something that is not a socket is there (never
  removed: it is not ours).
- ``UnixClaim.release()``: lets the path go (idempotent), after the socket is closed.
- ``MAX_UNIX_PATH``: the longest path (bytes) a unix socket address holds on Linux.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat

MAX_UNIX_PATH = 107  # sun_path is 108 bytes with its terminating NUL
_ANSWER_S = 1.0  # a live daemon accepts at once: its listen backlog takes the connect


def unix_path(listen: str) -> str:
    if listen.startswith("unix://"):
        path = listen[len("unix://"):]
        if not path.startswith("/"):
            raise ValueError(f"{listen!r}: unix://NAME names a host to gRPC, not a file; write unix:NAME "
                             "(relative) or unix:///absolute/path")
    elif listen.startswith("unix:"):
        path = listen[len("unix:"):]
    else:
        raise ValueError(f"{listen!r} is not a unix: address")
    if not path:
        raise ValueError(f"{listen!r}: no path")
    if path.startswith("//"):
        raise ValueError(f"{listen!r}: a path that starts with // is read as a host name; use one /")
    # gRPC's client reads the address as a URI: % escapes, ? and # end the path, and a
    # comma separates addresses. The daemon would bind one file and its clients dial another.
    odd = [c for c in "%?#," if c in path]
    if odd:
        raise ValueError(f"{listen!r}: gRPC clients read {odd[0]!r} in an address as something other than part "
                         "of the path; choose a path without %, ?, # or ,")
    return path


class UnixClaim:
    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the flock goes with the descriptor
            self._fd = None


def claim_unix_path(path: str) -> UnixClaim:
    size = len(os.fsencode(path))
    if size > MAX_UNIX_PATH:
        raise OSError(errno.ENAMETOOLONG,
                      f"the path is {size} bytes; a unix socket path holds at most {MAX_UNIX_PATH}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OSError(errno.ENOENT, f"directory {parent} does not exist")
    lock = f"{path}.lock"
    try:
        # Never through a link (root would create its target, anywhere), and a plain file
        # only; read access is all flock needs.
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as e:
        raise OSError(e.errno, f"cannot open its lock file {lock}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EEXIST, f"its lock file {lock} is there and is not a plain file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EADDRINUSE, f"another kvpark daemon holds {path} (its lock {lock})") from None
        _clear(path)
    except BaseException:
        os.close(fd)
        raise
    return UnixClaim(path, fd)


def _clear(path: str) -> None:
    """Nothing at ``path`` once this returns, or a refusal: a live socket or a file
    that is not a socket is someone else's (a daemon without the lock, another program)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; kvpark does not remove it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_ANSWER_S)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: the socket of a process that died
        except OSError as e:
            raise OSError(e.errno, f"{path} is a socket that cannot be checked ({e.strerror or e})") from None
        else:
            raise OSError(errno.EADDRINUSE, f"a process is listening on {path} (another kvpark daemon?)")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
