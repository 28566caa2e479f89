"""The client side of the data channel: bulk inline bytes on a raw socket, past gRPC's ceiling.

``Hello`` advertises the channel (``DataChannelInfo``); ``Reserve``/``Acquire`` with
``data_channel=true`` return a one-time token; the bytes then move on a plain socket
(framing: ``kvpark.proto.dataframe``) straight from the tensors' memory (``sendmsg`` of
memoryviews) and straight into the output tensors (``recv_into``). Chunks are sent
back to back with no per-chunk reply, so many are in flight at once. Connections are
pooled and reused; a connection that saw any error is closed, never reused.

A channel that cannot be reached (refused, reset during connect, TLS asked for but no
context given) raises ``DataChannelRefused``; the inline transport then uses its gRPC
streams, and does not try the channel again for ``RETRY_S``. Errors the daemon reports
on the channel come back as the same typed ``KVParkError`` the gRPC path raises.

TLS: when the daemon advertises ``tls``, the socket is wrapped with the same CA and
client certificate the client gave gRPC (``client_ssl_context``); a client without any
TLS settings counts such a channel as refused and uses the gRPC path.

Primitives:
- ``DataChannelRefused`` (a ``TransportUnavailable``); ``NoStatus`` (from
  ``kvpark.proto.dataframe``): the daemon closed a connection before answering its
  request (it turns connections away when crowded), so the caller may use gRPC instead.
- ``client_ssl_context(tls_ca, tls_cert, tls_key) -> SSLContext | None``: from the
  client's gRPC TLS settings (file paths or PEM bytes); None without any.
- ``DataChannel(info, grpc_address, ssl_context=None)``: ``usable``; ``connect() ->
  socket``; ``put(sock, token, views, nbytes, timeout)``; ``get(sock, token, nbytes,
  dsts, timeout) -> Iterator[int]`` (indices of ``dsts`` as each fills); ``done(sock)``
  puts a healthy connection back; ``discard(sock)``; ``close()``. ``timeout`` bounds the
  whole transfer (re-armed on the socket before each read and frame), and a connection
  that ends before the last byte and the closing status is ``Unavailable``: the bytes
  that came are never handed over as the whole.
"""

from __future__ import annotations

import os
import socket
import ssl
import tempfile
import threading
import time
from typing import Iterator, Sequence

from kvpark.proto.dataframe import (CHUNK, GET, MAGIC, MAX_FRAME, PUT, REQUEST, VERSION, Closed, NoStatus,
                                    parse_address, read_status, send_views)
from kvpark.proto.errors import DataLoss, DeadlineExceeded, TransportUnavailable, Unavailable
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import regroup

RETRY_S = 30.0  # after a refusal, the gRPC path is used this long before the channel is tried again
FRAME = 4 << 20  # bytes per outgoing chunk: large enough that per-chunk costs vanish
_IDLE_MAX = 8  # pooled connections kept per client
POOL_IDLE_S = 5.0  # a pooled connection idle longer is not reused (the daemon closes them after 10 s)


class DataChannelRefused(TransportUnavailable):
    """The data channel cannot be used now; the caller falls back to gRPC streams."""


