"""The one error hierarchy of kvpark, shared by the daemon and the client.

Primitives:
- ``KVParkError`` and its subclasses; each carries the gRPC status code it maps to.
- ``ERROR_KEY``: the trailing-metadata key carrying the exact class name, so that two
  classes sharing a code (``LayoutMismatch`` and ``LeaseExpired`` are both
  FAILED_PRECONDITION) come back as the right type.
- ``from_code(code, message, name=None) -> KVParkError``: the client side of the mapping.

The engine raises these; the servicer turns them into a status; the client turns the
status back into the same class. ``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

import grpc

ERROR_KEY = "kvpark-error"


class KVParkError(Exception):
    """Base of every kvpark error. ``code`` is the gRPC status it travels as."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KVParkError):
    """Bad shapes, sizes, ids, or a malformed stream."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVParkError):
    """Unknown sequence."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KVParkError):
    """A sequence with this id is parked and ``overwrite`` was not set."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(KVParkError):
    """The request is valid but the state does not allow it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class LayoutMismatch(FailedPrecondition):
    """Stored KV does not have the layout the caller expects."""


class LeaseExpired(FailedPrecondition):
    """The lease named in the request is gone (expired, released or never existed)."""


class ResourceExhausted(KVParkError):
    """Capacity or quota exhausted; nothing was stored."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(KVParkError):
    """A stored record failed its checksum or format check; no data is returned."""

    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KVParkError):
    """The daemon has tenants and the call carried no valid bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KVParkError):
    """The tenant may not do this (the shm / cuda_ipc paths without ``trusted_local``)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(KVParkError):
    """The daemon cannot be reached, or is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KVParkError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(KVParkError):
    code = grpc.StatusCode.CANCELLED


class Internal(KVParkError):
    """A bug in kvpark. The daemon logs it with a traceback and stays up."""

    code = grpc.StatusCode.INTERNAL


class TransportUnavailable(FailedPrecondition):
    """A forced transport (``transport="shm"`` etc.) cannot work with this daemon."""


class StartupError(Exception):
    """A configuration that cannot work on this machine (a missing ``shm_dir``, too
    little shared memory for the arena, ...). Never sent over gRPC: the daemon refuses
    to start, printing this one-line message, with exit code 2."""


_ALL: tuple[type[KVParkError], ...] = (
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    LayoutMismatch,
    LeaseExpired,
    ResourceExhausted,
    DataLoss,
    Unauthenticated,
    PermissionDenied,
    Unavailable,
    DeadlineExceeded,
    Cancelled,
    Internal,
    TransportUnavailable,
)
_BY_NAME: dict[str, type[KVParkError]] = {cls.__name__: cls for cls in _ALL}
# The plain class for each code; the subclasses sharing a code are found by name.
_BY_CODE: dict[grpc.StatusCode, type[KVParkError]] = {
    cls.code: cls for cls in _ALL if cls.__bases__ == (KVParkError,)
}


def from_code(code: grpc.StatusCode | None, message: str, name: str | None = None) -> KVParkError:
    """Rebuild the typed error a daemon raised from its status code and class name."""
    if name is not None:
        cls = _BY_NAME.get(name)
        if cls is not None and cls.code == code:
            return cls(message)
    cls = _BY_CODE.get(code) if code is not None else None
    err = (cls or KVParkError)(message)
    if cls is None and code is not None:
        err.code = code
    return err
