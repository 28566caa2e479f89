"""What the benchmarks share: the peers kvpark is measured against, and the timers.

Primitives:
- ``BareServicer`` / ``start_bare_server(servicer)`` / ``BareClient(address)``: a bare gRPC
  server (generic handler, identity serializers, kvpark's channel options) that streams
  1 MiB messages built from memoryviews: the ceiling of the inline transport.
- ``BareSocket(capacity)``: a plain loopback TCP socket served by a thread here that moves
  the same bytes with ``sendmsg`` of memoryviews and ``recv_into`` preallocated memory
  (``upload(views)``, ``download(dsts)``, ``sources``, ``sink``): the ceiling of the data
  channel.
- ``RedisServer()``: a throwaway ``redis-server`` on a free loopback port, persistence off;
  ``ok`` is False (with ``skip_reason``) when the binary or redis-py is missing.
- ``timed(fn, reps, warmup, before=None, after=None) -> [seconds]``,
  ``latencies(fn, iters, warmup) -> [microseconds]``, ``pct(xs, p)``.
- ``touch(tensors)``, ``same(xs, ys)``, ``cpu_model()``.

Used by ``kvpark bench`` (``kvpark.client.bench``) and the scripts in bench/.
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import grpc
import numpy as np
import torch

MiB = 1 << 20
CHUNK = 1 << 20
BARE_SERVICE = "kvparkbench.Bare"
REDIS_READ_SIZE = 1 << 20


def grpc_options() -> list[tuple[str, int]]:
    from kvpark.proto import GRPC_OPTIONS

    return list(GRPC_OPTIONS)


def _identity(b: bytes) -> bytes:
    return b


class BareServicer:
    """Upload lands every message in ``sink``; Download streams ``sources[key]``."""

    def __init__(self, sink_size: int) -> None:
        self.sink = np.zeros(sink_size, dtype=np.uint8)  # touched: no page faults while timed
        self.sources: dict[str, list[memoryview]] = {}
        self.received = 0

    def upload(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        sink = memoryview(self.sink)
        pos = 0
        for msg in requests:
            n = len(msg)
            sink[pos : pos + n] = msg
            pos += n
        self.received = pos
        return pos.to_bytes(8, "little")

    def download(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for v in self.sources[request.decode()]:
            for o in range(0, len(v), CHUNK):
                yield bytes(v[o : o + CHUNK])

    def echo(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return request


def start_bare_server(servicer: BareServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="bare-rpc"), options=grpc_options())
    handler = grpc.method_handlers_generic_handler(
        BARE_SERVICE,
        {
            "Upload": grpc.stream_unary_rpc_method_handler(
                servicer.upload, request_deserializer=_identity, response_serializer=_identity),
            "Download": grpc.unary_stream_rpc_method_handler(
                servicer.download, request_deserializer=_identity, response_serializer=_identity),
            "Echo": grpc.unary_unary_rpc_method_handler(
                servicer.echo, request_deserializer=_identity, response_serializer=_identity),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class BareClient:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=grpc_options())
        svc = f"/{BARE_SERVICE}/"
        self._upload = self.channel.stream_unary(svc + "Upload", request_serializer=_identity,
                                                 response_deserializer=_identity)
        self._download = self.channel.unary_stream(svc + "Download", request_serializer=_identity,
                                                   response_deserializer=_identity)
        self.echo = self.channel.unary_unary(svc + "Echo", request_serializer=_identity,
                                             response_deserializer=_identity)

    def upload(self, views: Sequence[memoryview]) -> int:
        def gen() -> Iterator[bytes]:
            for v in views:
                for o in range(0, len(v), CHUNK):
                    yield bytes(v[o : o + CHUNK])

        return int.from_bytes(self._upload(gen()), "little")

    def download(self, key: str, dsts: Sequence[memoryview]) -> int:
        di, pos, total = 0, 0, 0
        for msg in self._download(key.encode()):
            n = len(msg)
            if pos == len(dsts[di]):
                di, pos = di + 1, 0
            dsts[di][pos : pos + n] = msg
            pos += n
            total += n
        return total

    def close(self) -> None:
        self.channel.close()


class BareSocket:
    """One loopback connection, raw bytes both ways; a thread serves it."""

    _HEAD = 9  # u8 op (1 upload, 2 download) | u64 nbytes

    def __init__(self, capacity: int) -> None:
        from kvpark.proto.dataframe import recv_into_exact, send_views

        self._recv, self._send = recv_into_exact, send_views
        self.sink = np.empty(capacity, dtype=np.uint8)
        self.sink.fill(0)  # faulted in now, not inside a timed upload
        self.sources: list[memoryview] = []
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        self._thread = threading.Thread(target=self._serve, args=(lst,), daemon=True)
        self._thread.start()
        self.sock = socket.create_connection(lst.getsockname())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _serve(self, lst: socket.socket) -> None:
        conn, _ = lst.accept()
        lst.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = memoryview(bytearray(self._HEAD))
        sink = memoryview(self.sink)
        try:
            while True:
                self._recv(conn, head)
                op, n = head[0], int.from_bytes(head[1:], "little")
                if op == 1:
                    self._recv(conn, sink[:n])
                    conn.sendall(b"k")
                else:
                    self._send(conn, self.sources)
        except (OSError, ConnectionError):
            conn.close()

    def upload(self, views: Sequence[memoryview]) -> None:
        n = sum(len(v) for v in views)
        self._send(self.sock, [bytes([1]) + n.to_bytes(8, "little"), *views])
        self._recv(self.sock, memoryview(bytearray(1)))

    def download(self, dsts: Sequence[memoryview]) -> None:
        n = sum(len(d) for d in dsts)
        self.sock.sendall(bytes([2]) + n.to_bytes(8, "little"))
        for d in dsts:
            self._recv(self.sock, d)

    def close(self) -> None:
        self.sock.close()
        self._thread.join(5)


class RedisServer:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.version = ""
        self.hiredis = False
        self.skip_reason = ""
        exe = shutil.which("redis-server")
        if exe is None:
            self.skip_reason = ("redis-server not found on PATH; Redis rows skipped "
                                "(install it, e.g. `apt-get install -y redis-server`)")
            return
        try:
            import redis
            from redis.utils import HIREDIS_AVAILABLE
        except ImportError:
            self.skip_reason = "redis-py not installed (pip install 'redis>=5' hiredis); Redis rows skipped"
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.hiredis = bool(HIREDIS_AVAILABLE)
        # 1 MiB socket reads: GET of large values runs ~1.5x faster than with redis-py's 64 KiB
        # default here, so Redis is compared at its better setting.
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=120,
                                  socket_read_size=REDIS_READ_SIZE)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    self.skip_reason = "redis-server did not start; Redis rows skipped"
                    return
                time.sleep(0.05)
        self.version = self.client.info("server").get("redis_version", "")

    @property
    def ok(self) -> bool:
        return self.proc is not None and not self.skip_reason

    def close(self) -> None:
        if self.proc is None:
            return
        # SIGTERM, not SHUTDOWN over the client: redis-py retries a connection that SHUTDOWN
        # closes, with back-off (seconds), and a retry could reach another server that took
        # the port meanwhile. With saving off, SIGTERM exits at once.
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def timed(fn: Callable[[], Any], reps: int, warmup: int, before: Callable[[], Any] | None = None,
          after: Callable[[], Any] | None = None) -> list[float]:
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if after is not None:
            after()
        if i >= warmup:
            times.append(dt)
    return times


def latencies(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def touch(ts: Sequence[torch.Tensor]) -> None:
    for t in ts:
        t.fill_(0)


def same(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"
