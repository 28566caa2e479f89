"""End-to-end verification on the client: digests at park, checks after every restore.

``Client(verify=True)`` (or ``KVPARK_VERIFY=1``) hashes each tensor's bytes with
xxh3-64 before they leave, and the daemon keeps the digests with the sequence's
manifest on every tier (``kvpark.proto.digests``). Every restore then hashes the bytes
that landed and compares: a mismatch is ``DataLoss``. The check sits on the one object
every data path returns (``Restoring``), so shm, inline (data channel, gRPC stream, the
one-message path), windowed restores, ``into=``/``into_flat=`` and grants are all covered.
A tensor whose digest is 0 (parked without verify) is not checked.

Primitives:
- ``ENV``: the environment variable that turns it on (``1``/``true``/``yes``/``on``);
  ``from_env(verify)``: the setting when ``verify`` is not given.
- ``digest(t) -> int``: the xxh3-64 of a tensor's bytes (a device tensor is copied to
  the host first: the check costs a device-to-host copy there).
- ``digests(tensors) -> list[int]``.
- ``checked(r, into_flat=None) -> Restoring``: ``r`` with every tensor checked as it is
  handed out (``into_flat``: the whole buffer checked, tensor by tensor, at the end).
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import torch
import xxhash

from kvpark.proto.errors import DataLoss

from .payload import byte_view
from .transport import Restoring

ENV = "KVPARK_VERIFY"
_TRUE = ("1", "true", "yes", "on")


def from_env(verify: bool | None) -> bool:
    if verify is not None:
        return bool(verify)
    return os.environ.get(ENV, "").strip().lower() in _TRUE


def _bytes_digest(flat: torch.Tensor) -> int:
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return xxhash.xxh3_64_intdigest(flat.numpy())


def digest(t: torch.Tensor) -> int:
    return _bytes_digest(byte_view(t))


def digests(tensors: Sequence[torch.Tensor]) -> list[int]:
    return [digest(t) for t in tensors]


def _check(seq: str, i: int, want: int, flat: torch.Tensor) -> None:
    if want and _bytes_digest(flat) != want:
        raise DataLoss(f"restore of {seq!r}: tensor {i} does not match the digest it was parked with "
                       "(its bytes changed after the park)")


def checked(r: Restoring, into_flat: torch.Tensor | None = None) -> Restoring:
    """``r`` checked against the digests its info carries (as it is, when there are none)."""
    want = r.info.xxh3
    if not want:
        return r
    if len(want) != len(r.info.tensors):
        r.close()
        raise DataLoss(f"restore of {r.info.seq_id!r}: {len(want)} digests for {len(r.info.tensors)} tensors")
    seq = r.info.seq_id

    def tensors() -> Iterator[tuple[int, torch.Tensor]]:
        for i, t in r:
            _check(seq, i, want[i], byte_view(t))
            yield i, t
        if into_flat is not None:
            flat, pos = into_flat.reshape(-1).view(torch.uint8), 0
            for i, m in enumerate(r.info.tensors):
                _check(seq, i, want[i], flat[pos : pos + m.nbytes])
                pos += m.nbytes

    return Restoring(r.info, tensors(), r.close)
