"""The compact control path of shm: packed tensor lists both ways, bit-exact, and the
long form (one TensorMeta per tensor) still served for clients that send it."""

from __future__ import annotations

from typing import Callable

import torch

from kvpark.client import Client
from kvpark.client.client import _header
from kvpark.daemon.server import Daemon
from kvpark.proto import convert
from kvpark.proto.v1 import kvpark_pb2 as pb


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    same = [torch.randn(4, 64, 128, generator=g).to(torch.bfloat16) for _ in range(24)]  # one run
    return same + [
        torch.randint(-5, 5, (3, 7), dtype=torch.int16, generator=g),
        torch.randn(0, 9, generator=g),
        torch.randn(2, 3, 5, generator=g, dtype=torch.float64).transpose(0, 2),  # not contiguous
        torch.randn(100_000, generator=g).half(),
        torch.tensor(True),
        *same[:3],  # the first run's shape again, after others
    ]


def test_shm_round_trip_over_the_compact_path(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    ts = tensors()
    with Client(d.address, transport="shm") as c:
        assert "packed" in c.server.features
        info = c.park("p", ts)
        assert [(m.dtype, m.shape) for m in info.tensors] == [
            (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in ts]
        into = [torch.zeros_like(t) for t in ts]
        c.restore("p", into=into)
        for a, b in zip(ts, into):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        out = c.restore("p")
        assert all(torch.equal(a, b) for a, b in zip(ts, out))
        assert c.info("p").tensors == info.tensors
    d.engine.check_invariants()


def test_the_long_form_still_works(daemon: Callable[..., Daemon]) -> None:
    """A client that predates the packed feature: repeated TensorMeta in, and out."""
    d = daemon()
    ts = [t.contiguous() for t in tensors()]
    with Client(d.address, transport="shm") as c:
        head = _header("old", ts, packed=False)
        assert not head.packed_tensors and len(head.tensors) == len(ts)
        r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=head))
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in ts])
        pos = 0
        for s in r.segments:
            c._transport.pool[s.offset : s.offset + s.length].copy_(flat[pos : pos + s.length])  # type: ignore[attr-defined]
            pos += s.length
        info = c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
        assert len(info.tensors) == len(ts) and not info.packed_tensors
        a = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="old"))
        assert len(a.info.tensors) == len(ts) and not a.info.packed_tensors
        c.rpc.release_quietly(a.lease_id)
        back = c.restore("old")
        assert all(torch.equal(x, y) for x, y in zip(ts, back))
        # The packed reply decodes to the same list as the long one.
        a = c.rpc.call(c.rpc.acquire, pb.AcquireRequest(seq_id="old", packed=True))
        c.rpc.release_quietly(a.lease_id)
        assert a.info.packed_tensors and not a.info.tensors
        assert convert.info_from_pb(a.info).tensors == convert.info_from_pb(info).tensors
    d.engine.check_invariants()
