"""A park retried after an interruption: is what is parked under the id already this park?

A park becomes visible once its ``Commit`` reaches the daemon. A client interrupted after
that point (Ctrl-C, a reply lost with its connection, a worker killed) has stored its
sequence without learning it, and its retry meets ``AlreadyExists``. When the version
parked under the id *is* that park (the same tensor layout, the same ``attrs`` and the
same bytes) the retry succeeds and returns the stored version's ``SeqInfo``, as the first
call would have. Anything else stays ``AlreadyExists``.

How the bytes are compared, cheapest first:
- the layout and ``attrs`` (from ``info``, one round trip): different is different;
- when the stored version carries a digest for every tensor (parked with
  ``verify=True``), the caller's tensors are hashed the same way (xxh3-64) and compared
  with them; no payload moves;
- otherwise the stored version is restored tensor by tensor (``layerwise``, so at most one
  tensor is held at a time) and compared byte for byte.

Only a plain sequence is compared (no ``refs``, no ``new_blocks``): a composite's payload
is partly its blocks', and blocks are content-addressed already. This runs only after
``AlreadyExists``; a park that does not conflict pays nothing.

Primitives:
- ``stored_as(client, seq_id, tensors, attrs, digests) -> SeqInfo | None``: the stored
  version's ``SeqInfo`` when it holds exactly this park, else ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from kvpark.proto.errors import NotFound
from kvpark.proto.layout import TensorMeta
from kvpark.proto.types import SeqInfo

from . import verify as verifying
from .payload import byte_view

if TYPE_CHECKING:
    from .client import Client


def _same_shape(info: SeqInfo, metas: list[TensorMeta], attrs: Mapping[str, str]) -> bool:
    return (not info.refs and not info.shared and list(info.tensors) == metas
            and dict(info.attrs) == dict(attrs))


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    a, b = byte_view(got), byte_view(want)
    if a.device != b.device:
        b = b.to(a.device)
    return bool(torch.equal(a, b))


def stored_as(client: "Client", seq_id: str, tensors: Sequence[torch.Tensor], attrs: Mapping[str, str],
              digests: Sequence[int] = ()) -> SeqInfo | None:
    """The ``SeqInfo`` of the version parked under ``seq_id`` when it holds exactly
    ``tensors`` with ``attrs``, else ``None``. ``digests``: the tensors' xxh3-64 when the
    caller has them already (``verify=True``). Runs under the caller's deadline."""
    metas = [TensorMeta.of(t) for t in tensors]
    try:
        info = client.info(seq_id)
    except NotFound:
        return None  # dropped since: the conflict was real when it was met
    if not _same_shape(info, metas, attrs):
        return None
    if len(info.xxh3) == len(tensors) and all(info.xxh3):
        mine = list(digests) if len(digests) == len(tensors) else verifying.digests(tensors)
        return info if list(info.xxh3) == mine else None
    try:
        r = client.restore(seq_id, layerwise=True)
    except NotFound:
        return None
    try:
        # The version read may be newer than the one ``info`` described: judge that one.
        if not _same_shape(r.info, metas, attrs):
            return None
        for i, t in r:
            if not _same_bytes(t, tensors[i]):
                return None
    finally:
        r.close()
    return r.info
