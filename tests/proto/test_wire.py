"""The hand-framed DataChunk messages are byte-identical to the generated encoding."""

import pytest

from kvpark.proto.errors import InvalidArgument
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import decode_chunk, encode_chunk, regroup


@pytest.mark.parametrize("offset", [0, 1, 127, 128, 1 << 20, (1 << 40) + 3])
@pytest.mark.parametrize("size", [1, 127, 128, 300, 1 << 20])
def test_encode_matches_generated(offset: int, size: int) -> None:
    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    ours = encode_chunk(offset, memoryview(data[:7]), memoryview(data[7:]))
    ref_park = pb.ParkRequest(chunk=pb.DataChunk(offset=offset, data=data)).SerializeToString()
    ref_restore = pb.RestoreResponse(chunk=pb.DataChunk(offset=offset, data=data)).SerializeToString()
    assert ours == ref_park == ref_restore
    off, view = decode_chunk(ours)
    assert off == offset and bytes(view) == data
    parsed = pb.ParkRequest.FromString(ours)
    assert parsed.chunk.offset == offset and parsed.chunk.data == data


def test_non_chunk_messages_are_left_to_the_generated_parser() -> None:
    head = pb.ParkRequest(header=pb.ParkHeader(seq_id="x")).SerializeToString()
    commit = pb.ParkRequest(commit=pb.ParkCommit(nbytes=5)).SerializeToString()
    assert decode_chunk(head) is None
    assert decode_chunk(commit) is None
    assert decode_chunk(b"") is None


@pytest.mark.parametrize("bad", [b"\x12", b"\x12\x05\x08", b"\x12\x03\x12\x05ab", b"\x12\x02\x08\x80"])
def test_malformed_chunks_raise_invalid_argument(bad: bytes) -> None:
    with pytest.raises(InvalidArgument):
        decode_chunk(bad)


def test_regroup_slices_without_losing_bytes() -> None:
    parts = [memoryview(bytes([i]) * n) for i, n in enumerate([3, 10, 0, 1, 7])]
    out = list(regroup(parts, 4))
    assert [off for off, _ in out] == [0, 4, 8, 12, 16, 20][: len(out)]
    assert all(sum(len(v) for v in vs) <= 4 for _, vs in out)
    assert b"".join(bytes(v) for _, vs in out for v in vs) == b"".join(bytes(p) for p in parts)
