"""Malformed requests straight at every RPC, over the raw gRPC channel (never the client).

Hypothesis generates, per RPC of ``kvpark.v1.KVPark``:
- random and truncated bytes (a valid message cut short, or noise);
- messages whose fields carry the wrong wire type (a string field sent as a varint, ...);
- well-typed but hostile requests: ids with odd characters and lengths, huge declared
  sizes and shapes, unknown dtypes, wrong lease ids, wrong layout fingerprints;
- ``Park`` streams whose chunks come out of order, overlap, overrun or stop short;
- nearly valid parks (``ParkSmall``, ``Park``, ``Reserve``+``Commit``): right but for one
  thing (a size off by one, a reference to a missing or non-shared block, a block that
  references, a batch with tensors), so the commit paths run too.

Every call must end within its deadline with OK or a *typed* status: a code the daemon
maps its errors to, with the error's class name in the trailing metadata (so never
UNKNOWN, never an untyped INTERNAL, never DEADLINE_EXCEEDED = a hang). Afterwards the
daemon still answers, and ``Engine.check_invariants()`` holds.

The number of examples is bounded for CI: ``KVPARK_FUZZ_EXAMPLES`` (default 1000) in all,
split over the tests below; raise it for a long run (docs/testing.md).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from google.protobuf import descriptor, message_factory
from hypothesis import strategies as st

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto import GRPC_OPTIONS
from kvpark.proto.errors import ERROR_KEY, KVParkError
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import encode_chunk

from ..conftest import make_config, wait_until

SERVICE = "/kvpark.v1.KVPark/"
EXAMPLES = int(os.environ.get("KVPARK_FUZZ_EXAMPLES", "1000"))
DEADLINE_S = 20.0  # per call; generous for two busy cores: a call past it is a hang

# Every RPC of the service, read from the proto: one added later is fuzzed too (by the
# generic strategy until it gets one of its own below).
METHODS = {m.name: m for m in pb.DESCRIPTOR.services_by_name["KVPark"].methods}
ALL_RPCS = sorted(METHODS)

# Every code a KVParkError maps to, except the ones no malformed request may produce:
# INTERNAL (an unexpected exception: a bug), DATA_LOSS (nothing here is corrupt),
# UNAVAILABLE (the daemon is not shutting down).
TYPED = {cls.code for cls in KVParkError.__subclasses__()} | {
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT}
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
             grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def per_test(share: float) -> settings:
    return settings(
        max_examples=max(5, int(EXAMPLES * share)),
        deadline=None,  # wall-clock limits are the call deadlines', not Hypothesis'
        database=None,  # no .hypothesis directory in the checkout
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture],
    )


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    # Short leases: reservations the fuzzer opens and never commits expire between examples.
    d = Daemon(make_config(tmp, **{"leases.ttl_s": "1.0", "tiers.disk.capacity": "64MiB"})).start()
    with Client(d.address) as c:  # something real to aim at: a plain sequence and a shared block
        c.park("real", [torch.arange(4096, dtype=torch.float32)], attrs={"layout": "L1"})
        c.park("keep", [torch.arange(999, dtype=torch.int16)])  # an id no strategy names
        c.park("user", [torch.ones(100, dtype=torch.int8)], refs=["blk"],
               new_blocks={"blk": [torch.zeros(300, dtype=torch.int8)]})
    yield d
    d.stop(0.5)


@pytest.fixture(scope="module")
def channel(fuzz_daemon: Daemon) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(fuzz_daemon.address, options=GRPC_OPTIONS)
    yield ch
    ch.close()


def call(ch: grpc.Channel, rpc: str, payload: bytes | list[bytes]) -> None:
    """Send raw bytes to ``rpc``; assert the outcome is OK or a typed status, in time."""
    try:
        if rpc == "Park":
            msgs = payload if isinstance(payload, list) else [payload]
            ch.stream_unary(SERVICE + rpc)(iter(msgs), timeout=DEADLINE_S)
        elif rpc == "Restore":
            assert isinstance(payload, bytes)
            for _ in ch.unary_stream(SERVICE + rpc)(payload, timeout=DEADLINE_S):
                pass
        else:
            assert isinstance(payload, bytes)
            ch.unary_unary(SERVICE + rpc)(payload, timeout=DEADLINE_S)
    except grpc.RpcError as e:
        code = e.code()
        assert code not in FORBIDDEN, f"{rpc}: {code.name}: {e.details()}"
        assert code in TYPED, f"{rpc}: untyped {code.name}: {e.details()}"
        names = [v for k, v in (e.trailing_metadata() or ()) if k == ERROR_KEY]
        assert names, f"{rpc}: {code.name} without an error class in trailing metadata: {e.details()}"


# ------------------------------------------------------------------ strategies


def text(**kw: int) -> st.SearchStrategy[str]:
    # Any code point protobuf can encode: lone surrogates cannot be sent at all (invalid
    # UTF-8 on the wire is the noise tests' job).
    return st.text(alphabet=st.characters(codec="utf-8"), **kw)


odd_ids = st.one_of(
    text(min_size=0, max_size=40),  # any code point, control characters and empty included
    st.text(alphabet=st.characters(min_codepoint=0x80, codec="utf-8"), min_size=1, max_size=10),
    st.integers(0, 3000).map(lambda n: "x" * n),  # around and far past the length limit
    st.sampled_from(["real", "user", "blk", "missing", "real\x00", "../real", " real", "real\n"]),
)
lease_ids = st.one_of(text(max_size=64), st.binary(max_size=32).map(lambda b: b.hex()))
huge = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**31, 2**32, 2**63, 2**64 - 1]))
dtypes = st.one_of(st.sampled_from(["float32", "bfloat16", "int8", "uint8", "float16"]), text(max_size=12))
tensor_metas = st.builds(
    pb.TensorMeta, dtype=dtypes,
    shape=st.lists(st.one_of(st.integers(-5, 5000), st.integers(-2**63, 2**63 - 1)), max_size=9),
    nbytes=huge,
)
headers = st.builds(
    pb.ParkHeader, seq_id=odd_ids, tensors=st.lists(tensor_metas, max_size=3), nbytes=huge,
    priority=st.integers(-2**31, 2**31 - 1), overwrite=st.booleans(), pinned=st.booleans(),
    ttl_s=st.floats(allow_nan=True, allow_infinity=True), refs=st.lists(odd_ids, max_size=3),
    shared=st.booleans(),
    attrs=st.dictionaries(text(max_size=10), text(max_size=50), max_size=3),
)
layouts = st.one_of(st.just(""), st.sampled_from(["L1", "L2", "l1"]), text(max_size=30))
tiers = st.one_of(st.sampled_from(["", "host", "device", "disk", "remote"]), text(max_size=8))
id_lists = st.lists(odd_ids, max_size=5)


def structured(rpc: str) -> st.SearchStrategy[bytes]:
    """Well-typed messages with hostile values, serialized."""
    own: dict[str, st.SearchStrategy] = {
        "Hello": st.builds(pb.HelloRequest, client_version=text(max_size=20)),
        "ParkSmall": st.builds(pb.ParkSmallRequest, header=headers, data=st.binary(max_size=600)),
        "Get": st.builds(pb.GetRequest, seq_id=odd_ids, seq_ids=id_lists, expect_layout=layouts, max_bytes=huge),
        "Reserve": st.builds(pb.ReserveRequest, header=headers, tier=tiers),
        "Commit": st.builds(pb.CommitRequest, lease_id=lease_ids),
        "Acquire": st.builds(pb.AcquireRequest, seq_id=odd_ids, tier=tiers, seq_ids=id_lists,
                             expect_layout=layouts, inline_max=huge),
        "Release": st.builds(pb.ReleaseRequest, lease_id=lease_ids),
        "Prefetch": st.builds(pb.PrefetchRequest, seq_id=odd_ids, tier=tiers, wait=st.booleans(),
                              timeout_s=st.one_of(st.floats(-1e9, 5.0), st.just(float("nan")))),
        "Lookup": st.builds(pb.LookupRequest, seq_ids=st.lists(odd_ids, max_size=20)),
        "Drop": st.builds(pb.DropRequest, seq_id=odd_ids),
        "Info": st.builds(pb.InfoRequest, seq_id=odd_ids),
        "List": st.just(pb.ListRequest()),
        "Stat": st.just(pb.StatRequest()),
        "Pin": st.builds(pb.PinRequest, seq_id=odd_ids, pinned=st.booleans()),
        "Flush": st.just(pb.FlushRequest()),
        "Restore": st.builds(pb.RestoreRequest, seq_id=odd_ids, seq_ids=id_lists, expect_layout=layouts),
        "Park": st.builds(lambda h: pb.ParkRequest(header=h), headers),
        "Window": st.builds(pb.WindowRequest, lease_id=lease_ids, index=huge),
    }
    s = own[rpc] if rpc in own else generic(METHODS[rpc].input_type)
    return s.map(lambda m: m.SerializeToString())


def generic(desc: Any) -> st.SearchStrategy:
    """Any message type: each scalar field drawn by its type (repeated ones as lists)."""
    F = descriptor.FieldDescriptor
    by_type = {F.TYPE_STRING: odd_ids, F.TYPE_BYTES: st.binary(max_size=64), F.TYPE_BOOL: st.booleans(),
               F.TYPE_DOUBLE: st.floats(), F.TYPE_FLOAT: st.floats(width=32), F.TYPE_UINT64: huge,
               F.TYPE_UINT32: st.integers(0, 2**32 - 1), F.TYPE_INT64: st.integers(-2**63, 2**63 - 1),
               F.TYPE_INT32: st.integers(-2**31, 2**31 - 1)}
    fields = {f.name: (st.lists(by_type[f.type], max_size=4) if f.label == F.LABEL_REPEATED else by_type[f.type])
              for f in desc.fields if f.type in by_type}
    return st.builds(message_factory.GetMessageClass(desc), **fields)


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@st.composite
def wrong_types(draw: st.DrawFn) -> bytes:
    """A message of fields 1..12 with arbitrary wire types: strings as varints, ints as bytes."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 6))):
        field, wtype = draw(st.integers(1, 12)), draw(st.sampled_from([0, 1, 2, 5]))
        out += _varint(field << 3 | wtype)
        if wtype == 0:
            out += _varint(draw(st.integers(0, 2**64 - 1)))
        elif wtype == 1:
            out += struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
        elif wtype == 5:
            out += struct.pack("<I", draw(st.integers(0, 2**32 - 1)))
        else:
            body = draw(st.binary(max_size=40))
            declared = draw(st.one_of(st.just(len(body)), st.integers(0, 2**40)))  # lies about its size
            out += _varint(declared) + body
    return bytes(out)


