"""CUDA-only: the device tier on a real GPU, pinned arena, D2H/H2D under concurrency, CUDA IPC.

Skipped without CUDA; run by bench/gpu_check.sh on a GPU machine.
"""

import functools
import logging
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from ..conftest import Proc, run_threads, wait_until

pytestmark = pytest.mark.cuda
MiB = 1 << 20
GPU = {"tiers.device.enabled": "true", "tiers.device.device": "cuda:0", "tiers.device.capacity": "64MiB",
       "tiers.host.capacity": "128MiB", "tiers.disk.capacity": "1GiB"}


def gblob(i: int, n: int = 4 * MiB) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def test_arena_is_page_locked_once(daemon: Callable[..., Daemon], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvpark.engine")
    daemon(**GPU)
    assert any("page-locked" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_device_tier_round_trip_and_pressure(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon(**GPU)
    with Client(d.address, transport=transport) as c:
        assert getattr(c._transport, "pinned", False) == (transport == "shm")  # the client page-locks its arena
        for i in range(60):  # 240 MiB through a 64 MiB device tier and a 128 MiB host tier
            c.park(f"s{i}", [gblob(i)])
        st = c.stat()
        assert st.tiers["disk"].sequences > 0 and st.tiers["host"].sequences > 0
        for i in range(60):
            (out,) = c.restore(f"s{i}", device="cuda:0")
            assert out.device.type == "cuda" and torch.equal(out, gblob(i)), i
        assert c.prefetch("s0", tier="device", wait=True, timeout=30) == "device"


def test_concurrent_d2h_and_h2d(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**GPU)

    def worker(w: int) -> None:
        with Client(d.address, transport="inline") as c:
            for i in range(20):
                sid = f"w{w}-{i}"
                c.park(sid, [gblob(w * 100 + i)])
                assert torch.equal(c.restore(sid, device="cuda:0")[0], gblob(w * 100 + i))

    errors = run_threads([functools.partial(worker, w) for w in range(4)])
    assert not errors, errors[0]


def test_cuda_ipc_transport(tmp_path: Path) -> None:
    p = Proc.start(tmp_path, *[x for k, v in GPU.items() for x in ("--set", f"{k}={v}")])
    try:
        with Client(p.address) as c:
            assert c.transport == "cuda_ipc"
            src = [gblob(1), gblob(2, 3 * MiB + 5).view(-1)]
            assert c.park("ipc", src).tier == "device"
            dst = [torch.empty_like(t) for t in src]
            c.restore("ipc", into=dst)
            assert all(torch.equal(a, b) for a, b in zip(src, dst))
            assert wait_until(lambda: c.stat().leases == 0)
    finally:
        p.kill()
