"""The compact tensor list (kvpark.proto.packed): round trips, and malformed input is typed."""

from __future__ import annotations

import struct

import pytest
import torch

from kvpark.proto import packed
from kvpark.proto.errors import InvalidArgument
from kvpark.proto.layout import TensorMeta


def test_round_trip_mixed_runs() -> None:
    ts = [torch.zeros(2, 3, dtype=torch.bfloat16)] * 3 + [torch.zeros(5, dtype=torch.float32),
                                                        torch.zeros(0, 4, dtype=torch.int8),
                                                        torch.zeros((), dtype=torch.float64),
                                                        torch.zeros(2, 3, dtype=torch.bfloat16)]
    data, total = packed.pack_tensors(ts)
    metas = packed.unpack(data)
    assert metas == tuple(TensorMeta.of(t) for t in ts)
    assert total == sum(t.numel() * t.element_size() for t in ts)
    assert packed.pack_metas(metas) == data
    # Runs: equal neighbours share one entry (3 bf16, then 4 distinct).
    assert struct.unpack_from("<BI", data)[1] == 5


def test_empty_list() -> None:
    data, total = packed.pack_tensors([])
    assert packed.unpack(data) == () and total == 0


@pytest.mark.parametrize("data", [
    b"",  # no header
    b"\x02\x00\x00\x00\x00",  # unknown version
    struct.pack("<BI", 1, 1),  # a run missing
    struct.pack("<BI", 1, 1) + struct.pack("<IBB", 1, 250, 0),  # unknown dtype code
    struct.pack("<BI", 1, 1) + struct.pack("<IBB", 1, 1, 2) + struct.pack("<q", 4),  # truncated shape
    struct.pack("<BI", 1, 1) + struct.pack("<IBB", 1, 1, 1) + struct.pack("<q", -4),  # negative dim
    struct.pack("<BI", 1, 1) + struct.pack("<IBB", 0, 1, 0),  # empty run
    struct.pack("<BI", 1, 1) + struct.pack("<IBB", 1 << 20, 1, 0),  # too many tensors
    struct.pack("<BI", 1, 1) + struct.pack("<IBB", 1, 1, 40),  # too many dims
    struct.pack("<BI", 1, 0) + b"x",  # trailing bytes
])
def test_malformed_is_invalid_argument(data: bytes) -> None:
    with pytest.raises(InvalidArgument):
        packed.unpack(data)
