"""One error class per status code; names disambiguate classes that share a code.

The table below is the contract (DESIGN.md's error list), written out independently of
the classes: a class added to ``proto/errors.py`` without a row here fails the
coverage test, and each row is checked against the class and the client's export.
"""

import inspect
from typing import Callable

import grpc
import pytest
import torch

from kvpark import client
from kvpark.daemon.server import Daemon
from kvpark.proto import errors
from kvpark.proto.v1 import kvpark_pb2 as pb

C = grpc.StatusCode
CONTRACT: dict[str, grpc.StatusCode] = {
    "InvalidArgument": C.INVALID_ARGUMENT,
    "NotFound": C.NOT_FOUND,
    "AlreadyExists": C.ALREADY_EXISTS,
    "FailedPrecondition": C.FAILED_PRECONDITION,
    "LayoutMismatch": C.FAILED_PRECONDITION,
    "LeaseExpired": C.FAILED_PRECONDITION,
    "TransportUnavailable": C.FAILED_PRECONDITION,
    "ResourceExhausted": C.RESOURCE_EXHAUSTED,
    "DataLoss": C.DATA_LOSS,
    "Unauthenticated": C.UNAUTHENTICATED,
    "PermissionDenied": C.PERMISSION_DENIED,
    "Unavailable": C.UNAVAILABLE,
    "DeadlineExceeded": C.DEADLINE_EXCEEDED,
    "Cancelled": C.CANCELLED,
    "Internal": C.INTERNAL,
}


def defined_classes() -> dict[str, type]:
    return {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, errors.KVParkError) and cls is not errors.KVParkError}


def test_the_contract_covers_every_error_class() -> None:
    assert set(defined_classes()) == set(CONTRACT)


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_round_trip(name: str) -> None:
    cls = defined_classes()[name]
    assert getattr(client, name) is cls and name in client.__all__  # the client raises the same class
    assert cls.code == CONTRACT[name]
    back = errors.from_code(CONTRACT[name], "msg", name)
    assert type(back) is cls and back.message == "msg" and back.code == CONTRACT[name]


def test_code_alone_gives_the_base_class_of_that_code() -> None:
    for name, code in CONTRACT.items():
        base = type(errors.from_code(code, "m"))
        assert base.__bases__ == (errors.KVParkError,) and base.code == code, name
    assert type(errors.from_code(grpc.StatusCode.FAILED_PRECONDITION, "m")) is errors.FailedPrecondition
    assert type(errors.from_code(grpc.StatusCode.NOT_FOUND, "m", "Bogus")) is errors.NotFound


def test_a_name_that_disagrees_with_the_code_is_ignored() -> None:
    assert type(errors.from_code(grpc.StatusCode.NOT_FOUND, "m", "DataLoss")) is errors.NotFound
    unknown = errors.from_code(grpc.StatusCode.ABORTED, "m")
    assert type(unknown) is errors.KVParkError and unknown.code == grpc.StatusCode.ABORTED


def test_a_real_daemon_raises_each_provokable_class_by_name(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with client.Client(d.address) as c:
        c.park("s", [torch.ones(10)], attrs={"layout": "L1"})
        c.park("u", [torch.ones(10)], refs=["B"], new_blocks={"B": [torch.ones(10)]})
        cases: list[tuple[type, Callable[[], object]]] = [
            (client.NotFound, lambda: c.info("missing")),
            (client.AlreadyExists, lambda: c.park("s", [torch.ones(1)])),
            (client.InvalidArgument, lambda: c.rpc.call(c.rpc.info, pb.InfoRequest(seq_id=""))),
            (client.LeaseExpired, lambda: c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id="nope"))),
            (client.LayoutMismatch, lambda: c.restore_many(["s"], expect_layout="L2")),
            (client.FailedPrecondition, lambda: c.drop("B")),
            (client.ResourceExhausted, lambda: c.park("big", [torch.ones(1 << 30, dtype=torch.uint8)])),
        ]
        for cls, call in cases:
            with pytest.raises(cls) as e:
                call()
            assert type(e.value) is cls and e.value.code == CONTRACT[cls.__name__]
        # The layout check compares values: a matching layout restores.
        _, out = c.restore_many(["s"], expect_layout="L1")
        assert torch.equal(out[0], torch.ones(10))


def test_a_daemon_with_tenants_raises_unauthenticated_and_permission_denied_by_name(
        daemon: Callable[..., Daemon]) -> None:
    import hashlib

    d = daemon(**{"tenants.t.token_sha256": hashlib.sha256(b"tok").hexdigest()})
    with pytest.raises(client.Unauthenticated) as e:
        client.Client(d.address, token="other")
    assert type(e.value) is client.Unauthenticated and e.value.code == CONTRACT["Unauthenticated"]
    with client.Client(d.address, token="tok") as c:
        head = pb.ParkHeader(seq_id="s", tensors=[pb.TensorMeta(dtype="uint8", shape=[8], nbytes=8)], nbytes=8)
        with pytest.raises(client.PermissionDenied) as p:
            c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=head, tier="host"))
        assert type(p.value) is client.PermissionDenied and p.value.code == CONTRACT["PermissionDenied"]
