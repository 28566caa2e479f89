"""A park retried after an interruption: is what is parked under the id already this park?

A park becomes visible once its ``Commit`` reaches the daemon. A client interrupted after
that point (Ctrl-C, a reply lost with its connection, a worker killed) has stored its
sequence without learning it, and its retry meets ``AlreadyExists``. When the version
parked under the id *is* that park (the same tensor layout, ``attrs``, ``priority``,
``pinned`` and TTL, and the same bytes) the retry succeeds and returns the stored
version's ``SeqInfo``, as the first call would have. Anything else stays
``AlreadyExists``.

How it compares, cheapest first:
- the layout and the settings (from ``info``, one round trip): different is different;
- when the stored version carries a digest for every tensor (parked with
  ``verify=True``), a digest that differs from the caller's is an early "different".
  Equal digests prove nothing (the daemon stores what the parking client said, and a
  64-bit hash is not equality), so they never stand for the bytes;
- the stored version is read back tensor by tensor (``layerwise``, so at most one tensor
  is held at a time) and compared byte for byte, judged by the ``SeqInfo`` that read
  returned (the version read, not an earlier one).

Only a plain sequence is compared (no ``refs``, no ``new_blocks``): a composite's payload
is partly its blocks', and blocks are content-addressed already. Tensors without data
(``meta``) are never the same. This runs only after ``AlreadyExists``; a park that does
not conflict pays nothing. A compare that cannot finish in the caller's deadline raises
the deadline's error; one that finds the stored version corrupt (``DataLoss``) or gone
answers "not the same".

Primitives:
- ``Park(tensors, attrs, priority, pinned, ttl_s, digests)``: what the caller asked to park.
- ``stored_as(client, seq_id, park) -> SeqInfo | None``: the stored version's
  ``SeqInfo`` when it holds exactly this park, else ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from kvpark.proto.errors import DataLoss, NotFound
from kvpark.proto.layout import TensorMeta
from kvpark.proto.types import SeqInfo

from . import verify as verifying
from .payload import byte_view

if TYPE_CHECKING:
    from .client import Client

# A stored TTL is its expiry instant; the retry's TTL matches it within this much.
TTL_SLACK_S = 1e-3


@dataclass(frozen=True)
class Park:
    tensors: Sequence[torch.Tensor]
    attrs: Mapping[str, str]
    priority: int = 0
    pinned: bool = False
    ttl_s: float | None = None
    digests: Sequence[int] = ()  # the caller's, when it computed them (verify=True)


def _same_settings(info: SeqInfo, metas: list[TensorMeta], park: Park) -> bool:
    if info.refs or info.shared or list(info.tensors) != metas or dict(info.attrs) != dict(park.attrs):
        return False
    if info.priority != park.priority or info.pinned != park.pinned:
        return False
    if park.ttl_s is None:
        return not info.expires_at
    return bool(info.expires_at) and abs(info.expires_at - info.created_at - park.ttl_s) <= TTL_SLACK_S


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    a, b = byte_view(got), byte_view(want)
    if a.device != b.device:
        b = b.to(a.device)
    return bool(torch.equal(a, b))


def stored_as(client: "Client", seq_id: str, park: Park) -> SeqInfo | None:
    """The ``SeqInfo`` of the version parked under ``seq_id`` when it holds exactly
    ``park``, else ``None``. Runs under the caller's deadline."""
    tensors = park.tensors
    if any(t.device.type == "meta" for t in tensors):
        return None
    metas = [TensorMeta.of(t) for t in tensors]
    try:
        info = client.info(seq_id)
    except NotFound:
        return None  # dropped since: the conflict was real when it was met
    if not _same_settings(info, metas, park):
        return None
    if len(info.xxh3) == len(tensors) and all(info.xxh3):
        mine = list(park.digests) if len(park.digests) == len(tensors) else verifying.digests(tensors)
        if list(info.xxh3) != mine:
            return None  # different, for sure; equal proves nothing (see above)
    try:
        r = client.restore(seq_id, layerwise=True)
    except (NotFound, DataLoss):
        return None
    try:
        if not _same_settings(r.info, metas, park):
            return None
        for i, t in r:
            if not _same_bytes(t, tensors[i]):
                return None
    except DataLoss:
        return None
    finally:
        r.close()
    return r.info
