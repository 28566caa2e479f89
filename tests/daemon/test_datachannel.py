"""The data channel: inline bulk bytes on a raw socket, its fallback, and every bad input.

A real daemon on port 0 serves both gRPC and its data channel; the client side is the
real ``client/datachannel.py``, or a raw socket where the test plays a broken client.
"""

from __future__ import annotations

import socket
import struct
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.client.client import _header
from kvpark.daemon import datachannel
from kvpark.daemon.server import Daemon
from kvpark.proto.dataframe import CHUNK, GET, MAGIC, MAX_FRAME, PUT, REQUEST, VERSION, parse_address, read_status
from kvpark.proto.errors import (DataLoss, InvalidArgument, KVParkError, LeaseExpired, Unauthenticated)
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import wait_until

MiB = 1 << 20


def mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(3, 1000, 17, generator=g).to(torch.bfloat16),
        torch.randint(-100, 100, (2, 3, 4), dtype=torch.int8, generator=g),
        torch.randn(0, 5, generator=g),
        torch.randn(300_001, generator=g, dtype=torch.float64),
        torch.randint(0, 2, (7,), generator=g).bool(),
        torch.randn(5, 5, generator=g)[:, 1],  # not contiguous
    ]


def settled(d: Daemon) -> None:
    """Nothing leaked: every lease ends (at once, or by TTL), accounting agrees."""
    assert d.engine is not None
    assert wait_until(lambda: d.engine.stat().leases == 0, timeout=10.0)
    d.engine.check_invariants()


# Frame sizes (the client's PUT frames, the daemon's GET chunks) that line up with the
# 1 MiB slots, and two that do not: a frame then starts and ends inside a slot, and the
# channel must carry its place in the slot (and in the allocation) from frame to frame.
FRAMES = [pytest.param(None, id="default"), pytest.param(1_000_003, id="prime"),
          pytest.param(65_537, id="small-odd")]


def odd_frames(c: Client, monkeypatch: pytest.MonkeyPatch, frame: int | None) -> None:
    """The real client and daemon, framing the payload in ``frame``-byte pieces."""
    channel = c._transport.channel  # type: ignore[attr-defined]
    assert channel is not None
    if frame is not None:
        monkeypatch.setattr(channel, "max_frame", frame)
        monkeypatch.setattr(datachannel, "GET_CHUNK", frame)


def odd_sized(seed: int) -> list[torch.Tensor]:
    """Tensors of odd byte sizes, none a multiple of a slot or of a tail granule."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (1_048_579,), dtype=torch.uint8, generator=g),
            torch.randn(3, 7, 11, generator=g).to(torch.float16),
            torch.randint(-9, 9, (333_337,), dtype=torch.int8, generator=g),
            torch.randn(77_777, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("frame", FRAMES)
def test_inline_round_trips_over_the_data_channel(daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch,
                                                  frame: int | None) -> None:
    d = daemon(**{"tiers.host.capacity": "32MiB"})
    assert d.datachannel is not None
    ts = mixed()
    with Client(d.address, transport="inline") as c:
        odd_frames(c, monkeypatch, frame)
        info = c.park("m", ts)
        assert [tuple(m.shape) for m in info.tensors] == [tuple(t.shape) for t in ts]
        before = d.datachannel.transfers
        out = c.restore("m")
        for a, b in zip(ts, out):
            assert a.dtype == b.dtype and torch.equal(a, b)
        into = [torch.full_like(t, 3) for t in ts]
        c.restore("m", into=into)
        for a, b in zip(ts, into):
            assert torch.equal(a, b)
        # Layer-wise: each tensor as it lands, in order.
        r = c.restore("m", layerwise=True)
        assert [i for i, _ in r] == list(range(len(ts)))
        # into_flat: the whole payload in one caller buffer.
        flat = torch.zeros(info.nbytes, dtype=torch.uint8)
        c.restore_many(["m"], into_flat=flat)
        assert torch.equal(flat, torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in ts]))
        # Many same-shaped tensors (the compact tensor list) and several ids at once.
        many = [torch.randint(0, 255, (64, 1024), dtype=torch.uint8) for _ in range(40)]
        c.park("n", many)
        _, both = c.restore_many(["m", "n"])
        assert all(torch.equal(a, b) for a, b in zip(ts + many, both))
        # Counted by the daemon after its last send: the client may be done first.
        assert wait_until(lambda: d.datachannel.transfers >= before + 5)
    settled(d)


@pytest.mark.parametrize("frame", FRAMES)
def test_prefix_parks_with_odd_sized_blocks_round_trip_over_the_data_channel(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch, frame: int | None) -> None:
    """A park's payload is its new blocks, then its own tensors, each allocation its own
    slots and packed tail: frames that cross from one allocation to the next, mid-slot,
    land each byte where its block's record says."""
    d = daemon(**{"tiers.host.capacity": "32MiB"})
    b1, b2, b3, own1, own2 = (odd_sized(s) for s in range(5))
    with Client(d.address, transport="inline") as c:
        odd_frames(c, monkeypatch, frame)
        before = d.datachannel.transfers  # type: ignore[union-attr]
        c.park("p1", own1, refs=["B1", "B2"], new_blocks={"B1": b1, "B2": b2})
        # B1 exists by now: its bytes are sent again and discarded; B3 is new.
        c.park("p2", own2, refs=["B1", "B3"], new_blocks={"B1": b1, "B3": b3})
        for sid, want in (("p1", b1 + b2 + own1), ("p2", b1 + b3 + own2), ("B3", b3)):
            got = c.restore(sid)
            assert len(got) == len(want)
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got)), sid
        _, both = c.restore_many(["p1", "B2", "p2"])
        assert all(torch.equal(a, b) for a, b in zip(b1 + b2 + own1 + b2 + b1 + b3 + own2, both))
        assert wait_until(lambda: d.datachannel.transfers >= before + 6)  # type: ignore[union-attr]
    settled(d)


