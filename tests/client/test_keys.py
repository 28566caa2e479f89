"""Prefix block keys (``kvpark.client.keys``): what the vLLM connector and the paged
adapter name shared blocks by. A wrong key is a wrong prefix hit, so the chain's rules are
pinned here: full blocks only, a key per block chained to its parent, ``n_blocks`` a cut
at whole blocks, and only 1-D integer token ids taken."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpark.client import InvalidArgument
from kvpark.client.keys import PREFIX, block_keys, extend

FP = "layout-a"


def test_a_key_per_full_block_the_partial_tail_has_none() -> None:
    assert len(block_keys(FP, range(10), 4)) == 2
    assert len(block_keys(FP, range(8), 4)) == 2
    assert block_keys(FP, range(3), 4) == []
    assert all(k.startswith(PREFIX) for k in block_keys(FP, range(8), 4))


def test_keys_chain_so_a_prefix_shares_exactly_its_own_blocks() -> None:
    long = block_keys(FP, range(16), 4)
    assert block_keys(FP, range(9), 4) == long[:2]
    # The same block of tokens after a different parent is a different key.
    other = block_keys(FP, [99, 1, 2, 3, *range(4, 16)], 4)
    assert other[0] != long[0] and not set(other) & set(long)
    # Another layout never shares a key.
    assert not set(block_keys("layout-b", range(16), 4)) & set(long)


def test_n_blocks_cuts_at_whole_blocks() -> None:
    ids = list(range(10))
    full = block_keys(FP, ids, 4)
    assert block_keys(FP, ids, 4, n_blocks=1) == full[:1]
    assert block_keys(FP, ids, 4, n_blocks=2) == full
    assert block_keys(FP, ids, 4, n_blocks=5) == full  # never more than the full blocks there are
    assert block_keys(FP, ids, 4, n_blocks=0) == [] and block_keys(FP, ids, 4, n_blocks=-1) == []
    assert block_keys(FP, list(range(24)), 3, n_blocks=3) == block_keys(FP, list(range(9)), 3)


def test_extend_continues_a_chain() -> None:
    ids = list(range(12))
    chain = block_keys(FP, ids[:4], 4)
    assert extend(chain, FP, ids[4:], 4) == block_keys(FP, ids, 4)


@pytest.mark.parametrize("ids", [torch.arange(8), np.arange(8, dtype=np.int32), list(range(8))],
                         ids=["tensor", "int32 array", "list"])
def test_any_integer_sequence_gives_the_same_keys(ids: object) -> None:
    assert block_keys(FP, ids, 4) == block_keys(FP, list(range(8)), 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [np.int64(5), np.zeros((2, 4), dtype=np.int64), [0.5, 1.5],
                                 torch.zeros((2, 2), dtype=torch.int64)],
                         ids=["0-d", "2-d", "floats", "2-d tensor"])
def test_anything_but_1d_integer_token_ids_is_refused(ids: object) -> None:
    with pytest.raises(InvalidArgument, match="1-D"):
        block_keys(FP, ids, 4)  # type: ignore[arg-type]
