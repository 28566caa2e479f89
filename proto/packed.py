"""The compact binary form of a tensor list (``packed_tensors`` on the wire).

A park or restore of many tensors (a vLLM save: hundreds of same-shaped layer blocks)
spent more time building and parsing one protobuf ``TensorMeta`` per tensor than the
rest of its control path. This form stores runs of equal (dtype, shape), so 256 equal
tensors cost 20 bytes and one object on each side.

Layout (little endian)::

    u8 version (1) | u32 run count | runs
    run := u32 repeat | u8 dtype code | u8 ndim | ndim x i64 dim

Dtype codes index ``CODES`` (a fixed list: codes never change meaning). ``nbytes`` of
each tensor follows from its dtype and shape.

Primitives:
- ``pack_metas(metas) -> bytes``; ``pack_tensors(tensors) -> (bytes, total_nbytes)``
  (straight from torch tensors, without a ``TensorMeta`` per tensor).
- ``unpack(data) -> tuple[TensorMeta, ...]``: raises ``InvalidArgument`` on anything
  malformed (truncated, trailing bytes, unknown dtype code or version, too many tensors
  or dims, negative dims).
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Sequence

from .errors import InvalidArgument
from .layout import DTYPES, MAX_DIMS, MAX_TENSORS, TensorMeta, dtype_name

if TYPE_CHECKING:  # torch only where tensors are handled: the CLI reads infos without it
    import torch

VERSION = 1
# Append only: a code's meaning is part of the wire contract.
CODES: tuple[str, ...] = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)
_CODE = {name: i for i, name in enumerate(CODES)}
_HEAD = struct.Struct("<BI")
_RUN = struct.Struct("<IBB")


def _runs(keys: Sequence[tuple[str, tuple[int, ...]]]) -> list[tuple[int, str, tuple[int, ...]]]:
    runs: list[tuple[int, str, tuple[int, ...]]] = []
    prev = None
    count = 0
    for k in keys:
        if k == prev:
            count += 1
            continue
        if prev is not None:
            runs.append((count, *prev))
        prev, count = k, 1
    if prev is not None:
        runs.append((count, *prev))
    return runs


def _encode(runs: list[tuple[int, str, tuple[int, ...]]]) -> bytes:
    out = [_HEAD.pack(VERSION, len(runs))]
    for count, dtype, shape in runs:
        out.append(_RUN.pack(count, _CODE[dtype], len(shape)))
        out.append(struct.pack(f"<{len(shape)}q", *shape))
    return b"".join(out)


def pack_metas(metas: Sequence[TensorMeta]) -> bytes:
    return _encode(_runs([(m.dtype, tuple(m.shape)) for m in metas]))


def pack_tensors(tensors: Sequence[torch.Tensor]) -> tuple[bytes, int]:
    """The packed list and the payload size, one dtype/shape comparison per tensor."""
    runs: list[tuple[int, str, tuple[int, ...]]] = []
    total = 0
    prev_dtype: torch.dtype | None = None
    prev_shape: torch.Size | None = None
    count = 0
    size = 0
    for t in tensors:
        dt, shape = t.dtype, t.shape
        if dt is prev_dtype and shape == prev_shape:
            count += 1
            total += size
            continue
        if prev_dtype is not None:
            runs.append((count, dtype_name(prev_dtype), tuple(prev_shape)))  # type: ignore[arg-type]
        prev_dtype, prev_shape, count = dt, shape, 1
        size = t.numel() * t.element_size()
        total += size
    if prev_dtype is not None:
        runs.append((count, dtype_name(prev_dtype), tuple(prev_shape)))  # type: ignore[arg-type]
    return _encode(runs), total


def unpack(data: bytes) -> tuple[TensorMeta, ...]:
    mv = memoryview(data)
    try:
        version, nruns = _HEAD.unpack_from(mv, 0)
    except struct.error:
        raise InvalidArgument("packed_tensors: truncated header") from None
    if version != VERSION:
        raise InvalidArgument(f"packed_tensors: unknown version {version}")
    pos = _HEAD.size
    out: list[TensorMeta] = []
    for _ in range(nruns):
        try:
            count, code, ndim = _RUN.unpack_from(mv, pos)
            pos += _RUN.size
            if ndim > MAX_DIMS:
                raise InvalidArgument(f"packed_tensors: {ndim} dims; the limit is {MAX_DIMS}")
            shape = struct.unpack_from(f"<{ndim}q", mv, pos)
            pos += 8 * ndim
        except struct.error:
            raise InvalidArgument("packed_tensors: truncated run") from None
        if code >= len(CODES) or CODES[code] not in DTYPES:
            raise InvalidArgument(f"packed_tensors: unknown dtype code {code}")
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"packed_tensors: negative dimension in shape {list(shape)}")
        if count == 0 or len(out) + count > MAX_TENSORS:
            raise InvalidArgument(f"packed_tensors: a run of {count} tensors (at most {MAX_TENSORS} in all, "
                                  "runs not empty)")
        dtype = CODES[code]
        meta = TensorMeta(dtype, shape, math.prod(shape) * DTYPES[dtype])
        out.extend((meta,) * count)  # frozen: one object per run is enough
    if pos != len(mv):
        raise InvalidArgument(f"packed_tensors: {len(mv) - pos} trailing bytes")
    return tuple(out)
