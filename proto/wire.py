"""Hand-rolled protobuf framing for the hot ``DataChunk`` messages.

``ParkRequest.chunk`` and ``RestoreResponse.chunk`` are both field 2 of their oneof and
carry ``DataChunk{offset=1, data=2}``. The generated classes would copy the payload
twice per message (into a ``bytes`` field, then into the serialized string) and once
more when parsing. Here:

- ``encode_chunk(offset, *views) -> bytes``: one ``bytes.join`` over memoryviews: the
  payload is copied exactly once, into the message gRPC sends.
- ``decode_chunk(buf) -> (offset, memoryview) | None``: a zero-copy view of the payload
  inside the received message, or ``None`` when the message is not a chunk (then the
  caller parses it with the generated class).

The bytes are standard protobuf; ``tests/proto/test_wire.py`` checks them against the
generated classes both ways.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from .errors import InvalidArgument

_CHUNK_TAG = 0x12  # field 2, wire type 2 (length-delimited)
_OFFSET_TAG = 0x08  # field 1, varint
_DATA_TAG = 0x12  # field 2, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    end = len(buf)
    while True:
        if pos >= end or shift > 63:
            raise InvalidArgument("malformed chunk message (truncated varint)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def encode_chunk(offset: int, *views: memoryview) -> bytes:
    """Frame ``views`` (concatenated) as a oneof field-2 ``DataChunk`` at ``offset``."""
    n = sum(v.nbytes for v in views)
    inner_head = (_varint(_OFFSET_TAG) + _varint(offset) if offset else b"") + bytes((_DATA_TAG,)) + _varint(n)
    inner_len = len(inner_head) + n
    head = bytes((_CHUNK_TAG,)) + _varint(inner_len) + inner_head
    return b"".join((head, *views))


def decode_chunk(buf: bytes) -> tuple[int, memoryview] | None:
    """Parse a oneof field-2 ``DataChunk`` without copying its payload."""
    if not buf or buf[0] != _CHUNK_TAG:
        return None
    mv = memoryview(buf)
    inner_len, pos = _read_varint(mv, 1)
    end = pos + inner_len
    if end != len(mv):
        raise InvalidArgument("malformed chunk message (length prefix disagrees with message size)")
    offset = 0
    data = mv[0:0]
    while pos < end:
        key, pos = _read_varint(mv, pos)
        field, wtype = key >> 3, key & 7
        if wtype == 0:
            val, pos = _read_varint(mv, pos)
            if field == 1:
                offset = val
        elif wtype == 2:
            ln, pos = _read_varint(mv, pos)
            if pos + ln > end:
                raise InvalidArgument("malformed chunk message (field overruns message)")
            if field == 2:
                data = mv[pos : pos + ln]
            pos += ln
        elif wtype == 1:
            pos += 8
        elif wtype == 5:
            pos += 4
        else:
            raise InvalidArgument(f"malformed chunk message (wire type {wtype})")
    if pos != end:
        raise InvalidArgument("malformed chunk message (trailing bytes)")
    return offset, data


def regroup(views: Iterable[memoryview], size: int) -> Iterator[tuple[int, list[memoryview]]]:
    """Regroup a stream of views into ``(payload offset, views)`` pieces of at most
    ``size`` bytes each, slicing without copying. Feeds ``encode_chunk``."""
    start = 0
    pending: list[memoryview] = []
    pending_n = 0
    for v in views:
        off, n = 0, len(v)
        while off < n:
            take = min(n - off, size - pending_n)
            pending.append(v[off : off + take])
            pending_n += take
            off += take
            if pending_n == size:
                yield start, pending
                start, pending, pending_n = start + pending_n, [], 0
    if pending_n:
        yield start, pending