@st.composite
def noise(draw: st.DrawFn, rpc: str) -> bytes:
    """Random bytes, or a valid message of ``rpc`` cut short, or one with a byte flipped."""
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "wrong_types"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "wrong_types":
        return draw(wrong_types())
    msg = draw(structured(rpc))
    if not msg:
        return draw(st.binary(max_size=20))
    if kind == "truncated":
        return msg[: draw(st.integers(0, len(msg) - 1))]
    i = draw(st.integers(0, len(msg) - 1))
    return msg[:i] + bytes([msg[i] ^ (1 << draw(st.integers(0, 7)))]) + msg[i + 1 :]


# ------------------------------------------------------------------ tests


@per_test(0.25)
@given(data=st.data(), rpc=st.sampled_from(ALL_RPCS))
def test_noise_at_every_rpc(channel: grpc.Channel, rpc: str, data: st.DataObject) -> None:
    call(channel, rpc, data.draw(noise(rpc)))


@per_test(0.25)
@given(data=st.data(), rpc=st.sampled_from(ALL_RPCS))
def test_hostile_values_at_every_rpc(channel: grpc.Channel, rpc: str, data: st.DataObject) -> None:
    msg = data.draw(structured(rpc))
    if rpc == "Park":  # a header alone, then a commit claiming whatever it likes
        call(channel, rpc, [msg, pb.ParkRequest(commit=pb.ParkCommit(nbytes=data.draw(huge))).SerializeToString()])
    else:
        call(channel, rpc, msg)


