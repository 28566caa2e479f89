"""The data channel's framing, shared by the daemon and the client.

The data channel is a plain TCP (or unix) socket next to gRPC that carries the bulk
bytes of one park or restore: gRPC keeps every control call, and the channel only acts
on a reservation or read lease a control call created, named by the one-time token
that call returned. A connection carries one transfer at a time and may carry many in
turn.

Frames (little endian)::

    request  := magic "KVDC" | u8 version | u8 op | 16-byte token | u64 nbytes
    PUT      := request, then chunks until nbytes have been sent; the daemon answers status
    GET      := request (nbytes = what the client expects); the daemon answers status,
                then (when ok) chunks until nbytes, then a closing status (sent once the
                read lease has ended); an error mid-stream is a zero-length chunk, then
                its status frame
    chunk    := u32 length (1..max_frame) | length bytes
    status   := u8 ok | u16 name length | u32 message length | error class name | message

An error status names a ``KVParkError`` class (``kvpark.proto.errors``); the daemon
closes the connection after one. Chunks are written into (read out of) arena slots
straight from the socket (``recv_into``, ``sendmsg`` over memoryviews).

Primitives: ``REQUEST``, ``CHUNK``, ``STATUS`` (``struct.Struct``); ``MAGIC``,
``VERSION``, ``PUT``, ``GET``, ``TOKEN_BYTES``, ``MAX_FRAME``; ``recv_exact(sock, n)``;
``recv_into_exact(sock, view)``; ``send_views(sock, views)``; ``status_bytes(err)``;
``read_status(sock) -> KVParkError | None``; ``parse_address(address) -> (family, addr)``.
``Closed`` (the peer closed mid-frame, with how much came); ``NoStatus`` (an
``Unavailable``: closed before the first byte of an answer, the request unread).
"""

from __future__ import annotations

import socket
import struct
from typing import Sequence

from .errors import DataLoss, KVParkError, Unavailable, from_name

MAGIC = b"KVDC"
VERSION = 1
PUT = 1
GET = 2
TOKEN_BYTES = 16
MAX_FRAME = 16 << 20  # largest chunk either side accepts
REQUEST = struct.Struct("<4sBB16sQ")
CHUNK = struct.Struct("<I")
STATUS = struct.Struct("<BHI")
_MAX_STATUS_TEXT = 1 << 16


class Closed(ConnectionError):
    """The peer closed the connection before a whole frame arrived (``received``: how
    many of the frame's bytes did)."""

    def __init__(self, message: str, received: int = 0) -> None:
        super().__init__(message)
        self.received = received


class NoStatus(Unavailable):
    """The daemon closed the connection before the first byte of its status: it turned
    the connection away (or died) without reading or answering the request."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket, straight into its memory."""
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            raise Closed(f"connection closed after {pos} of {n} bytes", pos)
        pos += got


def send_views(sock: socket.socket, views: Sequence[memoryview | bytes]) -> None:
    """Send every buffer in order: one ``sendmsg`` for them all where the socket has it
    (plain sockets), ``sendall`` each under TLS (an ``SSLSocket`` has no ``sendmsg``)."""
    if not hasattr(sock, "sendmsg") or type(sock).__name__ == "SSLSocket":
        for v in views:
            sock.sendall(v)
        return
    bufs = [memoryview(v).cast("B") for v in views if len(v)]
    while bufs:
        sent = sock.sendmsg(bufs[:512])  # IOV_MAX is 1024 on Linux
        while sent and bufs:
            if sent >= len(bufs[0]):
                sent -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][sent:]
                sent = 0


def status_bytes(err: KVParkError | None) -> bytes:
    if err is None:
        return STATUS.pack(1, 0, 0)
    name = type(err).__name__.encode()
    msg = (err.message or name.decode()).encode()[:_MAX_STATUS_TEXT]
    return STATUS.pack(0, len(name), len(msg)) + name + msg


def read_status(sock: socket.socket) -> KVParkError | None:
    """The daemon's answer: ``None`` for ok, else the typed error it named."""
    try:
        ok, nlen, mlen = STATUS.unpack(recv_exact(sock, STATUS.size))
        if ok:
            return None
        if nlen > 256 or mlen > _MAX_STATUS_TEXT:
            return DataLoss("data channel: malformed status from the daemon")
        name = recv_exact(sock, nlen).decode(errors="replace")
        msg = recv_exact(sock, mlen).decode(errors="replace")
    except Closed as e:
        if e.received == 0:
            return NoStatus(f"data channel closed by the daemon before its answer: {e}")
        return Unavailable(f"data channel closed by the daemon: {e}")
    return from_name(name, msg)


def parse_address(address: str) -> tuple[socket.AddressFamily, str | tuple[str, int]]:
    """``unix:path`` (relative), ``unix:/path`` or ``unix:///path`` (absolute), as gRPC
    reads them, or ``host:port`` (``[v6]:port``)."""
    if address.startswith("unix://"):
        return socket.AF_UNIX, address[len("unix://"):]
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[len("unix:"):]
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))