def _pem_file(value: str | bytes, stack: list[str]) -> str:
    """A path for ``ssl`` (which loads certificate chains from files only)."""
    if isinstance(value, str):
        return value
    fd, path = tempfile.mkstemp(suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(value)
    stack.append(path)
    return path


def client_ssl_context(tls_ca: str | bytes | None, tls_cert: str | bytes | None,
                       tls_key: str | bytes | None) -> ssl.SSLContext | None:
    if tls_ca is None and tls_cert is None and tls_key is None:
        return None
    ctx = ssl.create_default_context()
    if tls_ca is not None:
        if isinstance(tls_ca, bytes):
            ctx.load_verify_locations(cadata=tls_ca.decode())
        else:
            ctx.load_verify_locations(cafile=tls_ca)
    if tls_cert is not None and tls_key is not None:
        made: list[str] = []
        try:
            ctx.load_cert_chain(_pem_file(tls_cert, made), _pem_file(tls_key, made))
        finally:
            for path in made:  # loaded into the context: the key is not left on disk
                os.unlink(path)
    return ctx


def _resolve(advertised: str, grpc_address: str) -> str:
    """An advertised wildcard host (a daemon listening on 0.0.0.0) means: the host the
    client reached gRPC on."""
    if advertised.startswith("unix:"):
        return advertised
    host, _, port = advertised.rpartition(":")
    if host.strip("[]") in ("", "0.0.0.0", "::"):
        ghost = grpc_address.removeprefix("dns:").removeprefix("ipv4:").removeprefix("ipv6:")
        ghost = ghost.rpartition(":")[0] or "127.0.0.1"
        return f"{ghost}:{port}"
    return advertised


class DataChannel:
    def __init__(self, info: pb.DataChannelInfo, grpc_address: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self.address = _resolve(info.address, grpc_address)
        self.tls = info.tls
        self.ssl_context = ssl_context
        self.max_frame = min(int(info.max_frame) or MAX_FRAME, FRAME)
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, when it was put back)
        self._lock = threading.Lock()
        self._refused_until = 0.0

    @property
    def usable(self) -> bool:
        return time.monotonic() >= self._refused_until

    def _refuse(self, why: str) -> DataChannelRefused:
        self._refused_until = time.monotonic() + RETRY_S
        return DataChannelRefused(f"data channel {self.address}: {why}")

    def connect(self) -> socket.socket:
        """A pooled connection, or a new one (``DataChannelRefused`` when that fails)."""
        while True:
            with self._lock:
                if not self._idle:
                    break
                sock, since = self._idle.pop()
            if time.monotonic() - since < POOL_IDLE_S and _alive(sock):
                return sock
            self.discard(sock)  # the daemon closes connections idle for long; never reuse a dead one
        if self.tls and self.ssl_context is None:
            raise self._refuse("the daemon wants TLS and this client has no TLS context")
        family, addr = parse_address(self.address)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            sock.connect(addr)
            if family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None and self.tls:
                host = addr[0] if isinstance(addr, tuple) else None
                sock = self.ssl_context.wrap_socket(sock, server_hostname=host)
        except (OSError, ssl.SSLError) as e:
            sock.close()
            raise self._refuse(f"cannot connect: {e}") from None
        return sock

    def done(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < _IDLE_MAX:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()

    @staticmethod
    def discard(sock: socket.socket) -> None:
        try:
            sock.close()
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s, _ in idle:
            self.discard(s)

    def put(self, sock: socket.socket, token: bytes, views: Sequence[memoryview], nbytes: int,
            timeout: float | None) -> None:
        """Send a reservation's bytes; returns once the daemon has them all in its slots.
        The whole transfer ends within ``timeout`` (``DeadlineExceeded``)."""
        budget = _Budget(sock, timeout)
        try:
            budget.arm()
            send_views(sock, [REQUEST.pack(MAGIC, VERSION, PUT, token, nbytes)])
            for _, vs in regroup(iter(views), self.max_frame):
                budget.arm()
                send_views(sock, [CHUNK.pack(sum(len(v) for v in vs)), *vs])
        except socket.timeout:
            raise DeadlineExceeded(f"data channel PUT stalled past its {timeout}s deadline") from None
        except OSError as e:
            # The daemon may have answered an error and closed: that answer says why. No
            # answer: it closed the connection unread (turned away), or died.
            err = _status_after_reset(sock)
            raise (err or NoStatus(f"data channel PUT failed: {e}")) from None
        err = self._status(budget)
        if err is not None:
            raise err

    def get(self, sock: socket.socket, token: bytes, nbytes: int, dsts: Sequence[memoryview],
            timeout: float | None) -> Iterator[int]:
        """Receive a lease's bytes straight into ``dsts`` (in order, adding up to
        ``nbytes``), yielding each index as it fills, the whole transfer within
        ``timeout``. Every length is checked: a chunk past ``nbytes`` is ``DataLoss``; a
        connection that ends before every byte and the closing status is ``Unavailable``
        (the daemon died or dropped it), never quietly partial bytes.

        The request and the daemon's first answer happen in this call, before any index
        is yielded: ``NoStatus`` here means the daemon closed the connection without
        answering (turned away, or gone), and nothing of the lease has been read."""
        budget = _Budget(sock, timeout)
        try:
            budget.arm()
            send_views(sock, [REQUEST.pack(MAGIC, VERSION, GET, token, nbytes)])
        except socket.timeout:
            raise DeadlineExceeded(f"data channel GET stalled past its {timeout}s deadline") from None
        except OSError as e:
            raise NoStatus(f"data channel GET failed: {e}") from None
        err = self._status(budget)
        if err is not None:
            raise err
        return self._receive(budget, nbytes, dsts)

    def _receive(self, budget: "_Budget", nbytes: int, dsts: Sequence[memoryview]) -> Iterator[int]:
        sock, timeout = budget.sock, budget.timeout
        lens = [len(d) for d in dsts]
        di = within = 0
        while di < len(lens) and lens[di] == 0:
            yield di
            di += 1
        pos = 0
        try:
            while pos < nbytes:
                head = bytearray(CHUNK.size)
                budget.recv_into(memoryview(head))
                (n,) = CHUNK.unpack(head)
                if n == 0:  # the daemon failed mid-stream and says why
                    err = read_status(sock)
                    raise err if err is not None else DataLoss("data channel: an empty chunk")
                if n > MAX_FRAME or pos + n > nbytes:
                    raise DataLoss(f"data channel: a {n}-byte chunk at {pos} of {nbytes}")
                left = n
                while left:
                    take = min(lens[di] - within, left)
                    budget.recv_into(dsts[di][within : within + take])
                    within += take
                    left -= take
                    while di < len(lens) and within == lens[di]:
                        yield di
                        di, within = di + 1, 0
                pos += n
            budget.arm()
            err = read_status(sock)  # the closing status: the daemon has ended the lease
            if err is not None:
                raise err
        except socket.timeout:
            raise DeadlineExceeded(f"data channel GET stalled past its {timeout}s deadline after {pos} of "
                                   f"{nbytes} bytes") from None
        except (Closed, OSError) as e:
            # The bytes that came are right but not all of them: a dead or unreachable
            # daemon (retry later), not damaged data.
            raise Unavailable(f"data channel GET cut off after {pos} of {nbytes} bytes: {e}") from None

    @staticmethod
    def _status(budget: "_Budget") -> Exception | None:
        try:
            budget.arm()
            return read_status(budget.sock)
        except socket.timeout:
            return DeadlineExceeded(f"no answer on the data channel within {budget.timeout}s")
        except ConnectionResetError as e:
            # Reset before the answer: the daemon closed the connection with the request
            # unread (it turns connections away when crowded), or died.
            return NoStatus(f"data channel reset before the daemon's answer: {e}")
        except OSError as e:
            return Unavailable(f"data channel dropped: {e}")


class _Budget:
    """One transfer's deadline on its socket. A socket timeout bounds each blocking
    call, not the transfer: ``arm()`` sets what is left before each one, and raises
    ``socket.timeout`` once nothing is."""

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self.sock = sock
        self.timeout = timeout
        self.end = None if timeout is None else time.monotonic() + timeout

    def arm(self) -> None:
        if self.end is None:
            self.sock.settimeout(None)
            return
        left = self.end - time.monotonic()
        if left <= 0:
            raise socket.timeout("the transfer's deadline has passed")
        self.sock.settimeout(left)

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view``, re-armed before every read: a daemon that trickles bytes still
        ends by the deadline."""
        pos, n = 0, len(view)
        while pos < n:
            self.arm()
            got = self.sock.recv_into(view[pos:], n - pos)
            if got == 0:
                raise Closed(f"connection closed after {pos} of {n} bytes")
            pos += got


def _alive(sock: socket.socket) -> bool:
    """An idle pooled connection the daemon has not closed (nothing is pending on it)."""
    if isinstance(sock, ssl.SSLSocket):
        return True  # no peek under TLS; the age bound covers it
    saved = sock.gettimeout()
    sock.settimeout(0.0)  # a socket with a timeout would wait for readability first
    try:
        sock.recv(1, socket.MSG_PEEK)
        return False  # closed (b""), or bytes nobody asked for: either way not reusable
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(saved)


def _status_after_reset(sock: socket.socket) -> Exception | None:
    """A status frame the daemon sent before closing, if one is still readable."""
    try:
        sock.settimeout(0.5)
        return read_status(sock)
    except OSError:
        return None