@st.composite
def park_streams(draw: st.DrawFn) -> list[bytes]:
    """A well-formed header for a small sequence, then chunks in a hostile order."""
    n = draw(st.integers(1, 3000))
    head = pb.ParkHeader(seq_id=draw(st.sampled_from(["p1", "p2", "real"])), nbytes=n,
                         tensors=[pb.TensorMeta(dtype="uint8", shape=[n], nbytes=n)],
                         overwrite=draw(st.booleans()))
    msgs = [pb.ParkRequest(header=head).SerializeToString()]
    sent = 0
    for _ in range(draw(st.integers(0, 6))):
        off = draw(st.one_of(st.just(sent), st.integers(0, n + 10), st.integers(0, 2**64 - 1)))
        ln = draw(st.integers(0, 1200))
        msgs.append(encode_chunk(off, memoryview(bytes([off % 251]) * ln)))
        sent = max(sent, off + ln)
    where = draw(st.sampled_from(["end", "none", "early", "twice"]))
    commit = pb.ParkRequest(commit=pb.ParkCommit(nbytes=draw(st.one_of(st.just(n), huge)))).SerializeToString()
    if where == "end":
        msgs.append(commit)
    elif where == "early":
        msgs.insert(draw(st.integers(1, len(msgs))), commit)
    elif where == "twice":
        msgs += [commit, commit]
    if draw(st.booleans()):  # a second header in the middle of the stream
        msgs.insert(draw(st.integers(1, len(msgs))), msgs[0])
    return msgs