def test_fallback_to_grpc_when_off_or_refused(daemon: Callable[..., Daemon]) -> None:
    # 1. Turned off: Hello offers no channel; inline moves the bytes on gRPC streams.
    off = daemon(**{"server.data_channel": False})
    assert off.datachannel is None
    big = [torch.randn(700_000)]
    with Client(off.address, transport="inline") as c:
        assert c._transport.channel is None  # type: ignore[attr-defined]
        c.park("a", big)
        assert torch.equal(c.restore("a")[0], big[0])
    settled(off)
    off.stop()
    # 2. Offered but refused (the socket is gone): the same calls succeed over gRPC.
    on = daemon()
    assert on.datachannel is not None
    with Client(on.address, transport="inline") as c:
        on.datachannel.stop()
        c.park("b", big)
        assert torch.equal(c.restore("b")[0], big[0])
        assert on.datachannel.transfers == 0
    settled(on)


# ---------------------------------------------------------------------- bad input

def raw(d: Daemon) -> socket.socket:
    assert d.datachannel is not None
    family, addr = parse_address(d.datachannel.address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(addr)
    return s


def reserve(c: Client, sid: str, ts: list[torch.Tensor]) -> pb.ReserveResponse:
    return c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=_header(sid, ts), tier="host", data_channel=True))


def status(s: socket.socket) -> KVParkError | None:
    return read_status(s)


