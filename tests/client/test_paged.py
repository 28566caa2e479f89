"""Paged adapter: round trips into other block ids, prefix sharing, refcounts, layout checks."""

from typing import Callable

import pytest
import torch

from kvpark.client import Client, FailedPrecondition, InvalidArgument, LayoutMismatch
from kvpark.client import paged
from kvpark.daemon.server import Daemon

L, NB, BS, H, D = 4, 64, 16, 2, 32  # fp16/bf16 token block = 16 KiB, one arena granule


def pool(dtype: torch.dtype = torch.bfloat16, seed: int = 0, **kw: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, kw.get("nb", NB), kw.get("bs", BS), kw.get("h", H), kw.get("d", D))
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(kw.get("layers", L))]


def blocks(kv: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [k[:, ids] for k in kv]


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_round_trip_into_other_block_ids_with_partial_last_block(daemon: Callable[..., Daemon],
                                                                  transport: str) -> None:
    d = daemon()
    src, dst = pool(seed=1), pool(seed=2)
    before = [t.clone() for t in dst]
    with Client(d.address, transport=transport) as c:
        info = paged.park_blocks(c, "req", src, [5, 9, 2, 40], num_tokens=3 * BS + 7)
        assert info.attrs["num_tokens"] == str(3 * BS + 7)
        assert paged.restore_blocks(c, "req", dst, [0, 1, 2, 3]) == 3 * BS + 7
    assert all(torch.equal(a, b) for a, b in zip(blocks(src, [5, 9, 2, 40]), blocks(dst, [0, 1, 2, 3])))
    # Blocks outside the target ids are untouched.
    assert all(torch.equal(a[:, 4:], b[:, 4:]) for a, b in zip(before, dst))


def test_layerwise_readiness_order_and_content(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    src, dst = pool(seed=3), pool(seed=4)
    with Client(d.address) as c:
        paged.park_blocks(c, "lw", src, [1, 2], num_tokens=2 * BS)
        seen = []
        for layer in paged.restore_blocks(c, "lw", dst, [7, 8], layerwise=True):
            assert torch.equal(dst[layer][:, [7, 8]], src[layer][:, [1, 2]])
            if layer + 1 < L:  # later layers are not there yet
                assert not torch.equal(dst[layer + 1][:, [7, 8]], src[layer + 1][:, [1, 2]])
            seen.append(layer)
        assert seen == list(range(L))


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_client_restore_layerwise_yields_in_order(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon()
    layers = [torch.full((1000 + i,), i, dtype=torch.int16) for i in range(6)]
    with Client(d.address, transport=transport) as c:
        c.park("layers", layers)
        got = list(c.restore("layers", layerwise=True))
    assert [i for i, _ in got] == list(range(6))
    assert all(torch.equal(t, layers[i]) for i, t in got)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_ten_sequences_share_a_1024_token_prefix(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon(**{"tiers.host.capacity": "64MiB"})
    prefix = list(range(1000, 1000 + 1024))
    kv = pool(dtype=torch.float16, seed=5, nb=256)
    block_bytes = L * 2 * BS * H * D * 2
    with Client(d.address, transport=transport) as c:
        tails = []
        for i in range(10):
            tail = [7 * i + j for j in range(40)]  # 40 private tokens each
            tokens = prefix + tail
            # The prefix lives in blocks 0..63 (as with an engine's own prefix cache); 3 private blocks each.
            ids = list(range(1024 // BS)) + [64 + 3 * i + j for j in range(3)]
            paged.park_blocks(c, f"seq{i}", kv, ids, num_tokens=len(tokens), tokens=tokens)
            tails.append((tokens, ids))
        st = c.stat()
        stored = st.tiers["host"].used_bytes + st.tiers["disk"].used_bytes
        ideal_blocks = 1024 // BS + 10 * 3
        assert stored <= 1.1 * ideal_blocks * block_bytes, (stored, ideal_blocks * block_bytes)
        # lookup is exact: the shared prefix plus the private full block(s) of a parked request.
        assert paged.lookup(c, kv, prefix + [99999] * 20) == 1024
        assert paged.lookup(c, kv, tails[3][0]) == (1024 + 40) // BS * BS
        assert paged.lookup(c, kv, [5] * 100) == 0
        # restore_prefix into a fresh request's blocks is bit-exact.
        fresh = pool(dtype=torch.float16, seed=6, nb=256)
        n = paged.restore_prefix(c, fresh, prefix + [1, 2, 3], list(range(150, 250)))
        assert n == 1024
        assert all(torch.equal(f[:, 150:150 + 1024 // BS], k[:, : 1024 // BS]) for f, k in zip(fresh, kv))
        # Fewer target blocks than the match: restores what fits.
        assert paged.restore_prefix(c, fresh, prefix, [250, 251]) == 2 * BS
        # Each sequence restores bit-exact.
        for i, (tokens, ids) in enumerate(tails):
            out = pool(dtype=torch.float16, seed=7, nb=256)
            assert paged.restore_blocks(c, f"seq{i}", out, list(range(len(ids)))) == len(tokens)
            assert all(torch.equal(o[:, : len(ids)], k[:, ids]) for o, k in zip(out, kv))
        # Refcounts: dropping 9 of 10 keeps the prefix; dropping the last frees it.
        first_key = paged.block_keys(paged.layout_of(kv), prefix)[0]
        assert c.info(first_key).refcount == 10
        with pytest.raises(FailedPrecondition, match="used by 10"):
            c.drop(first_key)
        for i in range(9):
            assert c.drop(f"seq{i}")
        assert c.info(first_key).refcount == 1
        assert paged.lookup(c, kv, prefix) == 1024
        assert c.drop("seq9")
        assert paged.lookup(c, kv, prefix) == 0
        st = c.stat()
        assert st.sequences == 0 and st.tiers["host"].used_bytes == 0 and st.tiers["disk"].used_bytes == 0


def test_keys_are_stable_across_a_daemon_restart(tmp_path: object, daemon: Callable[..., Daemon]) -> None:
    kv = pool(seed=8)
    tokens = list(range(5 * BS))
    d = daemon()
    with Client(d.address) as c:
        paged.park_blocks(c, "s", kv, [0, 1, 2, 3, 4], num_tokens=len(tokens), tokens=tokens)
    d.stop()
    d2 = daemon()
    with Client(d2.address) as c:
        assert paged.lookup(c, kv, tokens) == 5 * BS  # recomputed keys find the stored blocks
        out = pool(seed=9)
        assert paged.restore_prefix(c, out, tokens, [10, 11, 12, 13, 14]) == 5 * BS
        assert all(torch.equal(o[:, 10:15], k[:, 0:5]) for o, k in zip(out, kv))
        assert c.info(paged.block_keys(paged.layout_of(kv), tokens)[0]).refcount == 1


@pytest.mark.parametrize("other", [{"d": 64}, {"dtype": torch.float16}, {"bs": 32}, {"h": 4}, {"layers": 2}])
def test_layout_mismatch(daemon: Callable[..., Daemon], other: dict) -> None:
    d = daemon()
    kv = pool(seed=10)
    with Client(d.address) as c:
        paged.park_blocks(c, "s", kv, [0, 1], num_tokens=2 * BS)
        dtype = other.pop("dtype", torch.bfloat16)
        wrong = pool(dtype=dtype, seed=11, **other)
        with pytest.raises(LayoutMismatch):
            paged.restore_blocks(c, "s", wrong, [0, 1])
        # The daemon enforces it too, for any client that names the layout it expects.
        with pytest.raises(LayoutMismatch):
            c.restore_many(["s"], expect_layout=paged.layout_of(wrong).fingerprint)


def test_bad_inputs(daemon: Callable[..., Daemon]) -> None:
    from kvpark.client import InvalidArgument

    d = daemon()
    kv = pool(seed=12)
    with Client(d.address) as c:
        with pytest.raises(InvalidArgument):
            paged.park_blocks(c, "s", kv, [0], num_tokens=2 * BS)  # too few block ids
        with pytest.raises(InvalidArgument):
            paged.park_blocks(c, "s", kv, [0, NB], num_tokens=2 * BS)  # out of range
        with pytest.raises(InvalidArgument):
            paged.park_blocks(c, "s", [kv[0], kv[1][:, :, :8]], [0], num_tokens=BS)
        with pytest.raises(InvalidArgument):
            paged.park_blocks(c, "s", kv, [0, 1], num_tokens=2 * BS, tokens=[1, 2, 3])
        assert c.list() == []


def test_a_request_with_no_tokens_yet_parks_and_restores_as_nothing(daemon: Callable[..., Daemon]) -> None:
    """``num_tokens=0`` is allowed (a request parked before its first token): nothing is
    stored but its layout, and its restore touches no block. Negative counts are refused."""
    d = daemon()
    src, dst = pool(seed=1), pool(seed=2)
    before = [t.clone() for t in dst]
    with Client(d.address) as c:
        info = paged.park_blocks(c, "empty", src, [], num_tokens=0)
        assert info.nbytes == 0 and info.attrs["num_blocks"] == "0"
        assert paged.restore_blocks(c, "empty", dst, []) == 0
        with pytest.raises(InvalidArgument, match="num_tokens must be >= 0"):
            paged.park_blocks(c, "neg", src, [0], num_tokens=-1)
    assert all(torch.equal(a, b) for a, b in zip(before, dst))


def test_a_prefix_of_one_block_is_a_hit(daemon: Callable[..., Daemon]) -> None:
    """The smallest hit, one block, restores (bit-exact) like any other; no match is 0."""
    d = daemon()
    kv, fresh = pool(seed=3), pool(seed=4)
    tokens = list(range(500, 500 + BS + 5))  # one full block and 5 tokens
    with Client(d.address) as c:
        paged.park_blocks(c, "one", kv, [7, 8], num_tokens=len(tokens), tokens=tokens)
        assert paged.lookup(c, kv, tokens) == BS
        assert paged.restore_prefix(c, fresh, tokens, [20, 21]) == BS
        assert all(torch.equal(f[:, 20], k[:, 7]) for f, k in zip(fresh, kv))
        assert paged.restore_prefix(c, fresh, [1] * (2 * BS), [30, 31]) == 0
