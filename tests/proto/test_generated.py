"""The committed generated code matches proto/kvpark/v1/kvpark.proto, and every RPC in it
is served by a running daemon."""

import importlib.util
import pathlib
from typing import Callable

import grpc

from kvpark.daemon.server import Daemon
from kvpark.proto import GRPC_OPTIONS
from kvpark.proto.v1 import kvpark_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto() -> None:
    spec = importlib.util.spec_from_file_location("kvpark_generate", ROOT / "proto" / "generate.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rendered = gen.render()
    assert set(rendered) == {"kvpark_pb2.py", "kvpark_pb2_grpc.py", "kvpark_pb2.pyi"}
    for name, text in rendered.items():
        committed = (ROOT / "proto" / "v1" / name).read_text()
        assert committed == text, f"proto/v1/{name} drifted from the .proto; run `make proto`"


def test_every_rpc_in_the_proto_is_registered(daemon: Callable[..., Daemon]) -> None:
    # An empty request to each method: any answer but UNIMPLEMENTED means a handler is
    # registered under the name the proto gives it (a bare Servicer method is not enough).
    d = daemon()
    service = pb.DESCRIPTOR.services_by_name["KVPark"]
    assert len(service.methods) >= 15
    with grpc.insecure_channel(d.address, options=GRPC_OPTIONS) as ch:
        for m in service.methods:
            path = f"/{service.full_name}/{m.name}"
            ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
            try:
                if m.client_streaming:
                    ch.stream_unary(path, **ident)(iter([]), timeout=10)
                elif m.server_streaming:
                    list(ch.unary_stream(path, **ident)(b"", timeout=10))
                else:
                    ch.unary_unary(path, **ident)(b"", timeout=10)
            except grpc.RpcError as e:
                assert e.code() != grpc.StatusCode.UNIMPLEMENTED, f"{m.name} is not registered"
