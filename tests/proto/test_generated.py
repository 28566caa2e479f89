"""The committed generated code matches proto/kvpark/v1/kvpark.proto."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto() -> None:
    spec = importlib.util.spec_from_file_location("kvpark_generate", ROOT / "proto" / "generate.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rendered = gen.render()
    assert set(rendered) == {"kvpark_pb2.py", "kvpark_pb2.pyi", "kvpark_pb2_grpc.py"}
    for name, text in rendered.items():
        committed = (ROOT / "proto" / "v1" / name).read_text()
        assert committed == text, f"proto/v1/{name} drifted from the .proto; run `make proto`"


def test_every_rpc_in_the_proto_has_a_handler() -> None:
    from kvpark.daemon.servicer import Servicer
    from kvpark.proto.v1 import kvpark_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["KVPark"]
    for method in service.methods:
        assert callable(getattr(Servicer, method.name, None)), method.name
