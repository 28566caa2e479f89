"""RESP for large values without redis-py's copies: a SET whose value is several pieces,
and GET replies read from the socket straight into the caller's buffers.

redis-py hands a whole value to ``sendall`` only when it is one object, so a value made of
a header and block views would first be joined (one copy of every byte). Its hiredis
parser reads a reply 64 KiB at a time into its own buffer, feeds that to hiredis (a second
copy) and builds a ``bytes`` (a third) that the store then copies into a slot (a fourth).
Here a SET sends the pieces as they are, and a GET lands in the slots with ``recv_into``:
one copy, the kernel's.

The reader only takes what it can parse without doubt: bulk replies whose length is the
one expected, and nils. Anything else (an error reply such as a cluster's ``MOVED``, a
value of another length: sealed, damaged or foreign) raises ``Unparsed``; the stream
position is then unknown, so the connection is closed, and the caller reads the same keys
the ordinary way, which follows redirects and names the damage.

Primitives:
- ``Pieces(parts)``: one RESP value made of several buffers laid end to end.
- ``serializer_class()``: redis-py's own command packer, plus ``Pieces`` arguments.
- ``Unparsed``: a reply the reader does not take (its connection already closed).
- ``read_bulks_into(conn, keys, heads, targets) -> list[bool]``: pipelined GETs of
  ``keys`` on one redis-py connection; reply ``i`` fills ``heads[i]`` then the views of
  ``targets[i]`` in order; False where the key is absent (nil).
"""

from __future__ import annotations

import functools
import socket
from typing import Any, Sequence


class Pieces:
    """A RESP value made of ``parts`` (bytes or memoryviews), sent without joining them."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        # Byte views: ``len`` of a view of wider items counts items, not bytes.
        self.parts = tuple(p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts)
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes


@functools.cache
def serializer_class() -> type:
    """redis-py's pure-Python command packer (it hands large values to ``sendall`` as they
    are), which also takes ``Pieces``: the length line, then each part as its own output
    item. Made on first use: the Redis client is an optional extra."""
    from redis.connection import PythonRespSerializer

    class PiecesSerializer(PythonRespSerializer):  # type: ignore[misc]
        def pack(self, *args: Any) -> list[Any]:
            if not any(isinstance(a, Pieces) for a in args):
                return super().pack(*args)
            if isinstance(args[0], str):  # "CONFIG GET"-style names go as separate words
                args = tuple(args[0].encode().split()) + args[1:]
            out: list[Any] = [b"*%d\r\n" % len(args)]
            for a in args:
                parts = a.parts if isinstance(a, Pieces) else (self.encode(a),)
                out.append(b"$%d\r\n" % sum(map(len, parts)))
                out.extend(parts)  # redis-py's pack_commands sends large ones on their own
                out.append(b"\r\n")
            return out

    return PiecesSerializer


class Unparsed(Exception):
    """A reply the fast reader does not take; if it read any of it, the connection has been
    closed."""


class Closed(OSError):
    """Redis closed the connection in the middle of a reply."""


def _read_line(sock: socket.socket, limit: int = 32) -> bytes:
    # Byte by byte: a reply's first line is a few bytes, and reading past it could block
    # on the next reply (there is none after the last) or swallow part of it.
    line = bytearray()
    one = bytearray(1)
    while True:
        if sock.recv_into(one, 1) != 1:
            raise Closed("Redis closed the connection mid-reply")
        line += one
        if line.endswith(b"\r\n"):
            return bytes(line[:-2])
        if len(line) > limit:
            raise Unparsed(f"reply line longer than {limit} bytes")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise Closed("Redis closed the connection mid-reply")
        got += k


def read_bulks_into(conn: Any, keys: Sequence[str], heads: Sequence[memoryview],
                    targets: Sequence[Sequence[memoryview]]) -> list[bool]:
    """GET every key on ``conn`` (a redis-py connection taken from its pool, with nothing
    pending) in one pipeline. Reply ``i`` must be a bulk of exactly ``len(heads[i])`` plus
    the targets' lengths: its first bytes land in ``heads[i]``, the rest in the views of
    ``targets[i]``. Returns, per key, whether it was there. ``Unparsed`` for any other
    reply, a redis-py ``ConnectionError`` / ``TimeoutError`` when the socket fails; in both
    cases the connection is closed before the error leaves."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if not hasattr(conn, "_sock"):  # a redis-py without it: the ordinary way, every time
        raise Unparsed("this redis-py's connections keep their socket elsewhere")
    try:
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
        sock = conn._sock
        if sock is None:
            raise Closed("connection closed while sending")
        found: list[bool] = []
        crlf = memoryview(bytearray(2))
        for head, views in zip(heads, targets):
            line = _read_line(sock)
            if line == b"$-1" or line == b"_":  # nil in RESP2, null in RESP3
                found.append(False)
                continue
            want = len(head) + sum(len(v) for v in views)
            if line != b"$%d" % want:
                # An error (MOVED, ASK, WRONGTYPE...) or a value of another size: the
                # ordinary path reads it and says what it is.
                raise Unparsed(f"reply {line[:32]!r}, expected a {want}-byte value")
            _recv_exact(sock, head)
            for v in views:
                _recv_exact(sock, v)
            _recv_exact(sock, crlf)
            if crlf != b"\r\n":
                raise Unparsed("bulk reply not terminated by CRLF")
            found.append(True)
        return found
    except socket.timeout:
        conn.disconnect()
        raise RedisTimeoutError("Timeout reading from Redis") from None
    except OSError as e:
        conn.disconnect()
        raise RedisConnectionError(f"Error while reading from Redis: {e}") from None
    except BaseException:
        conn.disconnect()
        raise
