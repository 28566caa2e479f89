"""CUDA-only: the device tier on a real GPU, pinned arena, D2H/H2D under concurrency, CUDA IPC.

Skipped without CUDA; run by bench/gpu_check.sh on a GPU machine. Each test checks bytes,
not log lines: a missing stream or cross-process synchronisation shows as wrong data.
"""

import functools
import hashlib
import json
import os
import subprocess
import sys
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


def gblob(i: int, n: int = 4 * MiB, device: str = "cuda:0") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def gpu_proc(tmp_path: Path, device: str = "cuda:0", **kw: object) -> Proc:
    cfg = {**GPU, "tiers.device.device": device}
    return Proc.start(tmp_path, *[x for k, v in cfg.items() for x in ("--set", f"{k}={v}")], **kw)  # type: ignore[arg-type]


# A second process: restores with the transport it is given, into CUDA tensors on its own
# first visible GPU, and prints each sequence's digest and whether it used the device pool.
READER = r"""
import hashlib, json, sys, torch
from kvpark.client import Client
addr, transport, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
with Client(addr, transport=transport) as c:
    for sid, n in ids:
        (t,) = c.restore(sid, into=[torch.empty(n, dtype=torch.uint8, device="cuda")])
        out[sid] = hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
    out["_pool"] = c._ipc is not None or c.transport == "cuda_ipc"
print("READ " + json.dumps(out))
"""


def read_in_child(address: str, transport: str, ids: list[tuple[str, int]], env: dict | None = None) -> dict:
    r = subprocess.run([sys.executable, "-c", READER, address, transport, json.dumps(ids)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, **(env or {})})
    line = next((l for l in r.stdout.splitlines() if l.startswith("READ ")), None)
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[len("READ "):])


def test_arenas_are_page_locked(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    d = daemon(**GPU)
    assert d.engine is not None and d.engine.arena_pinned
    assert d.engine.arena.tensor.is_pinned()
    p = gpu_proc(tmp_path)
    try:
        with Client(p.address, transport="shm") as c:
            assert not c._transport.pinned  # no GPU tensor has gone through it yet
            c.park("g", [gblob(1)])
            assert c._transport.pinned and c._transport.arena.tensor.is_pinned()
    finally:
        p.kill()


def test_device_tier_under_pressure_through_an_inline_client(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**GPU)
    with Client(d.address, transport="inline") as c:
        for i in range(60):  # 240 MiB through a 64 MiB device tier and a 128 MiB host tier
            c.park(f"s{i}", [gblob(i)])
        st = c.stat()
        assert st.tiers["device"].sequences > 0
        assert st.tiers["disk"].sequences > 0 and st.tiers["host"].sequences > 0
        for i in range(60):
            (out,) = c.restore(f"s{i}", device="cuda:0")
            assert out.device.type == "cuda" and torch.equal(out, gblob(i)), i
        assert c.prefetch("s0", tier="device", wait=True, timeout=30) == "device"
        (out,) = c.restore("s0", device="cuda:0")
        assert torch.equal(out, gblob(0))


def test_shm_parks_land_on_host_and_never_pressure_the_device(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**GPU)
    with Client(d.address, transport="shm") as c:
        for i in range(20):
            assert c.park(f"h{i}", [gblob(i)]).tier == "host"
        assert c.stat().tiers["device"].used_bytes == 0
        for i in range(20):
            (out,) = c.restore(f"h{i}", device="cuda:0")
            assert torch.equal(out, gblob(i)), i


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


def test_cuda_ipc_read_back_in_another_process_and_inline_after_a_forced_demotion(tmp_path: Path) -> None:
    p = gpu_proc(tmp_path)
    try:
        with Client(p.address) as c:
            # Step 1: auto + CUDA tensors on the daemon's GPU: parked through the device
            # pool, and read back at once (no synchronize of ours in between).
            src = [gblob(1), gblob(2, 3 * MiB + 5)]
            assert c.park("ipc", src).tier == "device"
            dst = [torch.empty_like(t) for t in src]
            c.restore("ipc", into=dst)
            assert all(torch.equal(a, b) for a, b in zip(src, dst))
            # CPU tensors from the same client go through the arena, never the device pool.
            assert c.park("cpu", [gblob(3).cpu()]).tier == "host"
            # Step 2: another process reads the device copies through its own IPC mapping.
            seqs = {f"d{i}": gblob(10 + i) for i in range(4)}
            for sid, t in seqs.items():
                assert c.park(sid, [t]).tier == "device"
            got = read_in_child(p.address, "cuda_ipc", [(s, t.numel()) for s, t in seqs.items()])
            assert got["_pool"] and all(got[s] == digest(t) for s, t in seqs.items())
            # Step 3: fill the 64 MiB device tier so the daemon demotes them (its D2H
            # copy engine reads what the client wrote), then read them inline.
            for i in range(20):
                c.park(f"fill{i}", [gblob(100 + i)])
            assert wait_until(lambda: all(c.info(s).tier != "device" for s in seqs), timeout=60)
            got = read_in_child(p.address, "inline", [(s, t.numel()) for s, t in seqs.items()])
            assert all(got[s] == digest(t) for s, t in seqs.items())
            assert wait_until(lambda: c.stat().leases == 0)
    finally:
        p.kill()


def test_larger_than_the_device_pool_through_cuda_ipc(tmp_path: Path) -> None:
    # 3x the 64 MiB device pool: parked through device windows to disk (the daemon's D2H of
    # each window), restored through them (H2D into the pool, device-to-device out).
    p = gpu_proc(tmp_path)
    try:
        with Client(p.address) as c:
            src = [gblob(40, 96 * MiB), gblob(41, 96 * MiB + 5)]
            assert c.park("big", src).tier == "disk"
            dst = [torch.empty_like(t) for t in src]
            c.restore("big", into=dst)
            assert all(torch.equal(a, b) for a, b in zip(src, dst))
            assert [torch.equal(a, b) for a, b in zip(c.restore("big", device="cuda:0"), src)] == [True, True]
            one = gblob(42, 200 * MiB)  # above the 128 MiB host tier too
            assert c.park("one", [one]).tier == "disk"
            got = read_in_child(p.address, "cuda_ipc", [("one", one.numel())])
            assert got["_pool"] and got["one"] == digest(one)
            assert wait_until(lambda: c.stat().leases == 0)
            assert c.stat().tiers["device"].used_bytes == 0
    finally:
        p.kill()


def test_a_pool_on_the_second_gpu(tmp_path: Path, daemon: Callable[..., Daemon]) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (only one is visible)")
    # In process: demotion and promotion on cuda:1 keep every byte.
    d = daemon(**{**GPU, "tiers.device.device": "cuda:1"})
    with Client(d.address, transport="inline") as c:
        for i in range(30):
            c.park(f"s{i}", [gblob(i, device="cuda:1")])
        for i in range(30):
            assert torch.equal(c.restore(f"s{i}", device="cuda:1")[0], gblob(i, device="cuda:1")), i
    # Across processes: a client that sees only that GPU knows it as cuda:0.
    p = gpu_proc(tmp_path, device="cuda:1")
    try:
        with Client(p.address, transport="inline") as c:
            t = gblob(7, device="cuda:1")
            c.park("x", [t])
        uuid = str(torch.cuda.get_device_properties(1).uuid)
        got = read_in_child(p.address, "cuda_ipc", [("x", t.numel())], env={"CUDA_VISIBLE_DEVICES": f"GPU-{uuid}"})
        assert got["_pool"] and got["x"] == digest(t)
    finally:
        p.kill()
