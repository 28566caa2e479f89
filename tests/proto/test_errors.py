"""One error class per status code; names disambiguate classes that share a code."""

import grpc
import pytest

from kvpark import client
from kvpark.proto import errors


@pytest.mark.parametrize(
    "cls,code",
    [
        (client.NotFound, grpc.StatusCode.NOT_FOUND),
        (client.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
        (client.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
        (client.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (client.DataLoss, grpc.StatusCode.DATA_LOSS),
        (client.LayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
        (client.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
        (client.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
        (client.Unavailable, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_round_trip(cls: type, code: grpc.StatusCode) -> None:
    assert issubclass(cls, client.KVParkError)
    assert cls.code == code
    back = errors.from_code(code, "msg", cls.__name__)
    assert type(back) is cls and back.message == "msg"


def test_code_alone_gives_the_base_class_of_that_code() -> None:
    assert type(errors.from_code(grpc.StatusCode.FAILED_PRECONDITION, "m")) is errors.FailedPrecondition
    assert type(errors.from_code(grpc.StatusCode.NOT_FOUND, "m", "Bogus")) is errors.NotFound


def test_a_name_that_disagrees_with_the_code_is_ignored() -> None:
    assert type(errors.from_code(grpc.StatusCode.NOT_FOUND, "m", "DataLoss")) is errors.NotFound
