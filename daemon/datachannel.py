"""The daemon's data channel: bulk bytes of inline parks and restores on a raw socket.

Python gRPC tops out near 1-1.3 GB/s on a small machine; a plain socket moving
memoryviews with ``recv_into``/``sendmsg`` does 2-3x that. gRPC stays the control
plane: ``Reserve``/``Acquire`` with ``data_channel=true`` create the reservation or read
lease as always (inside whatever authentication the gRPC server applies) and return a
one-time token; a transfer on this socket presents the token and acts on that one
reservation or lease only, so whoever made the control call is who the bytes belong to.
The framing is ``kvpark.proto.dataframe``.

A transfer owns its lease: each chunk is copied into or out of the slots under the
lease's copy lock (``LeaseTable.copying``), so a Release, the reaper or shutdown waits
out that chunk, and the next one fails typed (``LeaseExpired``); no slot is freed or
reused while a chunk is being copied. The reaper never waits on a copy, and a frame as
a whole gets the idle limit, so a peer trickling bytes cannot hold the lock for ever.

- PUT: chunks land straight in the reserved arena slots (``recv_into`` on slot views);
  a reservation on the device tier takes each chunk through one bounce buffer
  (``write_chunk``, as an inline park's chunks). The client then commits over gRPC, and
  that commit requires every byte to have arrived (counted on the lease itself).
- GET: served as an inline restore is (memory copies under the read lease, disk records
  verified as they are read): the lease stops expiring while the bytes are streamed out
  (``sendmsg`` of slot views) and the transfer ends it before its closing status, so the
  client makes no Release call and a restore that returned has ended its lease. An
  error mid-stream (a record failing its checksum, a lease released under the transfer)
  is sent typed after a zero-length chunk.

A connection that has not yet sent its whole first request header is unauthenticated.
Its TLS handshake, and its header once the first byte of it has arrived, each get
``HANDSHAKE_S`` as a whole; silence before the header gets ``IDLE_S`` (a client connects,
then makes its Reserve or Acquire call, then sends the header at once). The acceptor
enforces these deadlines whatever the peer trickles, and at most ``MAX_UNAUTHENTICATED``
connections may be unauthenticated at once: beyond that the oldest is closed for the
newest. Token-less sockets therefore never hold the slots that transfers need.

Bad input (an unknown, expired or reused token, a wrong op or size, a frame of 0 or more
than ``MAX_FRAME`` bytes, frames past the declared size, a short read, an idle or
vanished peer) gets a typed status frame where the peer can still read one, the
connection is closed, and a PUT's reservation is aborted (its token is spent, so it
could never complete). The lease TTL frees anything a transfer never reached. Nothing
here can stop the daemon: each connection runs in its own thread and every failure
ends in that thread.

TLS: ``DataChannelServer(..., ssl_context=...)`` wraps every accepted socket (server
side) and ``Hello`` then advertises ``tls``; ``Daemon`` passes ``server_ssl_context``,
which is TLS exactly when gRPC is (``server.tls_cert``/``tls_key``, and mTLS with
``tls_client_ca``).

Primitives:
- ``Tickets(ttl_s)``: ``issue_put(lease_id, nbytes, view) -> token``, ``issue_get(handle,
  view) -> token`` (``view``: the engine as the calling tenant, which the token then acts
  as), ``take(token) -> Ticket`` (one use; ``Unauthenticated`` when unknown, used or
  expired). What a commit requires is kept on the lease (``LeaseTable.require_all``),
  never here: this table forgets expired tokens, and frames keep a lease alive past its
  token.
- ``DataChannelServer(engine, listen, ssl_context=None, claim=None)``: ``start()`` binds
  (port 0 picks one; a unix path is claimed first unless ``claim`` holds it already;
  ``address`` is then what ``Hello`` advertises), ``stop()``,
  ``connections`` (open ones), ``transfers`` (completed ones).
- ``listen_address(grpc_listen, configured) -> str``: where the channel binds by default;
  ``server_ssl_context(ServerConfig) -> SSLContext | None``.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import secrets
import socket
import ssl
import termios
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvpark.proto.dataframe import (CHUNK, GET, MAGIC, MAX_FRAME, PUT, REQUEST, TOKEN_BYTES, VERSION, Closed,
                                    parse_address, recv_exact, send_views, status_bytes)
from kvpark.proto.errors import InvalidArgument, KVParkError, LeaseExpired, Unauthenticated

from .config import ServerConfig
from .engine import Engine
from .model import ReadHandle
from .sockets import UnixClaim, claim_unix_path

log = logging.getLogger("kvpark.datachannel")

# A connection idle this long between transfers, or stalled this long inside one, is
# closed. It also bounds how long a stalled PUT holds its lease's copy lock.
IDLE_S = 10.0
MAX_CONNECTIONS = 64
# A connection's TLS handshake, and its first request header from its first byte, each
# within this; and at most this many connections before their first header at once (the
# oldest gives way to the newest).
HANDSHAKE_S = 5.0
MAX_UNAUTHENTICATED = 16
GET_CHUNK = 4 << 20  # bytes per outgoing chunk (one sendmsg of slot views)


class _Dropped(Exception):
    """End the connection without a status frame (one would be misread mid-stream)."""


@dataclass
class Ticket:
    op: int  # PUT or GET
    lease_id: str
    nbytes: int
    expires_at: float
    # The engine as the tenant whose authenticated call issued the token (the engine
    # itself on an open daemon): everything the token does, it does as that tenant.
    view: Any
    handle: ReadHandle | None = None  # GET


class Tickets:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._by_token: dict[bytes, Ticket] = {}

    def _purge(self, now: float) -> None:
        # REQUIRES: self._lock. Tokens nobody presented (their leases expire on their own).
        if len(self._by_token) > 256:
            self._by_token = {k: t for k, t in self._by_token.items() if t.expires_at >= now}

    def _issue(self, ticket: Ticket) -> bytes:
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._purge(time.monotonic())
            self._by_token[token] = ticket
        return token

    def issue_put(self, lease_id: str, nbytes: int, view: Any) -> bytes:
        return self._issue(Ticket(PUT, lease_id, nbytes, time.monotonic() + self.ttl_s, view))

    def issue_get(self, handle: ReadHandle, view: Any) -> bytes:
        return self._issue(Ticket(GET, handle.lease_id, handle.info.nbytes, time.monotonic() + self.ttl_s, view,
                                  handle))

    def take(self, token: bytes) -> Ticket:
        with self._lock:
            t = self._by_token.pop(token, None)
        if t is None or t.expires_at < time.monotonic():
            raise Unauthenticated("data channel token unknown, expired or already used")
        return t


def server_ssl_context(server: ServerConfig) -> ssl.SSLContext | None:
    """TLS for the channel exactly when gRPC has it: the same certificate and key, and
    client certificates required (signed by ``tls_client_ca``) when gRPC requires them."""
    if not server.tls_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(server.tls_cert, server.tls_key)
    if server.tls_client_ca:
        ctx.load_verify_locations(server.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def listen_address(grpc_listen: str, configured: str) -> str:
    """``configured`` if set; else next to gRPC: its host on a free port, or for a unix
    socket ``<path>.data``."""
    if configured:
        return configured
    if grpc_listen.startswith("unix:"):
        return grpc_listen + ".data"  # relative stays relative (to the daemon's directory)
    host = grpc_listen.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:0"


class DataChannelServer:
    def __init__(self, engine: Engine, listen: str, ssl_context: ssl.SSLContext | None = None,
                 claim: UnixClaim | None = None) -> None:
        self.engine = engine
        # A unix path is claimed for the server's life: by the caller (the daemon claims
        # every path before it binds any), else by start().
        self._claim = claim
        self.listen = listen
        self.ssl_context = ssl_context
        self.tickets = Tickets(engine.config.leases.ttl_s)
        self.address = ""
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        # Connections before their first whole header -> their deadline (oldest first).
        self._unauth: dict[socket.socket, float] = {}
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acceptor: threading.Thread | None = None
        self._unix_path = ""
        self.transfers = 0  # completed PUTs and GETs, since start

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def start(self) -> "DataChannelServer":
        family, addr = parse_address(self.listen)
        sock = socket.socket(family, socket.SOCK_STREAM)
        own: UnixClaim | None = None
        try:
            if family == socket.AF_UNIX:
                assert isinstance(addr, str)
                addr = os.path.abspath(addr)  # Hello advertises it: clients run elsewhere
                if self._claim is None:
                    self._claim = claim_unix_path(addr)  # never another's live socket, nor a file not ours
                    own = self._claim
                old = os.umask(0o177)  # the socket file is the daemon user's only, like the arena
                try:
                    sock.bind(addr)
                finally:
                    os.umask(old)
                self._unix_path = addr
                self.address = f"unix:{addr}"
            else:
                sock.bind(addr)
                host, port = sock.getsockname()[:2]
                self.address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
            sock.listen(MAX_CONNECTIONS)
            # accept() wakes at least this often, to close handshakes past their deadline.
            sock.settimeout(HANDSHAKE_S / 5)
        except OSError as e:
            sock.close()
            if own is not None:
                own.release()
                self._claim = None
            raise OSError(f"data channel cannot listen on {self.listen}: {e.strerror or e}") from None
        self._sock = sock
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvpark-dc-accept", daemon=True)
        self._acceptor.start()
        log.info("data channel (bulk bytes) at %s%s", self.address, " (TLS)" if self.tls else "")
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _close(c)
        if self._acceptor is not None:
            self._acceptor.join(timeout=2.0)
        with self._lock:
            threads = list(self._threads)
        for t in threads:  # none may still be copying into the arena when the engine closes
            t.join(timeout=IDLE_S)
        if self._unix_path:
            try:
                os.unlink(self._unix_path)
            except OSError:
                pass
        if self._claim is not None:
            self._claim.release()  # after the unlink: the next owner's socket is never ours to remove

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            self._expire_handshakes(time.monotonic())
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.05)  # EMFILE and friends: back off, keep serving
                continue
            conn.settimeout(IDLE_S)  # not the listening socket's wake-up interval
            with self._lock:
                # Room for the newcomer at the cost of the oldest unauthenticated one, never
                # of a connection that has shown a request, nor of one whose request is
                # already waiting to be read: a burst of honest clients is not a client
                # that says nothing (the bound is on those).
                if self._unauth and (len(self._unauth) >= MAX_UNAUTHENTICATED
                                     or len(self._conns) >= MAX_CONNECTIONS):
                    victim = next((c for c in self._unauth if not self._request_waiting(c)), None)
                    if victim is not None:
                        self._drop_unauth(victim)
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
                    self._unauth[conn] = time.monotonic() + (HANDSHAKE_S if self.ssl_context else IDLE_S)
            if full:
                _close(conn)  # the client sees the refusal and falls back to gRPC
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name="kvpark-dc", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _request_waiting(self, conn: socket.socket) -> bool:
        """Whether a whole request header sits unread on ``conn`` (a clear connection:
        under TLS the bytes say nothing before the handshake, so none is spared)."""
        if self.ssl_context is not None:
            return False
        try:
            # FIONREAD, not a peek: a socket with a timeout waits for readability before
            # any recv, and this runs under the channel's lock.
            waiting = array.array("i", [0])
            fcntl.ioctl(conn.fileno(), termios.FIONREAD, waiting)
            return waiting[0] >= REQUEST.size
        except (OSError, ValueError):  # already closed
            return False

    def _drop_unauth(self, conn: socket.socket) -> None:
        # REQUIRES: self._lock. Its thread wakes from recv, sees the close and ends.
        self._unauth.pop(conn)
        self._conns.discard(conn)
        _shut(conn)

    def _expire_handshakes(self, now: float) -> None:
        with self._lock:
            for c in [c for c, deadline in self._unauth.items() if now > deadline]:
                self._drop_unauth(c)

    def _unauth_deadline(self, conn: socket.socket, seconds: float) -> bool:
        """A new deadline for an unauthenticated connection; False if it was closed meanwhile."""
        with self._lock:
            if conn not in self._unauth:
                return False
            self._unauth[conn] = time.monotonic() + seconds
            return True

    def _serve(self, conn: socket.socket) -> None:
        sock = conn
        try:
            sock.settimeout(IDLE_S)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_side=True)
                if not self._unauth_deadline(conn, IDLE_S):  # silence until the header, as in clear
                    return
            first = True
            while not self._stopping.is_set():
                try:
                    if first:
                        lead = recv_exact(sock, 1)
                        if not self._unauth_deadline(conn, HANDSHAKE_S):  # the header has begun
                            return
                        head = lead + recv_exact(sock, REQUEST.size - 1)
                    else:
                        head = recv_exact(sock, REQUEST.size)
                except Closed:
                    return  # the client closed an idle connection (or its handshake ran out): normal
                if first:
                    with self._lock:  # a whole request: its token decides from here
                        if self._unauth.pop(conn, None) is None:
                            return  # its handshake ran out, or a newer one took its place, meanwhile
                    first = False
                self._one(sock, head)
        except KVParkError as e:
            # Typed, for the client to raise; the connection's state is unknown now: close it.
            log.info("data channel: %s: %s", type(e).__name__, e.message)
            try:
                sock.sendall(status_bytes(e))
            except OSError:
                pass
        except (OSError, ssl.SSLError, _Dropped) as e:  # a vanished, stalled or non-TLS peer
            log.info("data channel: connection dropped: %s", e)
        except Exception:  # noqa: BLE001 - a bug here must not take the daemon down
            log.exception("data channel: internal error")
        finally:
            _close(sock)
            with self._lock:
                self._conns.discard(conn)
                self._unauth.pop(conn, None)
                self._threads.discard(threading.current_thread())

    def _one(self, sock: socket.socket, head: bytes) -> None:
        magic, version, op, token, nbytes = REQUEST.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise InvalidArgument(f"not a kvpark data channel request (magic {magic!r}, version {version})")
        if op not in (PUT, GET):
            raise InvalidArgument(f"unknown data channel op {op}")
        ticket = self.tickets.take(token)
        if ticket.op != op:
            self._abort(ticket)  # the token is spent either way
            raise InvalidArgument(f"token was issued for {'PUT' if ticket.op == PUT else 'GET'}, not this op")
        if op == PUT:
            self._put(sock, ticket, nbytes)
        else:
            self._get(sock, ticket, nbytes)

    def _abort(self, ticket: Ticket) -> None:
        if ticket.lease_id:  # "" : an expired or never-leased handle
            ticket.view.release(ticket.lease_id)

    def _put(self, sock: socket.socket, ticket: Ticket, nbytes: int) -> None:
        done = False
        try:
            if nbytes != ticket.nbytes:
                raise InvalidArgument(f"PUT of {nbytes} bytes; the reservation is for {ticket.nbytes}")
            lease = self.engine.leases.get_write(ticket.lease_id)
            mem = self.engine.tiers[lease.tier]
            views = [v for a in lease.write_allocs() for v in mem.views(a)] if mem.on_cpu else []
            bounce = memoryview(bytearray(0 if mem.on_cpu else MAX_FRAME))
            vi = within = 0
            received = 0
            while received < nbytes:
                (n,) = CHUNK.unpack(recv_exact(sock, CHUNK.size))
                if n == 0 or n > MAX_FRAME:
                    raise InvalidArgument(f"data channel frame of {n} bytes (1..{MAX_FRAME})")
                if received + n > nbytes:
                    raise InvalidArgument(f"frames overrun the declared {nbytes} bytes")
                # The whole frame gets the idle limit, not each recv: a peer trickling a
                # byte at a time must not hold the copy lock (which Release and shutdown
                # wait on) for ever.
                deadline = time.monotonic() + IDLE_S
                if not mem.on_cpu:  # device slots: through the bounce buffer, as inline chunks go
                    _recv_into_by(sock, bounce[:n], deadline)
                    ticket.view.write_chunk(ticket.lease_id, received, bounce[:n])
                    received += n
                    continue
                with lease.lock:  # no end frees these slots while we fill them
                    if lease.ended:
                        raise LeaseExpired(f"write lease {lease.lease_id[:8]} expired during the transfer")
                    left = n
                    while left:
                        v = views[vi]
                        take = min(len(v) - within, left)
                        _recv_into_by(sock, v[within : within + take], deadline)
                        within += take
                        left -= take
                        if within == len(v):
                            vi, within = vi + 1, 0
                    lease.received += n
                    self.engine.leases.extend(lease)
                received += n
            # Counted before the closing status, so a client that saw its call return
            # also sees it counted.
            self._count_transfer()
            sock.sendall(status_bytes(None))
            done = True
        finally:
            if not done:
                self._abort(ticket)

    def _get(self, sock: socket.socket, ticket: Ticket, nbytes: int) -> None:
        handle = ticket.handle
        assert handle is not None
        leases = self.engine.leases
        lease = leases.hold(ticket.lease_id) if ticket.lease_id else None
        if ticket.lease_id and lease is None:
            raise LeaseExpired(f"read lease {ticket.lease_id[:8]} expired before the transfer")
        try:
            if nbytes != ticket.nbytes:
                raise InvalidArgument(f"GET of {nbytes} bytes; the lease serves {ticket.nbytes}")
            sock.sendall(status_bytes(None))
            try:
                for _, views in ticket.view.iter_chunks(handle, GET_CHUNK):
                    # Each chunk leaves the slots under the lease's copy lock: a Release (or
                    # shutdown) waits it out, and the next chunk then fails typed; no slot
                    # is freed, and none reused, while its bytes are being sent.
                    with leases.copying(lease):
                        send_views(sock, [CHUNK.pack(sum(len(v) for v in views)), *views])
            except KVParkError as e:
                # Mid-stream: a zero-length chunk (never a data chunk) announces the error's
                # status frame, so the client raises it typed (a checksum's DataLoss, ...).
                sock.sendall(CHUNK.pack(0) + status_bytes(e))
                raise _Dropped(f"GET failed mid-stream: {type(e).__name__}: {e.message}") from None
        finally:
            self._abort(ticket)  # the lease ends with its transfer...
        # ...before the closing status: a client whose restore returned sees it ended
        # (and counted).
        self._count_transfer()
        sock.sendall(status_bytes(None))

    def _count_transfer(self) -> None:
        with self._lock:
            self.transfers += 1


def _recv_into_by(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from the socket by ``deadline`` (a ``socket.timeout`` past it)."""
    pos, n = 0, len(view)
    try:
        while pos < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"a data channel frame still short by {n - pos} bytes after {IDLE_S}s")
            sock.settimeout(left)
            got = sock.recv_into(view[pos:], n - pos)
            if got == 0:
                raise Closed(f"connection closed after {pos} of {n} bytes")
            pos += got
    finally:
        sock.settimeout(IDLE_S)


def _shut(sock: socket.socket) -> None:
    """Wake the thread reading ``sock`` (its recv returns, closed); that thread closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