def test_bad_tokens_are_typed_and_leak_nothing(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"leases.ttl_s": 1.0})
    ts = [torch.randn(300_000)]
    nbytes = ts[0].numel() * 4
    with Client(d.address, transport="inline") as c:
        dc = c._transport.channel  # type: ignore[attr-defined]
        # 1. A token nobody issued: Unauthenticated, through the real client code.
        sock = dc.connect()
        with pytest.raises(Unauthenticated):
            dc.put(sock, b"\0" * 16, [memoryview(ts[0].numpy()).cast("B")], nbytes, 5.0)
        dc.discard(sock)
        # 2. A token used twice: the second use is refused; the first park stands.
        r = reserve(c, "once", ts)
        sock = dc.connect()
        dc.put(sock, r.token, [memoryview(ts[0].numpy()).cast("B")], nbytes, 5.0)
        dc.done(sock)
        sock = dc.connect()
        with pytest.raises(Unauthenticated):
            dc.put(sock, r.token, [memoryview(ts[0].numpy()).cast("B")], nbytes, 5.0)
        dc.discard(sock)
        c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
        assert torch.equal(c.restore("once")[0], ts[0])
        # 3. An expired token: its reservation expires with it (freed by the lease TTL);
        #    presenting it then is typed (the token expired, or its lease did).
        r = reserve(c, "late", ts)
        assert wait_until(lambda: d.engine.stat().leases == 0)
        sock = dc.connect()
        with pytest.raises((Unauthenticated, LeaseExpired)):
            dc.put(sock, r.token, [memoryview(ts[0].numpy()).cast("B")], nbytes, 5.0)
        dc.discard(sock)
        # 4. A PUT token presented for a GET: typed, and its reservation is aborted.
        r = reserve(c, "wrong-op", ts)
        s = raw(d)
        s.sendall(REQUEST.pack(MAGIC, VERSION, GET, r.token, nbytes))
        assert isinstance(status(s), InvalidArgument)
        s.close()
        with pytest.raises(LeaseExpired):
            c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
        # 5. A GET token presented again after its transfer: refused, the lease is gone.
        a = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="once", tier="host", data_channel=True))
        sock = dc.connect()
        got = list(dc.get(sock, a.token, nbytes, [memoryview(bytearray(nbytes))], 5.0))
        assert got == [0]
        dc.done(sock)
        sock = dc.connect()
        with pytest.raises(Unauthenticated):
            list(dc.get(sock, a.token, nbytes, [memoryview(bytearray(nbytes))], 5.0))
        dc.discard(sock)
        assert c.present(["late", "wrong-op"]) == [False, False]
    settled(d)


@pytest.mark.parametrize("case", ["short_read", "oversized_frame", "empty_frame", "overrun", "wrong_size",
                                  "bad_magic", "commit_before_all_bytes"])
def test_broken_puts_are_typed_and_abort_the_reservation(daemon: Callable[..., Daemon], case: str) -> None:
    # bad_magic: the token is never read, so only the lease TTL frees that reservation.
    d = daemon(**({"leases.ttl_s": 1.5} if case == "bad_magic" else {}))
    ts = [torch.randn(600_000)]  # 2.4 MB: three slots
    data = ts[0].numpy().tobytes()
    n = len(data)
    with Client(d.address, transport="inline") as c:
        r = reserve(c, "x", ts)
        s = raw(d)
        head = REQUEST.pack(MAGIC, VERSION, PUT, r.token, n)
        expect: type[KVParkError] | None = InvalidArgument
        if case == "short_read":
            s.sendall(head + CHUNK.pack(n) + data[: n // 2])
            s.close()  # gone mid-transfer: no status to read
            expect = None
        elif case == "oversized_frame":
            s.sendall(head + CHUNK.pack(MAX_FRAME + 1))
        elif case == "empty_frame":
            s.sendall(head + CHUNK.pack(0))
        elif case == "overrun":
            s.sendall(head + CHUNK.pack(n + 1))
        elif case == "wrong_size":
            s.sendall(REQUEST.pack(MAGIC, VERSION, PUT, r.token, n - 1))
        elif case == "bad_magic":
            s.sendall(REQUEST.pack(b"HTTP", VERSION, PUT, r.token, n))
        elif case == "commit_before_all_bytes":
            s.sendall(head + CHUNK.pack(n // 2) + data[: n // 2])
            # The half that came cannot be published: commit demands every byte.
            assert wait_until(lambda: d.engine.leases.get_write(r.lease_id).received == n // 2)
            with pytest.raises(InvalidArgument, match="commit after"):
                c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
            s.close()
            expect = None
        if expect is not None:
            err = status(s)
            assert isinstance(err, expect), err
            s.close()
        # The reservation is gone (aborted by the channel, by the failed commit, or
        # expired): a commit now is typed, never a publish of half-written slots.
        if case != "commit_before_all_bytes":
            assert wait_until(lambda: d.engine.stat().leases == 0)
            with pytest.raises(LeaseExpired):
                c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
        assert c.present(["x"]) == [False]
        # The daemon is up and the same client parks over the channel again.
        c.park("y", ts)
        assert torch.equal(c.restore("y")[0], ts[0])
    settled(d)


def test_reader_that_vanishes_mid_get_frees_its_lease(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    ts = [torch.randn(1_500_000)]  # 6 MB: more than one outgoing chunk
    n = ts[0].numel() * 4
    with Client(d.address, transport="inline") as c:
        c.park("r", ts)
        a = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="r", tier="host", data_channel=True))
        assert d.engine.stat().leases == 1
        s = raw(d)
        s.sendall(REQUEST.pack(MAGIC, VERSION, GET, a.token, n))
        assert status(s) is None
        s.recv(1000)
        s.close()
        settled(d)
        # A restore whose consumer stops after the first tensor closes the connection;
        # the daemon ends that lease too, and the next restore is whole.
        many = [torch.randn(500_000) for _ in range(4)]
        c.park("m", many)
        it = c.restore("m", layerwise=True)
        next(it)
        it.close()
        out = c.restore("m")
        assert all(torch.equal(x, y) for x, y in zip(many, out))
        # A GET that asks for the wrong size is refused before any byte moves.
        a = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="r", tier="host", data_channel=True))
        s = raw(d)
        s.sendall(REQUEST.pack(MAGIC, VERSION, GET, a.token, n + 1))
        assert isinstance(status(s), InvalidArgument)
        s.close()
    settled(d)


def test_a_short_get_is_data_loss_on_the_client(daemon: Callable[..., Daemon]) -> None:
    """The client counts what arrives: a stream that ends early is DataLoss, never a
    partly filled tensor handed back as if whole."""
    d = daemon()
    ts = [torch.randn(1_000_000)]
    with Client(d.address, transport="inline") as c:
        c.park("s", ts)
        dc = c._transport.channel  # type: ignore[attr-defined]
        a = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="s", tier="host", data_channel=True))
        n = ts[0].numel() * 4
        sock = dc.connect()
        # Ask for more than the lease serves: the daemon refuses (typed) before any byte.
        with pytest.raises(InvalidArgument):
            list(dc.get(sock, a.token, n * 2, [memoryview(bytearray(n * 2))], 5.0))
        dc.discard(sock)
    settled(d)


