"""Every dtype and shape round-trips bit-exact through a real daemon, on every transport."""

from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.layout import DTYPES

TRANSPORTS = ["inline", "shm"]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return raw[:n].view(dtype).reshape(shape).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_dtype(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon()
    tensors = [sample(getattr(torch, name), (3, 5, 7), i) for i, name in enumerate(sorted(DTYPES))]
    with Client(d.address, transport=transport) as c:
        assert c.transport == transport
        info = c.park("all-dtypes", tensors)
        assert info.num_tensors == len(tensors) and info.tier == "host"
        assert info.nbytes == sum(t.numel() * t.element_size() for t in tensors)
        back = c.restore("all-dtypes")
    assert all(same_bits(a, b) for a, b in zip(tensors, back))
    for name in ("bfloat16", "float16", "float32", "int8"):
        assert name in DTYPES
    assert any(n.startswith("float8") for n in DTYPES)


SHAPES = [(), (0,), (4, 0, 3), (1,), (7, 13), (2, 3, 4, 5), ((1 << 20) + 3,), (3, 1 << 19)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shapes_including_zero_size_and_multi_block(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon()
    tensors = [sample(torch.float16, s, i) for i, s in enumerate(SHAPES)]
    with Client(d.address, transport=transport) as c:
        c.park("shapes", tensors)
        back = c.restore("shapes")
    assert [tuple(t.shape) for t in back] == [tuple(s) for s in SHAPES]
    assert all(same_bits(a, b) for a, b in zip(tensors, back))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_empty_sequence_and_no_tensors(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon()
    with Client(d.address, transport=transport) as c:
        assert c.park("none", []).nbytes == 0
        assert c.restore("none") == []
        c.park("zero", [torch.empty(0, 8)])
        assert c.restore("zero")[0].shape == (0, 8)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_non_contiguous_inputs(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon()
    base = sample(torch.float32, (64, 48), 3)
    views = [base.t(), base[::2, 1::3], base.unsqueeze(0).expand(3, 64, 48)]
    with Client(d.address, transport=transport) as c:
        c.park("views", views)
        back = c.restore("views")
    assert all(b.is_contiguous() and same_bits(a, b) for a, b in zip(views, back))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cols", [1000, 60_000])  # one-round-trip small path, and the streamed/leased path
def test_restore_into_in_place(daemon: Callable[..., Daemon], transport: str, cols: int) -> None:
    d = daemon()
    src = [sample(torch.bfloat16, (33, cols), 1), sample(torch.int32, (5,), 2)]
    with Client(d.address, transport=transport) as c:
        c.park("into", src)
        dst = [torch.zeros(33, cols, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int32)]
        ptrs = [t.data_ptr() for t in dst]
        out = c.restore("into", into=dst)
        assert out[0] is dst[0] and [t.data_ptr() for t in dst] == ptrs
        assert all(same_bits(a, b) for a, b in zip(src, dst))
        # A non-contiguous destination is filled too (through one staging copy).
        nc = torch.zeros(cols, 33, dtype=torch.bfloat16).t()
        c.restore("into", into=[nc, torch.zeros(5, dtype=torch.int32)])
        assert same_bits(nc, src[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cols", [10, 60_000])  # one-round-trip small path, and the streamed/leased path
def test_restore_to_device_cpu_and_meta(daemon: Callable[..., Daemon], transport: str, cols: int) -> None:
    d = daemon()
    src = [sample(torch.float32, (10, cols), 9), sample(torch.int8, (3,), 4)]
    with Client(d.address, transport=transport) as c:
        c.park("dev", src)
        out = c.restore("dev", device="cpu")
        assert all(o.device.type == "cpu" and same_bits(o, s) for o, s in zip(out, src))
        # The meta device holds no bytes: the restore honours device= with the right shapes and dtypes.
        meta = c.restore("dev", device="meta")
        assert [(o.device.type, o.shape, o.dtype) for o in meta] == [("meta", s.shape, s.dtype) for s in src]
        assert c.stat().leases == 0


def test_overwrite_replaces_and_frees(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        c.park("s", [torch.ones(1 << 20, dtype=torch.uint8)])
        used = c.stat().tiers["host"].used_bytes
        c.park("s", [torch.full((10,), 7, dtype=torch.uint8)], overwrite=True)
        assert torch.equal(c.restore("s")[0], torch.full((10,), 7, dtype=torch.uint8))
        assert c.stat().tiers["host"].used_bytes < used
        assert c.stat().sequences == 1


def test_info_list_drop_stat(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        c.park("b", [torch.zeros(3)], priority=4)
        c.park("a", [torch.zeros(2, 2, dtype=torch.float16)])
        info = c.info("b")
        assert (info.seq_id, info.nbytes, info.tier, info.num_tensors, info.priority) == ("b", 12, "host", 1, 4)
        assert [s.seq_id for s in c.list()] == ["a", "b"]
        st = c.stat()
        assert set(st.tiers) == {"host", "disk"}
        host = st.tiers["host"]
        assert (host.sequences, host.blocks) == (2, 2) and host.capacity_bytes == 16 << 20
        assert c.drop("b") is True
        assert c.drop("b") is False
        assert [s.seq_id for s in c.list()] == ["a"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [100, 300_000])
def test_park_batch_creates_many_in_one_commit_and_skips_existing(daemon: Callable[..., Daemon], transport: str,
                                                                  size: int) -> None:
    d = daemon()
    items = {f"blk{i}": [sample(torch.uint8, (size,), i)] for i in range(6)}
    with Client(d.address, transport=transport) as c:
        c.park("blk2", [torch.zeros(3, dtype=torch.uint8)])  # already there: kept as it is
        new = c.park_batch(items, attrs={"kind": "test"})
        assert new == 5 * size
        assert c.present([f"blk{i}" for i in range(7)]) == [True] * 6 + [False]
        assert c.lookup([f"blk{i}" for i in range(7)]) == 6
        assert c.info("blk0").attrs == {"kind": "test"}
        info, back = c.restore_many([f"blk{i}" for i in (0, 1, 3)])
        assert info.nbytes == 3 * size
        assert all(same_bits(b, items[f"blk{i}"][0]) for b, i in zip(back, (0, 1, 3)))
        assert c.restore("blk2")[0].numel() == 3
        assert c.park_batch({"blk0": items["blk0"]}) == 0
        st = c.stat()
        assert st.sequences == 6 and st.leases == 0
