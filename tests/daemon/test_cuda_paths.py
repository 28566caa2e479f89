"""CUDA-only: the second pass over the GPU paths (staging, ordering, device guards,
placement, sizing). Skipped without CUDA; run by bench/gpu_check.sh on a GPU machine.

Each test checks bytes or what ``stat`` reports, not log lines: a missing event or a copy
on the wrong stream shows as wrong data. The CPU side of the same logic (the staging plan,
copy runs, the order a restore ends in, the mapping shared per process, the pool's auto
size) is in ``tests/client/test_gpu_paths.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.client.vllm_io import STATS, BackgroundSaver, Conn, gather_blocks
from kvpark.daemon.server import Daemon
from kvpark.tiers import cuda

from .test_cuda import GPU, gblob

pytestmark = pytest.mark.cuda
MiB = 1 << 20


def test_staging_on_a_gpu_moves_exact_bytes_through_bounded_page_locked_buffers() -> None:
    st = cuda.Staging(torch.device("cuda:0"), chunk=1 * MiB)
    parts = [gblob(i, n) for i, n in enumerate([1, MiB - 3, 3 * MiB + 7, 0, 5 * MiB])]
    out = st.download(parts)
    assert all(o.device.type == "cpu" and torch.equal(o, p.cpu()) for o, p in zip(out, parts))
    dst = torch.empty(7 * MiB + 1, dtype=torch.uint8, device="cuda:0")
    src = gblob(9, 7 * MiB + 1).cpu()
    st.upload(dst, src)
    assert torch.equal(dst.cpu(), src)
    assert st.pinned_bytes == 4 * MiB  # two buffers each way, never more, whatever was moved


def test_device_tier_reads_and_writes_report_their_page_locked_memory(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{**GPU, "policy.restore_to": "device"})
    with Client(d.address, transport="inline") as c:
        for i in range(8):
            assert c.park(f"s{i}", [gblob(i)]).tier == "device"  # an inline park written through staging
        for i in range(8):
            assert torch.equal(c.restore(f"s{i}")[0], gblob(i).cpu()), i  # served from device through staging
        pinned = c.stat().pinned
    assert pinned["registered"] >= 128 * MiB  # the host arena
    assert 0 < pinned["staging"] <= 4 * cuda.STAGE_CHUNK * torch.cuda.device_count()


def test_pinning_from_a_thread_that_never_chose_a_device() -> None:
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    buf = torch.empty(16 * MiB, dtype=torch.uint8)
    got: list[object] = []

    def pin() -> None:
        got.append(cuda.pin_host(buf, dev))
        got.append(torch.cuda.current_device())

    t = threading.Thread(target=pin)
    t.start()
    t.join(60)
    try:
        assert got and got[0] is not None and buf.is_pinned()
        assert cuda.pinned_bytes()["registered"] >= 16 * MiB
    finally:
        cuda.unpin_host(buf, dev)
    assert not buf.is_pinned()


def test_an_in_process_daemon_serves_cuda_ipc_to_its_own_process(daemon: Callable[..., Daemon]) -> None:
    # CUDA refuses to open an IPC handle in the process that exported it: kvpark bench and
    # every embedded daemon with a cuda_ipc (or auto) client hit that.
    d = daemon(**GPU)
    src = [gblob(1), gblob(2, 3 * MiB + 5)]
    with Client(d.address, transport="cuda_ipc") as c:
        assert c.park("x", src).tier == "device"
        dst = [torch.empty_like(t) for t in src]
        c.restore("x", into=dst)
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
    with Client(d.address) as c:  # auto: the device pool for tensors on its GPU
        c.park("y", src)
        assert c._ipc is not None
        assert all(torch.equal(a, b) for a, b in zip(c.restore("y", device="cuda:0"), src))


def test_a_snapshot_gathered_on_another_stream_is_saved_whole(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**GPU)
    STATS.clear()
    kv = [gblob(50 + i, 8 * 64 * 1024).view(8, 64, 1024) for i in range(2)]  # [blocks, ...], block_dim 0
    want = torch.stack([torch.stack([layer[b] for layer in kv]) for b in (1, 4, 6)])
    saver = BackgroundSaver(Conn(d.address, "auto"), timeout_s=30, max_pending_bytes=1 << 30)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # kv was written on the default stream
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the gather queues behind ~0.1 s of GPU work
        packed = gather_blocks(kv, 0, [1, 4, 6])
        ready = cuda.record_event(packed.device)
    ids = ["ord-1", "ord-4", "ord-6"]
    assert saver.submit(ids, packed, {"layout": "t"}, ready)
    assert saver.drain(60) and STATS["saves"] == 1
    with Client(d.address) as c:
        for j, sid in enumerate(ids):
            (got,) = c.restore(sid, device="cuda:0")
            assert torch.equal(got, want[j]), sid
    saver.close()


def test_a_cuda_ipc_restore_with_no_device_room_goes_through_shm(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**GPU)  # a 64 MiB device tier
    with Client(d.address) as c:
        host = gblob(7, 8 * MiB)
        assert c.park("h", [host.cpu()]).tier == "host"
        for i in range(8):  # the whole device tier, pinned: nothing there can make room
            c.park(f"pin{i}", [gblob(20 + i, 8 * MiB)], pinned=True)
        shm = c._transport
        used: list[str] = []
        real = shm.restore

        def counted(ids, target):  # type: ignore[no-untyped-def]
            used.append(ids[0])
            return real(ids, target)

        shm.restore = counted  # type: ignore[method-assign]
        (got,) = c.restore("h", device="cuda:0")
        assert torch.equal(got, host) and used == ["h"]


def test_an_auto_sized_device_pool_takes_a_bounded_share_of_the_free_memory(daemon: Callable[..., Daemon]) -> None:
    free, _total = torch.cuda.mem_get_info(0)
    d = daemon(**{**GPU, "tiers.device.capacity": "auto", "tiers.device.auto_max": "1GiB"})
    with Client(d.address) as c:
        cap = c.stat().tiers["device"].capacity_bytes
    assert 256 * MiB - MiB <= cap <= min(1 << 30, free // 2)


def test_closing_a_layerwise_restore_midway_never_writes_into_reused_memory(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**GPU)
    src = [gblob(60 + i, 4 * MiB) for i in range(12)]
    with Client(d.address, transport="shm") as c:
        c.park("lw", [t.cpu() for t in src])
        for _ in range(5):
            r = c.restore("lw", device="cuda:0", layerwise=True)
            i, first = next(r)
            assert torch.equal(first, src[i])
            r.close()  # eleven copies may still be queued when it is closed
            fresh = [torch.full((4 * MiB,), 7, dtype=torch.uint8, device="cuda:0") for _ in range(12)]
            torch.cuda.synchronize()
            assert all(bool((f == 7).all()) for f in fresh)


def test_pinning_for_the_second_gpu_opens_no_context_on_the_first() -> None:
    """A rank's saver thread never chose a device: pinning for its GPU must not open a
    context (0.3-0.6 GiB) on GPU 0, which rank 0 filled with KV cache. Checked in a
    fresh process, where no context exists yet."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (only one is visible)")
    code = (
        "import threading, torch\n"
        "from kvpark.tiers import cuda\n"
        "buf = torch.empty(8 << 20, dtype=torch.uint8)\n"
        "t = threading.Thread(target=lambda: cuda.pin_host(buf, torch.device('cuda', 1)))\n"
        "t.start(); t.join()\n"
        "assert buf.is_pinned()\n"
        "print('CTX0', torch._C._cuda_hasPrimaryContext(0))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CTX0 False" in r.stdout


def test_an_index_goes_up_without_waiting_for_the_stream() -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.3 s of queued work on the current stream
    idx = cuda.as_index(list(range(1000)), torch.device("cuda:0"))
    assert not torch.cuda.current_stream().query(), "as_index waited for the queued work"
    assert idx.tolist() == list(range(1000))  # .tolist() waits; the values are right


def test_side_streams_are_one_per_role_and_reused() -> None:
    dev = torch.device("cuda:0")
    assert cuda.side_stream(dev, "d2h") is cuda.side_stream(dev, "d2h")
    assert cuda.side_stream(dev, "d2h") != cuda.side_stream(dev, "h2d")
    assert cuda.side_stream(dev, "d2h").priority < 0  # the high-priority pool


def test_a_park_queued_behind_long_gpu_work_outlives_no_lease(daemon: Callable[..., Daemon]) -> None:
    """The lease is asked for once the work queued on the tensors' stream is done: a park
    whose source is still being produced for longer than leases.ttl_s is committed, not
    refused (nor written into slots the daemon reaped and reused)."""
    d = daemon(**{**GPU, "leases.ttl_s": "1"})
    src = gblob(3, 8 * MiB)
    torch.cuda.synchronize()
    with Client(d.address, transport="shm") as c:
        torch.cuda._sleep(4_000_000_000)  # ~2-3 s on the current stream, longer than the TTL
        assert c.park("slow", [src]).tier == "host"
        assert torch.equal(c.restore("slow", device="cuda:0")[0], src)


def test_a_daemon_under_expandable_segments_serves_every_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An allocator with expandable segments may refuse to export the pool: cuda_ipc is
    then off (logged), and shm and inline still serve GPU tensors."""
    from ..conftest import Proc

    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        p = Proc.start(tmp_path, *[x for k, v in GPU.items() for x in ("--set", f"{k}={v}")])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        src = gblob(4, 6 * MiB)
        with Client(p.address) as c:
            c.park("e", [src])
            assert torch.equal(c.restore("e", device="cuda:0")[0], src)
        with Client(p.address, transport="inline") as c:
            assert torch.equal(c.restore("e", device="cuda:0")[0], src)
    finally:
        p.kill()


def test_vllm_blocks_saved_off_the_step_and_loaded_back_on_a_gpu(daemon: Callable[..., Daemon]) -> None:
    """The connector's data path (vLLM-free) on a GPU: FlashAttention-layout layers,
    a snapshot saved by the background saver, loaded into other blocks."""
    from kvpark.client.vllm_io import load_blocks, scatter_blocks  # noqa: F401

    d = daemon(**GPU)
    STATS.clear()
    layers = [gblob(80 + i, 2 * 8 * 16 * 4 * 64 * 2).view(torch.bfloat16).view(2, 8, 16, 4, 64) for i in range(3)]
    saver = BackgroundSaver(Conn(d.address, "auto"), timeout_s=30, max_pending_bytes=1 << 30)
    packed = gather_blocks(layers, 1, [1, 2, 5])
    assert saver.submit(["v1", "v2", "v5"], packed, {"layout": "t"}, cuda.record_event(packed.device))
    assert saver.drain(60) and STATS["saves"] == 1
    with Client(d.address) as c:
        assert load_blocks(c, layers, 1, [6, 7, 0], ["v1", "v2", "v5"], stage_bytes=1 << 20) == 3
    for layer in layers:
        assert torch.equal(layer[:, 6], layer[:, 1]) and torch.equal(layer[:, 7], layer[:, 2])
        assert torch.equal(layer[:, 0], layer[:, 5])
    saver.close()