def test_frames_module_round_trips_status() -> None:
    a, b = socket.socketpair()
    from kvpark.proto.dataframe import status_bytes
    a.sendall(status_bytes(DataLoss("checksum")) + status_bytes(None))
    e = read_status(b)
    assert isinstance(e, DataLoss) and e.message == "checksum"
    assert read_status(b) is None
    a.close()
    b.close()
    assert struct.calcsize("<4sBB16sQ") == REQUEST.size


@pytest.mark.parametrize("form", ["absolute", "relative"])
def test_a_unix_socket_daemon_gets_a_unix_data_channel_beside_it(daemon: Callable[..., Daemon], tmp_path,
                                                                 monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    sock = tmp_path / "kv.sock"
    if form == "relative":
        monkeypatch.chdir(tmp_path)
    d = daemon(**{"server.listen": f"unix://{sock}" if form == "absolute" else "unix:kv.sock"})
    # Next to the gRPC socket (a relative one never lands at the file system's root),
    # advertised absolute.
    assert d.datachannel is not None and d.datachannel.address == f"unix:{sock}.data"
    ts = [torch.randn(400_000)]
    with Client(d.address, transport="inline") as c:
        c.park("u", ts)
        assert torch.equal(c.restore("u")[0], ts[0])
        assert wait_until(lambda: d.datachannel.transfers == 2)
    d.stop()
    assert not (tmp_path / "kv.sock.data").exists()


def test_a_restore_served_from_disk_streams_from_the_records(daemon: Callable[..., Daemon], tmp_path) -> None:
    """No promotion wanted: the channel sends the verified disk records themselves, with
    no lease to hold, and nothing is left behind."""
    over = {"policy.promote_on_restore": False}
    d = daemon(**over)
    ts = [torch.randn(700_000), torch.randint(0, 9, (3, 5), dtype=torch.int32)]
    with Client(d.address, transport="inline") as c:
        c.park("disk", ts)
        c.park("bad", ts)
    d.stop()  # flushes to disk; the restart below starts with the host tier empty
    # A flipped byte in the second record of "bad": found mid-stream, after a first chunk.
    import lmdb

    from kvpark.tiers.disk import HEADER, Manifest, block_key

    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4)
    blocks, manifests = env.open_db(b"blocks"), env.open_db(b"manifests")
    with env.begin(write=True) as txn:
        m = Manifest.decode(txn.get(b"bad", db=manifests))
        key = block_key("bad", m.gen, 1)
        raw = bytearray(txn.get(key, db=blocks))
        raw[HEADER.size + 1000] ^= 0x40
        txn.put(key, bytes(raw), db=blocks)
    env.close()
    d = daemon(**over)
    with Client(d.address, transport="inline") as c:
        assert c.info("disk").tier == "disk"
        out = c.restore("disk")
        assert all(torch.equal(a, b) for a, b in zip(ts, out))
        assert d.datachannel is not None and wait_until(lambda: d.datachannel.transfers == 1)
        # The daemon's error mid-stream comes back typed, with its reason.
        with pytest.raises(DataLoss, match="checksum"):
            c.restore("bad")
        # A restore that returned (or raised) has ended its lease: the daemon's side of a
        # GET ends it as the error goes out, which a busy machine may see a moment later.
        assert wait_until(lambda: c.stat().leases == 0)
        assert all(torch.equal(a, b) for a, b in zip(ts, c.restore("disk")))
    settled(d)


