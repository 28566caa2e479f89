"""Tensor metadata, payload layout and the layout fingerprint.

A parked sequence is a list of tensors. Its *payload* is their raw bytes laid end to
end in list order (each tensor contiguous, row-major). Tensor ``i`` occupies
``[offsets[i], offsets[i] + nbytes[i])``, so any one tensor's (for example one
layer's) bytes are reachable without reading the others.

Primitives:
- ``TensorMeta``: dtype name, shape and byte size of one tensor.
- ``DTYPES``: dtype name -> item size, for every dtype this torch build has (torch is
  imported at its first use, not with this module: the CLI reads infos without torch).
- ``validate_tensors(metas, declared_nbytes)``: raise ``InvalidArgument`` unless consistent.
- ``validate_seq_id(seq_id)``: raise ``InvalidArgument`` for empty, overlong or control-char ids.
- ``payload_offsets(metas) -> list[int]``.
- ``overlaps(src_lengths, dst_lengths)``: the overlaps of two partitions of one byte
  range (tensors vs slots, slots vs slots), used by both sides.
- ``fingerprint(metas) -> int``: 64-bit xxh3 of the canonical metadata; stored with every
  block on disk and checked on read, so bytes are never returned under the wrong layout.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import xxhash

from .errors import InvalidArgument

if TYPE_CHECKING:
    import torch

MAX_SEQ_ID_BYTES = 256
# Control characters (C0 and DEL), which an id may not hold: one regex search, where a
# test per character cost a lookup of 16 ids more than the index lookups themselves.
_CONTROL = re.compile("[\x00-\x1f\x7f]")
MAX_TENSORS = 1 << 16
MAX_DIMS = 16
MAX_SEQ_BYTES = 1 << 46

_CANDIDATES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)


def _dtype_table() -> dict[str, int]:
    import torch

    table: dict[str, int] = {}
    for name in _CANDIDATES:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            table[name] = torch.empty(0, dtype=dt).element_size()
    return table


class _Dtypes(Mapping[str, int]):
    """``_dtype_table()``, built at the first lookup (importing torch then)."""

    _table: dict[str, int] | None = None

    def _get(self) -> dict[str, int]:
        if self._table is None:
            self._table = _dtype_table()
        return self._table

    def __getitem__(self, name: str) -> int:
        return self._get()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._get()

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


DTYPES: Mapping[str, int] = _Dtypes()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidArgument(f"unsupported dtype {dtype}; supported: {', '.join(sorted(DTYPES))}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise InvalidArgument(f"unsupported dtype {name!r}; supported: {', '.join(sorted(DTYPES))}")
    return getattr(torch, name)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(dtype_name(t.dtype), tuple(int(d) for d in t.shape), t.numel() * t.element_size())

    def to_json(self) -> list:
        return [self.dtype, list(self.shape), self.nbytes]

    @staticmethod
    def from_json(v: list) -> "TensorMeta":
        return TensorMeta(str(v[0]), tuple(int(d) for d in v[1]), int(v[2]))


def validate_seq_id(seq_id: str) -> None:
    if not isinstance(seq_id, str) or not seq_id:
        raise InvalidArgument("seq_id must be a non-empty string")
    n = len(seq_id.encode("utf-8"))
    if n > MAX_SEQ_ID_BYTES:
        raise InvalidArgument(f"seq_id is {n} bytes; the limit is {MAX_SEQ_ID_BYTES}")
    if _CONTROL.search(seq_id):
        raise InvalidArgument("seq_id must not contain control characters")


def validate_tensors(metas: list[TensorMeta] | tuple[TensorMeta, ...], declared_nbytes: int) -> None:
    if len(metas) > MAX_TENSORS:
        raise InvalidArgument(f"{len(metas)} tensors; the limit is {MAX_TENSORS}")
    total = 0
    prev = None
    for i, m in enumerate(metas):
        if m is prev:  # a run of one object (kvpark.proto.packed): checked once
            total += m.nbytes
            continue
        prev = m
        if m.dtype not in DTYPES:
            raise InvalidArgument(
                f"tensor {i}: unsupported dtype {m.dtype!r}; supported: {', '.join(sorted(DTYPES))}"
            )
        if len(m.shape) > MAX_DIMS:
            raise InvalidArgument(f"tensor {i}: {len(m.shape)} dims; the limit is {MAX_DIMS}")
        if any(d < 0 for d in m.shape):
            raise InvalidArgument(f"tensor {i}: negative dimension in shape {list(m.shape)}")
        expect = math.prod(m.shape) * DTYPES[m.dtype]
        if m.nbytes != expect:
            raise InvalidArgument(
                f"tensor {i}: nbytes {m.nbytes} disagrees with shape {list(m.shape)} x {m.dtype} = {expect}"
            )
        total += expect
    if total != declared_nbytes:
        raise InvalidArgument(f"declared nbytes {declared_nbytes} != sum of tensor sizes {total}")
    if total > MAX_SEQ_BYTES:
        raise InvalidArgument(f"sequence of {total} bytes exceeds the {MAX_SEQ_BYTES}-byte limit")


def payload_offsets(metas: list[TensorMeta] | tuple[TensorMeta, ...]) -> list[int]:
    offs, pos = [], 0
    for m in metas:
        offs.append(pos)
        pos += m.nbytes
    return offs


def fingerprint(metas: list[TensorMeta] | tuple[TensorMeta, ...]) -> int:
    canon = json.dumps([m.to_json() for m in metas], separators=(",", ":")).encode()
    return xxhash.xxh3_64_intdigest(canon)


def overlaps(src: Sequence[int], dst: Sequence[int]) -> Iterator[tuple[int, int, int, int, int]]:
    """Walk two partitions of the same byte range: ``(src_index, src_offset, dst_index,
    dst_offset, length)`` for each overlap, in order (empty parts are skipped)."""
    si = di = so = do = 0
    while si < len(src) and di < len(dst):
        if src[si] == so:
            si, so = si + 1, 0
            continue
        if dst[di] == do:
            di, do = di + 1, 0
            continue
        n = min(src[si] - so, dst[di] - do)
        yield si, so, di, do, n
        so += n
        do += n
