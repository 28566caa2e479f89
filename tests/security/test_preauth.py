"""Attack: large requests without a token (issue F7). The token is checked before the
daemon reads a request, so token-less callers cannot make it buffer their bytes."""

from __future__ import annotations

import threading
from typing import Callable

import grpc
import pytest

from kvpark.daemon.server import Daemon, max_request_bytes
from kvpark.proto import GRPC_OPTIONS
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import Proc
from ..daemon.test_tenants import TOKENS, _sha, tenants

MiB = 1 << 20
CALLS = 12
SIZE = 20 * MiB  # under the daemon's largest request at the default chunk size: the token is what refuses it


def _peak_rss(pid: int) -> int:
    """The process's peak resident set so far (VmHWM), in bytes: never goes down."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def test_unauthenticated_large_calls_never_make_the_daemon_buffer_them(proc: Callable[..., Proc]) -> None:
    assert SIZE < max_request_bytes(1 << 20)
    p = proc("--set", f"tenants.alice.token_sha256={_sha(TOKENS['alice'])}")
    payload = b"\x5a" * SIZE
    big = {
        "ParkSmall": pb.ParkSmallRequest(header=pb.ParkHeader(seq_id="x", nbytes=SIZE, tensors=[
            pb.TensorMeta(dtype="uint8", shape=[SIZE], nbytes=SIZE)]), data=payload).SerializeToString(),
        "Lookup": pb.LookupRequest(seq_ids=["k" * 200] * (SIZE // 203)).SerializeToString(),
    }
    ident = lambda b: b  # noqa: E731 - the bytes as built
    with grpc.insecure_channel(p.address, options=GRPC_OPTIONS) as ch:
        hello = ch.unary_unary("/kvpark.v1.KVPark/Hello", request_serializer=ident, response_deserializer=ident)
        hello(b"", metadata=[("authorization", f"Bearer {TOKENS['alice']}")], timeout=30)  # warm
        before = _peak_rss(p.popen.pid)
        codes: list[grpc.StatusCode] = []
        lock = threading.Lock()

        def attack(name: str) -> None:
            stub = ch.unary_unary(f"/kvpark.v1.KVPark/{name}", request_serializer=ident, response_deserializer=ident)
            try:
                stub(big[name], timeout=60)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            with lock:
                codes.append(code)

        threads = [threading.Thread(target=attack, args=("ParkSmall" if i % 2 else "Lookup",))
                   for i in range(CALLS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        grew = _peak_rss(p.popen.pid) - before
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * CALLS
    # The calls carried CALLS * SIZE = 240 MiB; a daemon that read them before the token
    # check peaks hundreds of MiB higher. What HTTP/2 flow control lets in is far less.
    assert grew < 64 * MiB, f"daemon's peak RSS grew by {grew / MiB:.0f} MiB for token-less calls"
    assert p.popen.poll() is None


def test_a_request_larger_than_any_control_call_needs_is_refused_whole(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants())
    limit = max_request_bytes(d.config.server.chunk_size)
    n = limit + MiB  # still under what a client may send (64 MiB)
    req = pb.ParkSmallRequest(header=pb.ParkHeader(seq_id="big", nbytes=n, tensors=[
        pb.TensorMeta(dtype="uint8", shape=[n], nbytes=n)]), data=b"\0" * n)
    with grpc.insecure_channel(d.address, options=GRPC_OPTIONS) as ch:
        stub = ch.unary_unary("/kvpark.v1.KVPark/ParkSmall", request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            stub(req, metadata=[("authorization", f"Bearer {TOKENS['alice']}")], timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert d.engine is not None and d.engine.list() == []