@per_test(0.2)
@given(msgs=park_streams())
def test_park_streams_out_of_order(channel: grpc.Channel, fuzz_daemon: Daemon, msgs: list[bytes]) -> None:
    call(channel, "Park", msgs)


@per_test(0.1)
@given(lease=lease_ids, layout=layouts, commit_first=st.booleans())
def test_wrong_leases_and_layouts(channel: grpc.Channel, lease: str, layout: str, commit_first: bool) -> None:
    # A real reservation, then someone else's (wrong) lease id at Commit and Release.
    r = pb.ReserveResponse.FromString(channel.unary_unary(SERVICE + "Reserve")(
        pb.ReserveRequest(header=pb.ParkHeader(seq_id="leased", nbytes=64, overwrite=True,
                                               tensors=[pb.TensorMeta(dtype="uint8", shape=[64], nbytes=64)]))
        .SerializeToString(), timeout=DEADLINE_S))
    if lease != r.lease_id:
        for rpc, m in (("Commit", pb.CommitRequest(lease_id=lease)), ("Release", pb.ReleaseRequest(lease_id=lease))):
            call(channel, rpc, m.SerializeToString())
    call(channel, "Release", pb.ReleaseRequest(lease_id=r.lease_id).SerializeToString())
    if commit_first:  # a lease already released, committed
        call(channel, "Commit", pb.CommitRequest(lease_id=r.lease_id).SerializeToString())
    for rpc, m in (("Get", pb.GetRequest(seq_id="real", expect_layout=layout, max_bytes=1 << 20)),
                   ("Acquire", pb.AcquireRequest(seq_id="real", expect_layout=layout, inline_max=1 << 20)),
                   ("Restore", pb.RestoreRequest(seq_id="real", expect_layout=layout))):
        call(channel, rpc, m.SerializeToString())


