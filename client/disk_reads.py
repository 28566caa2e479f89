"""Disk grants: a trusted_local client reads a sequence that is on disk only straight from
the daemon's LMDB files, in one verified pass into its tensors.

The daemon answers an ``Acquire`` that asked for it (``AcquireRequest.disk``) with the
records' keys instead of promoting the sequence into the arena first: the bytes then
cross memory once (page cache to tensor) plus a hash, where the arena path costs a
verify, a copy in and a copy out, and a ``Release`` round trip. A grant holds no lease:
the keys carry the version's generation, unique to one daemon start, so a record read
here is that version's bytes (its header's length, layout fingerprint and xxh3 checked
as the daemon checks them) or is missing. Anything short of every record whole
(evicted, dropped or overwritten since the grant, damaged, files unreadable) is a
``Miss``, and the caller asks the daemon again without ``disk``, which answers as it
always has (the bytes, ``NOT_FOUND``, or ``DATA_LOSS``).

Primitives:
- ``Miss``: the grant cannot be served from the files (internal to the client);
  ``Unreadable`` (a ``Miss``): nor can any other, from this process (no access to the
  files, or no reader slot): stop asking for grants.
- ``read_into(path, parts, flats)``: every part's records, in payload order, into the
  contiguous uint8 CPU tensors ``flats`` (their lengths add up to the payload).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import lmdb
import numpy as np
import torch

from kvpark.proto.errors import DataLoss, Unavailable
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.tiers import envs
from kvpark.tiers.disk import ReadTxn

from .payload import pieces


class Miss(Exception):
    """A disk grant that this process cannot serve from the files; ask again without ``disk``."""


class Unreadable(Miss):
    """The files cannot be read from this process at all."""


class _Rec(NamedTuple):
    """What ``ReadTxn.read_block`` needs to know of a version."""

    seq_id: str
    key_gen: int
    fingerprint: int


def _blocks(part: pb.DiskPart) -> list[int]:
    if part.block_size <= 0:
        raise Miss(f"disk grant of {part.seq_id!r} names no block size")
    full, tail = divmod(part.nbytes, part.block_size)
    return [part.block_size] * full + ([tail] if tail else [])


def read_into(path: str, parts: Sequence[pb.DiskPart], flats: list[torch.Tensor]) -> None:
    blocks = [(i, _Rec(p.seq_id, p.key_gen, p.fingerprint), k, n)
              for i, p in enumerate(parts) for k, n in enumerate(_blocks(p))]
    dst = [f.numpy() for f in flats]
    if sum(n for *_, n in blocks) != sum(len(d) for d in dst):
        raise Miss("disk grant: the records do not add up to the payload")
    try:
        with envs.reading(path) as (txn, db):
            r = ReadTxn(txn, db)  # no corruption hooks: the daemon counts what it reads again
            at, view = -1, memoryview(b"")
            for di, do, si, so, n in pieces([len(d) for d in dst], [n for *_, n in blocks]):
                if si != at:
                    _, rec, k, length = blocks[si]
                    view, at = r.read_block(rec, k, length), si  # type: ignore[arg-type]
                np.copyto(dst[di][do:do + n], np.frombuffer(view, np.uint8, n, so))
    except DataLoss as e:  # missing or failing verification: the daemon reads it again
        raise Miss(str(e)) from None
    except (Unavailable, envs.Again) as e:  # this process's daemon closing its store; a mapping being replaced
        raise Miss(str(e)) from None
    except (OSError, lmdb.Error) as e:  # no access to the files, or no reader slot left
        raise Unreadable(f"the disk tier's files at {path}: {e}") from None
