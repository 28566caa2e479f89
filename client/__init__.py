"""The worker library: connect to a kvpark daemon, park and restore KV tensors.

Primitives:
- ``Client(address=None, *, timeout=None, transport="auto")``: ``park``, ``restore``,
  ``drop``, ``info``, ``list``, ``stat``, ``close``; ``transport`` says which data path
  was negotiated ("shm" or "inline"; "cuda_ipc" when forced); with "auto", calls whose
  tensors live on the daemon's GPU use its device pool. ``deadline(seconds)`` bounds
  the calling thread's calls.
- Result types ``SeqInfo``, ``Stat``, ``TierStat``.
- Typed errors: ``KVParkError`` and its subclasses, one per gRPC status code.

``Client`` (and torch with it) is imported at its first use, not with this package: the
CLI's control commands (``kvpark.client.control``) run without torch.
"""

from __future__ import annotations

from typing import Any

from kvpark.proto.errors import (
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVParkError,
    LayoutMismatch,
    LeaseExpired,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TransportUnavailable,
    Unauthenticated,
    Unavailable,
)
from kvpark.proto.types import SeqInfo, Stat, TierStat

from .control import DEFAULT_ADDRESS


def __getattr__(name: str) -> Any:
    if name == "Client":
        from .client import Client

        return Client
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Client", "DEFAULT_ADDRESS", "SeqInfo", "Stat", "TierStat",
    "KVParkError", "NotFound", "AlreadyExists", "InvalidArgument", "ResourceExhausted", "DataLoss",
    "LayoutMismatch", "Unauthenticated", "PermissionDenied", "Unavailable", "DeadlineExceeded",
    "FailedPrecondition", "LeaseExpired", "Cancelled", "Internal", "TransportUnavailable",
]
