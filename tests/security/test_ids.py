"""Attack: ids that hold the tenant separator or control characters, through every RPC
that takes an id, on a daemon with tenants and on one without (issue F5).

An open daemon that accepted ``alice<SEP>chat-1`` could read and plant alice's sequences
wherever it shares storage with alice's daemon (a Redis both use). Every daemon answers
such an id with INVALID_ARGUMENT and touches nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.daemon.tenants import SEP
from kvpark.proto.errors import ERROR_KEY
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..daemon.test_tenants import TOKENS, tenants
from ..redis_servers import RedisServer

FORGED = "alice" + SEP + "chat-1"  # alice's chat-1, as her daemon names it
BAD_IDS = (FORGED, "a" + SEP, SEP, "chat\x01", "chat\x7f", "chat\n1")


def _header(seq_id: str, **kw: Any) -> pb.ParkHeader:
    return pb.ParkHeader(seq_id=seq_id, tensors=[pb.TensorMeta(dtype="uint8", shape=[4], nbytes=4)], nbytes=4, **kw)


def _attacks(bad: str) -> Iterator[tuple[str, str, Any]]:
    """(rpc, kind, request) for every RPC and every id field it takes."""
    yield "ParkSmall", "uu", pb.ParkSmallRequest(header=_header(bad), data=b"abcd")
    yield "ParkSmall", "uu", pb.ParkSmallRequest(header=_header("ok", refs=[bad]), data=b"abcd")
    yield "ParkSmall", "uu", pb.ParkSmallRequest(header=_header("ok", blocks=[_header(bad, shared=True)]),
                                                 data=b"abcdabcd")
    yield "Park", "su", [pb.ParkRequest(header=_header(bad)), pb.ParkRequest(commit=pb.ParkCommit(nbytes=4))]
    yield "Reserve", "uu", pb.ReserveRequest(header=_header(bad), tier="host")
    yield "Reserve", "uu", pb.ReserveRequest(header=_header(bad), data_channel=True)
    yield "Restore", "us", pb.RestoreRequest(seq_id=bad)
    yield "Restore", "us", pb.RestoreRequest(seq_ids=["ok", bad])
    yield "Get", "uu", pb.GetRequest(seq_id=bad, max_bytes=1 << 20)
    yield "Acquire", "uu", pb.AcquireRequest(seq_id=bad, tier="host")
    yield "Acquire", "uu", pb.AcquireRequest(seq_ids=[bad], data_channel=True)
    yield "Prefetch", "uu", pb.PrefetchRequest(seq_id=bad, tier="host")
    yield "Lookup", "uu", pb.LookupRequest(seq_ids=[bad])
    yield "Lookup", "uu", pb.LookupRequest(seq_ids=[bad], acquire=pb.LookupAcquire(tier="host"))
    yield "Drop", "uu", pb.DropRequest(seq_id=bad)
    yield "Info", "uu", pb.InfoRequest(seq_id=bad)
    yield "Pin", "uu", pb.PinRequest(seq_id=bad)


def _send(ch: grpc.Channel, rpc: str, kind: str, req: Any, md: list[tuple[str, str]]) -> grpc.RpcError | None:
    path, ser, ident = f"/kvpark.v1.KVPark/{rpc}", (lambda m: m.SerializeToString()), (lambda b: b)
    try:
        if kind == "uu":
            ch.unary_unary(path, request_serializer=ser, response_deserializer=ident)(req, metadata=md, timeout=30)
        elif kind == "us":
            list(ch.unary_stream(path, request_serializer=ser, response_deserializer=ident)(req, metadata=md,
                                                                                            timeout=30))
        else:
            ch.stream_unary(path, request_serializer=ser, response_deserializer=ident)(iter(req), metadata=md,
                                                                                       timeout=30)
    except grpc.RpcError as e:
        return e
    return None


def _every_rpc_refuses(d: Daemon, md: list[tuple[str, str]]) -> None:
    with grpc.insecure_channel(d.address) as ch:
        for bad in BAD_IDS:
            for rpc, kind, req in _attacks(bad):
                err = _send(ch, rpc, kind, req, md)
                assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, bad, err)
                assert (ERROR_KEY, "InvalidArgument") in (err.trailing_metadata() or ()), (rpc, bad)
    assert d.engine is not None and d.engine.list() == [] and d.engine.leases.count == 0  # nothing stored or held


def test_ids_with_the_tenant_separator_are_refused_by_every_rpc_of_an_open_daemon(
        daemon: Callable[..., Daemon]) -> None:
    _every_rpc_refuses(daemon(), [])


def test_ids_with_the_tenant_separator_are_refused_by_every_rpc_of_a_tenant_daemon(
        daemon: Callable[..., Daemon]) -> None:
    _every_rpc_refuses(daemon(**tenants()), [("authorization", f"Bearer {TOKENS['alice']}")])


def _own_dirs(tmp_path: Path, name: str) -> dict[str, str]:
    (tmp_path / name / "shm").mkdir(parents=True)
    return {"tiers.disk.path": str(tmp_path / name / "disk"), "tiers.host.shm_dir": str(tmp_path / name / "shm")}


def test_an_open_daemon_sharing_the_redis_can_neither_read_nor_plant_a_tenants_sequence(
        daemon: Callable[..., Daemon], redis_server: RedisServer, tmp_path: Path) -> None:
    remote = {"tiers.remote.url": redis_server.url, "tiers.remote.namespace": f"f5-{os.getpid()}",
              "tiers.remote.write": "write_through", "tiers.remote.timeout_s": 2.0}
    owned = daemon(**tenants(), **remote, **_own_dirs(tmp_path, "owned"))
    open_ = daemon(**remote, **_own_dirs(tmp_path, "open"))
    secret = torch.arange(4096, dtype=torch.uint8)
    with Client(owned.address, token=TOKENS["alice"]) as alice:
        alice.park("chat-1", [secret])
        alice.flush()
    with grpc.insecure_channel(open_.address) as ch:
        # Read alice's sequence through the open daemon: refused, not served.
        for rpc, kind, req in (("Get", "uu", pb.GetRequest(seq_id=FORGED, max_bytes=1 << 20)),
                               ("Restore", "us", pb.RestoreRequest(seq_id=FORGED)),
                               ("Lookup", "uu", pb.LookupRequest(seq_ids=[FORGED]))):
            err = _send(ch, rpc, kind, req, [])
            assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, err)
        # Plant "alice<SEP>planted" for alice's daemon to serve her: refused.
        err = _send(ch, "ParkSmall", "uu", pb.ParkSmallRequest(header=_header("alice" + SEP + "planted"),
                                                               data=b"evil"), [])
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(owned.address, token=TOKENS["alice"]) as alice:
        assert alice.present(["planted", "chat-1"]) == [False, True]
        assert torch.equal(alice.restore("chat-1")[0], secret)
