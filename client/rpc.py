"""The wire calls of one connection: stubs, deadlines, gRPC errors as typed exceptions.

Primitives:
- ``Rpc(address, timeout)``: the channel and one stub per method (``rpc.reserve``,
  ``rpc.acquire``, ...; ``rpc.park`` is the client-streamed Park, ``rpc.restore`` the
  server-streamed Restore).
- ``call(stub, request, timeout=None)``: one unary call; a ``grpc.RpcError`` becomes
  its ``KVParkError``.
- ``resolve_timeout(seconds) -> float | None``: ``None`` means the default
  (``KVPARK_TIMEOUT``, else ``DEFAULT_TIMEOUT_S``); ``float("inf")`` means no deadline
  (returned as ``None``, what gRPC takes for "none").
- ``timeout``: the deadline every control call of the calling thread gets: the
  connection's default, or what ``deadline(seconds)`` set for this thread only (so one
  thread's tight lookup bound never shortens another thread's save).
- ``data_timeout(nbytes)``: the deadline of a transfer: ``timeout`` plus its size at
  ``FLOOR_RATE`` (a transfer slower than that is treated as a hung daemon).
- ``release_quietly(lease_id)``; ``translate(error)``; ``close()``.
"""

from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import grpc

from kvpark.proto import GRPC_OPTIONS
from kvpark.proto.errors import ERROR_KEY, InvalidArgument, KVParkError, from_code
from kvpark.proto.v1 import kvpark_pb2 as pb

_SVC = "/kvpark.v1.KVPark/"

# Every call has a deadline unless the caller asks for none (``float("inf")``): an
# inference worker must never hang on a frozen daemon.
DEFAULT_TIMEOUT_S = 30.0
TIMEOUT_ENV = "KVPARK_TIMEOUT"
# A transfer gets its size at this rate on top of the control deadline: far below any
# real path (shm copies run at GB/s, inline gRPC at hundreds of MB/s on a LAN), so only
# a stalled daemon or link reaches it.
FLOOR_RATE = 50e6  # bytes per second


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


class Rpc:
    def __init__(self, address: str, timeout: float | None) -> None:
        self.address = address
        self.default_timeout = resolve_timeout(timeout)
        self._local = threading.local()
        self.channel = ch = grpc.insecure_channel(address, options=GRPC_OPTIONS)
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

    @property
    def timeout(self) -> float | None:
        return getattr(self._local, "timeout", self.default_timeout)

    def data_timeout(self, nbytes: int) -> float | None:
        t = self.timeout
        return None if t is None else t + max(0, nbytes) / FLOOR_RATE

    @contextmanager
    def deadline(self, seconds: float | None) -> Iterator[None]:
        """Bound every call this thread makes inside the block by ``seconds`` (``None``:
        the connection's default; ``inf``: no deadline)."""
        resolved = self.default_timeout if seconds is None else resolve_timeout(seconds)
        saved = self.timeout
        self._local.timeout = resolved
        try:
            yield
        finally:
            self._local.timeout = saved

    def call(self, stub: Callable[..., Any], req: Any, timeout: float | None = None) -> Any:
        try:
            return stub(req, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise translate(e) from None

    def release_quietly(self, lease_id: str) -> None:
        if not lease_id:
            return
        try:
            self.call(self.release, pb.ReleaseRequest(lease_id=lease_id))
        except KVParkError:
            pass  # the lease TTL frees it anyway

    def close(self) -> None:
        self.channel.close()