# ---------------------------------------------------------------------- TLS and tenants


def test_a_client_that_gives_tls_only_a_ca_moves_its_bytes_over_the_tls_channel(daemon: Callable[..., Daemon],
                                                                              tmp_path) -> None:
    """Server-side TLS only (no client certificates): a client that gives only a CA still
    builds a TLS context for the data channel, rather than falling back to gRPC streams."""
    from ..certs import make_pki

    pki = make_pki(tmp_path / "pki")
    d = daemon(**{"server.tls_cert": pki.server_cert, "server.tls_key": pki.server_key})
    assert d.datachannel is not None and d.datachannel.tls
    x = [torch.randn(600_000)]
    before = d.datachannel.transfers
    with Client(d.address, tls_ca=pki.ca, transport="inline") as c:
        assert c.server.data_channel.tls
        c.park("s", x)
        assert torch.equal(c.restore("s")[0], x[0])
        assert wait_until(lambda: d.datachannel.transfers == before + 2)  # both over the TLS channel
    settled(d)

def test_the_channel_speaks_tls_when_grpc_does_and_carries_the_tenant(daemon: Callable[..., Daemon],
                                                                      tmp_path) -> None:
    from ..certs import make_pki

    pki = make_pki(tmp_path / "pki")
    # mTLS and a tenant, off loopback (the one way such a daemon starts): the channel takes
    # the same certificate and requires a client certificate too.
    d = daemon(**{"server.listen": "0.0.0.0:0", "server.tls_cert": pki.server_cert,
                  "server.tls_key": pki.server_key, "server.tls_client_ca": pki.ca,
                  "tenants.alice.token_sha256": __import__("hashlib").sha256(b"tok").hexdigest()})
    assert d.datachannel is not None and d.datachannel.tls
    addr = d.address.replace("0.0.0.0", "127.0.0.1")
    x = [torch.randn(600_000)]
    with Client(addr, token="tok", tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as c:
        assert c.transport == "inline" and c.server.data_channel.tls
        c.park("s", x)
        assert torch.equal(c.restore("s")[0], x[0])
        assert wait_until(lambda: d.datachannel.transfers == 2)  # both over the TLS channel
        assert c.present(["s"]) == [True]
    # A plaintext peer on the TLS channel gets nowhere, and the daemon serves on.
    family, a = parse_address(d.datachannel.address.replace("0.0.0.0", "127.0.0.1"))
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(a)
    s.sendall(REQUEST.pack(MAGIC, VERSION, GET, b"\0" * 16, 8))
    try:
        got = s.recv(100)
    except ConnectionResetError:
        got = b""
    assert got == b"" or got[:1] == b"\x15"  # closed, or a TLS alert: never a plaintext answer
    s.close()
    with Client(addr, token="tok", tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as c:
        assert torch.equal(c.restore("s")[0], x[0])
    settled(d)
