"""Transfers cut short: a daemon that dies (SIGKILL) or a connection that closes
mid-stream is a typed ``Unavailable`` on every transfer kind, never partial bytes handed
over as the whole; a peer that goes quiet ends by the transfer's deadline.

The data channel is exercised two ways: against a real ``kvpark serve`` process killed
mid-restore, and against a peer on a loopback socket that speaks the channel's frames
(``kvpark.proto.dataframe``) and stops where the test says, which no real daemon can be
made to do on cue.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Iterator

import pytest
import torch

from kvpark.client import Client
from kvpark.client.datachannel import DataChannel
from kvpark.proto.dataframe import CHUNK, GET, MAGIC, PUT, REQUEST, VERSION, recv_exact, status_bytes
from kvpark.proto.errors import DeadlineExceeded, Unavailable
from kvpark.proto.v1 import kvpark_pb2 as pb
from ..conftest import Proc, wait_until

MIB = 1 << 20
TOKEN = bytes(16)


# ---------------------------------------------------------------------- a real daemon killed mid-restore

# 64 tensors of 1 MiB: far more than the socket and gRPC buffers hold, so after the first
# tensor has landed the daemon is still sending when it is killed.
MANY = [torch.full((MIB // 4,), float(i)) for i in range(64)]


@pytest.mark.parametrize("into", [False, True], ids=["new", "into"])
@pytest.mark.parametrize("path", ["data_channel", "grpc_stream"])
def test_a_daemon_killed_mid_restore_is_unavailable_never_partial(proc: Callable[..., Proc], path: str,
                                                                   into: bool) -> None:
    # 1. A daemon process (the data channel on or off) holding 64 MiB in memory.
    args = ["--set", "tiers.host.capacity=256MiB"]
    if path == "grpc_stream":
        args += ["--set", "server.data_channel=false"]
    p = proc(*args)
    with Client(p.address, transport="inline") as c:
        assert (c._transport.channel is not None) == (path == "data_channel")  # type: ignore[attr-defined]
        c.park("a", MANY)
        outs = [torch.zeros_like(t) for t in MANY] if into else None
        # 2. A layer-wise restore: the first tensor lands, then the daemon is killed.
        r = c.restore("a", into=outs, layerwise=True)
        i, first = next(r)
        assert i == 0 and torch.equal(first, MANY[0])
        p.kill()
        # 3. The rest of the restore raises, typed; not every tensor is handed over.
        handed = [0]
        with pytest.raises(Unavailable):
            for i, _ in r:
                handed.append(i)
        assert len(handed) < len(MANY)


# ---------------------------------------------------------------------- a scripted peer

class Peer:
    """One data-channel connection on a loopback port, served by ``script(conn)``.
    ``release`` ends a script that waits (a peer that went quiet)."""

    def __init__(self, script: Callable[[socket.socket, threading.Event], None]) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.release = threading.Event()
        self.done = threading.Event()
        self.errors: list[BaseException] = []

        def serve() -> None:
            conn, _ = self.srv.accept()
            try:
                script(conn, self.release)
            except OSError as e:  # the client gave up first: fine, recorded for the curious
                self.errors.append(e)
            finally:
                conn.close()
                self.done.set()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def channel(self) -> DataChannel:
        port = self.srv.getsockname()[1]
        return DataChannel(pb.DataChannelInfo(address=f"127.0.0.1:{port}"), "127.0.0.1:1")

    def close(self) -> None:
        self.release.set()
        self.thread.join(10)
        self.srv.close()


@pytest.fixture
def peer() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def start(script: Callable[[socket.socket, threading.Event], None]) -> Peer:
        made.append(Peer(script))
        return made[-1]

    yield start
    for p in made:
        p.close()


def _request(conn: socket.socket, op: int) -> int:
    magic, version, got_op, _token, nbytes = REQUEST.unpack(recv_exact(conn, REQUEST.size))
    assert (magic, version, got_op) == (MAGIC, VERSION, op)
    return nbytes


def _chunks(conn: socket.socket, n: int) -> None:
    for k in range(n):
        conn.sendall(CHUNK.pack(MIB) + bytes([k + 1]) * MIB)


def _get(dc: DataChannel, nbytes: int, handed: list[int], timeout: float = 30.0) -> None:
    """A GET into 1 MiB buffers; ``handed`` collects the indices handed over."""
    bufs = [bytearray(MIB) for _ in range(nbytes // MIB)]
    sock = dc.connect()
    try:
        for i in dc.get(sock, TOKEN, nbytes, [memoryview(b) for b in bufs], timeout):
            handed.append(i)
    finally:
        dc.discard(sock)


# What a peer sends for a 4 MiB GET before it closes the connection.
GET_CUT = {
    "before_the_status": lambda c: None,
    "after_the_status": lambda c: c.sendall(status_bytes(None)),
    "mid_chunk": lambda c: (c.sendall(status_bytes(None)), _chunks(c, 1), c.sendall(CHUNK.pack(MIB) + b"x" * 1000)),
    "between_chunks": lambda c: (c.sendall(status_bytes(None)), _chunks(c, 2)),
    "before_the_closing_status": lambda c: (c.sendall(status_bytes(None)), _chunks(c, 4)),
}


@pytest.mark.parametrize("where", GET_CUT)
def test_a_get_cut_short_is_unavailable_and_hands_over_no_unfilled_buffer(peer, where: str) -> None:
    def script(conn: socket.socket, release: threading.Event) -> None:
        assert _request(conn, GET) == 4 * MIB
        GET_CUT[where](conn)

    p = peer(script)
    handed: list[int] = []
    with pytest.raises(Unavailable):
        _get(p.channel(), 4 * MIB, handed)
    # Only buffers that were filled whole were handed over; never the one cut short.
    full = {"mid_chunk": 1, "between_chunks": 2, "before_the_closing_status": 4}.get(where, 0)
    assert handed == list(range(full))


def test_a_put_cut_short_is_unavailable(peer) -> None:
    def script(conn: socket.socket, release: threading.Event) -> None:
        _request(conn, PUT)
        recv_exact(conn, CHUNK.size + MIB)  # one chunk of eight, then the connection ends

    p = peer(script)
    dc = p.channel()
    sock = dc.connect()
    data = torch.zeros(8 * MIB, dtype=torch.uint8)
    with pytest.raises(Unavailable):
        dc.put(sock, TOKEN, [memoryview(data.numpy())], 8 * MIB, 30.0)
    dc.discard(sock)


def test_a_put_whose_status_never_comes_is_unavailable(peer) -> None:
    def script(conn: socket.socket, release: threading.Event) -> None:
        n = _request(conn, PUT)
        recv_exact(conn, CHUNK.size + n)  # every byte, then closed with no answer

    p = peer(script)
    dc = p.channel()
    sock = dc.connect()
    data = torch.zeros(MIB, dtype=torch.uint8)
    with pytest.raises(Unavailable):
        dc.put(sock, TOKEN, [memoryview(data.numpy())], MIB, 30.0)
    dc.discard(sock)


# ---------------------------------------------------------------------- a peer gone quiet

def test_a_get_from_a_quiet_peer_ends_by_its_deadline(peer) -> None:
    def script(conn: socket.socket, release: threading.Event) -> None:
        _request(conn, GET)
        conn.sendall(status_bytes(None))
        _chunks(conn, 1)
        release.wait(60)  # then nothing: frozen mid-stream

    p = peer(script)
    with pytest.raises(DeadlineExceeded):
        _get(p.channel(), 4 * MIB, [], timeout=1.0)


def test_a_put_to_a_quiet_peer_ends_by_its_deadline(peer) -> None:
    def script(conn: socket.socket, release: threading.Event) -> None:
        _request(conn, PUT)
        release.wait(60)  # reads nothing more: the client's sends fill the buffers and stall

    p = peer(script)
    dc = p.channel()
    sock = dc.connect()
    data = torch.zeros(64 * MIB, dtype=torch.uint8)
    with pytest.raises(DeadlineExceeded):
        dc.put(sock, TOKEN, [memoryview(data.numpy())], 64 * MIB, 1.0)
    dc.discard(sock)


def test_a_get_deadline_bounds_the_whole_transfer_not_each_read(peer) -> None:
    """Bytes that keep coming do not extend a transfer past its deadline: the deadline is
    the transfer's, not a fresh timeout for every read."""
    go = threading.Event()

    def script(conn: socket.socket, release: threading.Event) -> None:
        _request(conn, GET)
        conn.sendall(status_bytes(None))
        _chunks(conn, 1)
        go.wait(60)
        _chunks(conn, 1)  # the rest, promptly, but after the transfer's deadline
        conn.sendall(status_bytes(None))

    p = peer(script)
    dc = p.channel()
    sock = dc.connect()
    bufs = [bytearray(MIB), bytearray(MIB)]
    timeout = 1.0
    start = time.monotonic()
    got = dc.get(sock, TOKEN, 2 * MIB, [memoryview(b) for b in bufs], timeout)
    assert next(got) == 0
    # The first chunk came in time; the second is sent only once the deadline has passed.
    assert wait_until(lambda: time.monotonic() > start + timeout + 0.2, timeout=timeout + 5)
    go.set()
    with pytest.raises(DeadlineExceeded):
        next(got)
    dc.discard(sock)
