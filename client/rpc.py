"""The wire calls of one connection: stubs, deadlines, gRPC errors as typed exceptions.

Primitives:
- ``open_channel(address, token=None, tls_ca=None, tls_cert=None, tls_key=None)``: a
  plain or TLS channel; with ``token`` every call carries ``authorization: Bearer``.
- ``Rpc(address, timeout, token=None, tls_ca=None, tls_cert=None, tls_key=None)``: the
  channel and one stub per method (``rpc.reserve``,
  ``rpc.acquire``, ...; ``rpc.park`` is the client-streamed Park, ``rpc.restore`` the
  server-streamed Restore).
- ``call(stub, request, timeout=None)``: one unary call; a ``grpc.RpcError`` becomes
  its ``KVParkError``. ``narrow(seconds)``: ``seconds`` cut to the thread's deadline.
- ``resolve_timeout(seconds) -> float | None``: ``None`` means the default
  (``KVPARK_TIMEOUT``, else ``DEFAULT_TIMEOUT_S``); ``float("inf")`` means no deadline
  (returned as ``None``, what gRPC takes for "none").
- ``deadline(seconds)``: a block of this thread's calls that must all end within
  ``seconds`` from now, together (an absolute deadline: a sequence of calls shares what
  is left). Nested blocks narrow it, never widen it; ``None`` sets no bound of its own.
  Per thread only, so one thread's tight lookup bound never shortens another's save.
  ``until``: the deadline in force, as an instant; ``deadline_at(until)`` re-enters it.
- ``timeout``: the seconds the calling thread's next control call gets: what is left of
  its ``deadline()`` (``DeadlineExceeded`` once that has passed), else the connection's
  default.
- ``data_timeout(nbytes)``: the deadline of a transfer: inside ``deadline()``, what is
  left of it; else the default plus the transfer's size at ``FLOOR_RATE`` (a transfer
  slower than that is treated as a hung daemon).
- ``release_quietly(lease_id)``; ``translate(error)``; ``close()`` (after the releases
  still pending are sent).
- ``releases``: read leases whose Release is not waited for (``client/releases.py``).
  ``call`` sends them before any other unary call, so a caller's later calls find
  them ended; with ``carry=True`` (an ``Acquire`` or ``Reserve``) the request names
  them instead (its ``release`` field) and the daemon ends them first.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import grpc

from kvpark.proto import GRPC_OPTIONS
from kvpark.proto.errors import ERROR_KEY, DeadlineExceeded, InvalidArgument, KVParkError, from_code
from kvpark.proto.v1 import kvpark_pb2 as pb

from .releases import Releases

_SVC = "/kvpark.v1.KVPark/"

# Every call has a deadline unless the caller asks for none (``float("inf")``): an
# inference worker must never hang on a frozen daemon.
DEFAULT_TIMEOUT_S = 30.0
TIMEOUT_ENV = "KVPARK_TIMEOUT"
# A transfer gets its size at this rate on top of the control deadline: far below any
# real path (shm copies run at GB/s, inline gRPC at hundreds of MB/s on a LAN), so only
# a stalled daemon or link reaches it.
FLOOR_RATE = 50e6  # bytes per second
# A release with less than this left of its caller's deadline is sent without waiting
# for the reply, and given this long to reach the daemon.
RELEASE_MIN_S = 0.05
RELEASE_BEHIND_S = 5.0


def resolve_timeout(seconds: float | None) -> float | None:
    """The deadline in seconds for gRPC: ``None`` from the caller means the default,
    ``inf`` means none (``None`` to gRPC)."""
    if seconds is None:
        env = os.environ.get(TIMEOUT_ENV, "").strip()
        try:
            seconds = float(env) if env else DEFAULT_TIMEOUT_S
        except ValueError:
            raise InvalidArgument(f"{TIMEOUT_ENV} must be a number of seconds, got {env!r}") from None
    try:
        seconds = float(seconds)
    except (TypeError, ValueError):
        raise InvalidArgument(f"timeout must be a number of seconds, got {seconds!r}") from None
    if math.isnan(seconds) or seconds <= 0:
        raise InvalidArgument(f"timeout must be > 0 seconds, got {seconds}")
    return None if math.isinf(seconds) else seconds


def translate(e: grpc.RpcError) -> KVParkError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    name = None
    if hasattr(e, "trailing_metadata"):
        for k, v in e.trailing_metadata() or ():
            if k == ERROR_KEY:
                name = v
    return from_code(code, details or "", name)


def _ser(m: Any) -> bytes:
    return m.SerializeToString()


def _identity(b: bytes) -> bytes:
    return b


def _pem(value: str | bytes | None, what: str) -> bytes | None:
    """PEM bytes as given, or read from a file path."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise InvalidArgument(f"{what}: cannot read {value}: {e.strerror or e}") from None


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of the channel."""

    def __init__(self, token: str) -> None:
        self._md = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._md], d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, cont: Callable[..., Any], d: grpc.ClientCallDetails, req: Any) -> Any:
        return cont(self._details(d), req)

    def intercept_unary_stream(self, cont: Callable[..., Any], d: grpc.ClientCallDetails, req: Any) -> Any:
        return cont(self._details(d), req)

    def intercept_stream_unary(self, cont: Callable[..., Any], d: grpc.ClientCallDetails, reqs: Any) -> Any:
        return cont(self._details(d), reqs)

    def intercept_stream_stream(self, cont: Callable[..., Any], d: grpc.ClientCallDetails, reqs: Any) -> Any:
        return cont(self._details(d), reqs)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    pass


def open_channel(address: str, *, token: str | None = None, tls_ca: str | bytes | None = None,
                 tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None) -> grpc.Channel:
    """A channel to ``address``: TLS when any ``tls_*`` is given (files or PEM bytes), and
    every call carrying ``token`` as a bearer token when one is given."""
    if tls_ca is not None or tls_cert is not None or tls_key is not None:
        if (tls_cert is None) != (tls_key is None):
            raise InvalidArgument("tls_cert and tls_key go together (a client certificate and its key)")
        creds = grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca, "tls_ca"),
                                             private_key=_pem(tls_key, "tls_key"),
                                             certificate_chain=_pem(tls_cert, "tls_cert"))
        ch = grpc.secure_channel(address, creds, options=GRPC_OPTIONS)
    else:
        ch = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    if token:
        return grpc.intercept_channel(ch, _Bearer(token))
    return ch


class Rpc:
    def __init__(self, address: str, timeout: float | None, *, token: str | None = None,
                 tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None) -> None:
        self.address = address
        self.default_timeout = resolve_timeout(timeout)
        self._local = threading.local()
        # Releases sent after their caller's deadline, not waited for: held until they end
        # (a gRPC call whose future is collected is cancelled).
        self._behind: set[Any] = set()
        self._behind_lock = threading.Lock()
        self.releases = Releases(self._release_now)
        self.channel = ch = open_channel(address, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self.tls = (tls_ca, tls_cert, tls_key)  # the data channel wraps its socket with the same
        u = lambda name, resp: ch.unary_unary(_SVC + name, request_serializer=_ser,  # noqa: E731
                                               response_deserializer=resp.FromString)
        self.hello = u("Hello", pb.HelloResponse)
        self.reserve = u("Reserve", pb.ReserveResponse)
        self.commit = u("Commit", pb.SeqInfo)
        self.acquire = u("Acquire", pb.AcquireResponse)
        self.release = u("Release", pb.ReleaseResponse)
        self.window = u("Window", pb.WindowResponse)
        self.prefetch = u("Prefetch", pb.PrefetchResponse)
        self.lookup = u("Lookup", pb.LookupResponse)
        self.park_small = u("ParkSmall", pb.SeqInfo)
        self.get = u("Get", pb.GetResponse)
        self.drop = u("Drop", pb.DropResponse)
        self.info = u("Info", pb.SeqInfo)
        self.list = u("List", pb.ListResponse)
        self.stat = u("Stat", pb.StatResponse)
        self.pin = u("Pin", pb.SeqInfo)
        self.flush = u("Flush", pb.FlushResponse)
        self.park = ch.stream_unary(_SVC + "Park", request_serializer=_identity,
                                    response_deserializer=pb.SeqInfo.FromString)
        self.restore = ch.unary_stream(_SVC + "Restore", request_serializer=_ser, response_deserializer=_identity)

    def _until(self) -> float | None:
        return getattr(self._local, "until", None)

    @property
    def until(self) -> float | None:
        """This thread's deadline as a ``time.monotonic()`` instant (``inf``: none), or
        None outside ``deadline()``."""
        return self._until()

    @property
    def timeout(self) -> float | None:
        until = self._until()
        if until is None:
            return self.default_timeout
        if math.isinf(until):
            return None
        left = until - time.monotonic()
        if left <= 0:
            # Sending it anyway would only wait on a daemon the caller no longer waits for.
            raise DeadlineExceeded("the caller's deadline passed before the call was sent")
        return left

    def narrow(self, seconds: float | None) -> float | None:
        """``seconds`` (``None``: none), cut to what is left of this thread's deadline."""
        if self._until() is None:
            return seconds
        left = self.timeout
        return left if seconds is None else seconds if left is None else min(seconds, left)

    def data_timeout(self, nbytes: int) -> float | None:
        if self._until() is not None:
            return self.timeout  # the caller's deadline bounds the whole call, its transfer too
        t = self.default_timeout
        return None if t is None else t + max(0, nbytes) / FLOOR_RATE

    @contextmanager
    def deadline(self, seconds: float | None) -> Iterator[None]:
        """Every call this thread makes inside the block ends within ``seconds`` from now,
        all of them together (``None``: no bound of its own, the enclosing block's or else
        the connection's default per call; ``inf``: none of its own). An enclosing
        block's deadline is never widened."""
        if seconds is None:
            until = None
        else:
            resolved = resolve_timeout(seconds)
            until = math.inf if resolved is None else time.monotonic() + resolved
        with self.deadline_at(until):
            yield

    @contextmanager
    def deadline_at(self, until: float | None) -> Iterator[None]:
        """``deadline()`` to an instant (``time.monotonic()``; ``inf``: none of its own;
        ``None``: no bound of its own), e.g. one a call captured to finish later."""
        saved = self._until()
        if until is not None:
            self._local.until = until if saved is None else min(saved, until)
        try:
            yield
        finally:
            self._local.until = saved

    def call(self, stub: Callable[..., Any], req: Any, timeout: float | None = None, *, carry: bool = False) -> Any:
        """One unary call under ``timeout`` (``None``: ``self.timeout``), never past this
        thread's deadline, after the pending releases: sent first, or with ``carry`` named
        in ``req.release`` for the daemon to end first."""
        t = self.timeout if timeout is None else self.narrow(timeout)
        carried: list[str] = []
        if stub is not self.release and (self.releases.pending or self.releases.sending):
            limit = RELEASE_BEHIND_S if t is None else t
            if carry:
                self.releases.wait_sent(limit)  # never overtake a release already on its way
                carried = self.releases.take()
                del req.release[:]
                req.release.extend(carried)
            else:
                self.releases.flush(limit)
            t = self.timeout if timeout is None else self.narrow(timeout)
        try:
            return stub(req, timeout=t)
        except grpc.RpcError as e:
            # It may not have reached the daemon: its releases go again (ending a lease twice is harmless).
            self.releases.put_back(carried)
            raise translate(e) from None

    def _release_now(self, lease_id: str, until: float) -> None:
        """A pending release, sent and waited for until ``until`` (and within the calling
        thread's deadline: past either, sent without waiting)."""
        with self.deadline_at(until):
            self.release_quietly(lease_id)

    def release_quietly(self, lease_id: str) -> None:
        """End a lease, never raising. Within the caller's deadline the reply is waited
        for; once that deadline is spent (a transfer cut short by it) the release is sent
        without waiting, so the caller's deadline holds and the daemon still frees the
        slots now rather than at the lease's TTL."""
        if not lease_id:
            return
        req = pb.ReleaseRequest(lease_id=lease_id)
        until = self._until()
        if until is None or until - time.monotonic() > RELEASE_MIN_S:
            try:
                self.call(self.release, req)
                return
            except DeadlineExceeded:
                pass  # spent while it was on its way: send it again, not waited for
            except (KVParkError, ValueError):
                return  # the daemon failed it, or the channel is closed: the lease TTL frees it
        try:
            f = self.release.future(req, timeout=RELEASE_BEHIND_S)
        except Exception:  # noqa: BLE001 - a closed channel: the TTL frees it
            return
        with self._behind_lock:
            self._behind.add(f)

        def done(fut: Any) -> None:
            with self._behind_lock:
                self._behind.discard(fut)

        f.add_done_callback(done)

    def close(self) -> None:
        self.releases.close(RELEASE_BEHIND_S)  # closing the channel would cancel them
        self.channel.close()