@st.composite
def nearly_valid_headers(draw: st.DrawFn, batch: bool = False) -> tuple[pb.ParkHeader, int]:
    """A header that is right, or off by one thing: sizes, refs, blocks, flags. Returns it
    and the payload size it really declares (new blocks first, then the sequence)."""
    small_ids = st.sampled_from(["n1", "n2", "blk", "blk2", "user", "real", "missing"])

    def metas(n: int) -> list[pb.TensorMeta]:
        return [pb.TensorMeta(dtype="uint8", shape=[n], nbytes=n)] if n else []

    blocks = []
    for bid in draw(st.lists(small_ids, max_size=3, unique=True)):
        bn = draw(st.integers(0, 5000))
        blocks.append(pb.ParkHeader(seq_id=bid, nbytes=bn + draw(st.sampled_from([0, 0, 0, 1])), tensors=metas(bn),
                                    shared=draw(st.booleans()), refs=draw(st.lists(small_ids, max_size=1))))
    n = 0 if batch else draw(st.integers(0, 5000))
    refs = draw(st.lists(small_ids, max_size=3))
    if draw(st.booleans()):
        refs += [b.seq_id for b in blocks]
    h = pb.ParkHeader(seq_id="" if batch else draw(small_ids), tensors=metas(n), nbytes=n, refs=refs, blocks=blocks,
                      overwrite=draw(st.booleans()), pinned=draw(st.booleans()), shared=draw(st.booleans()),
                      ttl_s=draw(st.sampled_from([0.0, 0.0, 0.5, 60.0])),
                      attrs={"layout": draw(st.sampled_from(["L1", "L2"]))})
    return h, n + sum(b.nbytes for b in blocks)


@per_test(0.2)
@given(data=st.data(), rpc=st.sampled_from(["ParkSmall", "Park", "Reserve"]), batch=st.booleans())
def test_nearly_valid_parks(channel: grpc.Channel, rpc: str, batch: bool, data: st.DataObject) -> None:
    h, total = data.draw(nearly_valid_headers(batch))
    size = max(0, total + data.draw(st.sampled_from([0, 0, 0, -1, 1])))
    body = bytes([7]) * size
    if rpc == "ParkSmall":
        call(channel, rpc, pb.ParkSmallRequest(header=h, data=body).SerializeToString())
    elif rpc == "Park":
        msgs = [pb.ParkRequest(header=h).SerializeToString()]
        msgs += [encode_chunk(off, memoryview(body)[off:off + 4096]) for off in range(0, size, 4096)]
        msgs.append(pb.ParkRequest(commit=pb.ParkCommit(nbytes=size)).SerializeToString())
        call(channel, rpc, msgs)
    else:  # reserve, then commit without writing the slots (the client's bytes, unchecked)
        try:
            raw = channel.unary_unary(SERVICE + "Reserve")(pb.ReserveRequest(header=h).SerializeToString(),
                                                          timeout=DEADLINE_S)
        except grpc.RpcError:
            call(channel, "Reserve", pb.ReserveRequest(header=h).SerializeToString())  # typed, checked there
            return
        call(channel, "Commit", pb.CommitRequest(lease_id=pb.ReserveResponse.FromString(raw).lease_id)
             .SerializeToString())
    for sid in ("n1", "n2", "user"):  # whatever got in reads back whole, or is typed-absent
        call(channel, "Get", pb.GetRequest(seq_id=sid, max_bytes=1 << 20).SerializeToString())


def test_every_rpc_of_the_service_is_fuzzed() -> None:
    for name in ALL_RPCS:  # a strategy for each: its own, or the generic one
        assert isinstance(structured(name), st.SearchStrategy)
    assert {"Park", "Restore", "Window"} <= set(ALL_RPCS)


def test_after_the_fuzzing_the_daemon_serves_and_its_accounting_holds(fuzz_daemon: Daemon) -> None:
    # Runs last in this module (pytest keeps file order). Reservations the fuzzer left open expire.
    eng = fuzz_daemon.engine
    assert eng is not None
    assert wait_until(lambda: eng.leases.count == 0, timeout=30)
    eng.check_invariants()
    with Client(fuzz_daemon.address) as c:
        assert torch.equal(c.restore("keep")[0], torch.arange(999, dtype=torch.int16))
        c.park("after", [torch.ones(10)])
        assert torch.equal(c.restore("after")[0], torch.ones(10))
        assert "keep" in {s.seq_id for s in c.list()}
    eng.check_invariants()
