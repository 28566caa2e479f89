"""The logic of the GPU paths that a CPU can check: the bounce-buffer staging plan, the
park's copy runs, the order in which a restore lets go of its outputs, the process's one
arena mapping, the auto-sized device pool, and what ``stat`` says of page-locked memory.

The same code runs on a GPU with events and side streams (``tests/daemon/test_cuda_paths.py``,
CUDA-only); here copies are synchronous, so what is checked is the plan: which bytes go
where, in how many rounds, and in what order things end.
"""

from __future__ import annotations

import random
import threading
from typing import Callable

import pytest
import torch

from kvpark.client import Client, mappings
from kvpark.client.payload import runs
from kvpark.client.transport import Restoring
from kvpark.daemon.config import ConfigError, load
from kvpark.daemon.memory import auto_device_capacity
from kvpark.daemon.server import Daemon
from kvpark.proto.types import SeqInfo
from kvpark.tiers import cuda

from ..conftest import run_threads

MiB = 1 << 20


def blob(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# ---------------------------------------------------------------- staging


def test_plan_chunks_fills_each_round_and_covers_every_byte_once() -> None:
    rng = random.Random(3)
    for _ in range(300):
        lengths = [rng.choice([0, 1, 5, 7, 8, 13, 40]) for _ in range(rng.randint(0, 7))]
        chunk = rng.choice([1, 7, 8, 64])
        rounds = cuda.plan_chunks(lengths, chunk)
        seen = [bytearray(n) for n in lengths]
        for k, rnd in enumerate(rounds):
            used = sum(n for *_, n in rnd)
            assert used <= chunk and all(n > 0 for *_, n in rnd)
            assert used == chunk or k == len(rounds) - 1, "only the last round may be short"
            pos = 0
            for i, off, boff, n in rnd:
                assert boff == pos  # packed tight into the buffer
                pos += n
                for b in range(off, off + n):
                    assert not seen[i][b]
                    seen[i][b] = 1
        assert all(all(s) for s in seen)


def test_staging_moves_exact_bytes_both_ways_through_two_small_buffers() -> None:
    st = cuda.Staging(torch.device("cpu"), chunk=7)
    parts = [blob(i, n) for i, n in enumerate([0, 1, 6, 7, 8, 30, 3])]
    out = st.download(parts)
    assert [torch.equal(a, b) for a, b in zip(parts, out)] == [True] * len(parts)
    assert all(o.data_ptr() != p.data_ptr() for o, p in zip(out, parts) if p.numel())  # copies, not views
    rounds = st.rounds
    assert rounds == -(-sum(p.numel() for p in parts) // 7)  # 55 bytes: 8 rounds of at most 7
    src, dst = blob(99, 50), torch.zeros(50, dtype=torch.uint8)
    st.upload(dst, src)
    assert torch.equal(dst, src) and st.rounds == rounds + 8
    assert st.pinned_bytes == 0  # plain buffers on a CPU; page-locked only on CUDA
    with pytest.raises(ValueError, match="upload of 50 bytes into 49"):
        st.upload(torch.zeros(49, dtype=torch.uint8), src)


def test_staging_serves_concurrent_callers_without_mixing_their_bytes() -> None:
    st = cuda.Staging(torch.device("cpu"), chunk=5)

    def user(w: int) -> None:
        for i in range(50):
            parts = [blob(w * 1000 + i, n) for n in (3, 11, 4)]
            assert all(torch.equal(a, b) for a, b in zip(parts, st.download(parts)))
            src, dst = blob(w * 1000 + i, 23), torch.empty(23, dtype=torch.uint8)
            st.upload(dst, src)
            assert torch.equal(dst, src)

    assert not run_threads([lambda w=w: user(w) for w in range(4)])


def test_device_tier_reads_and_writes_on_cpu_need_no_staging_and_no_pinned_memory() -> None:
    parts = [blob(1, 10)]
    assert cuda.to_host(parts)[0] is parts[0]
    assert cuda.pinned_bytes() == {"registered": 0, "staging": 0}
    assert cuda.record_event(torch.device("cpu")) is None
    assert cuda.as_index([3, 1, 2], torch.device("cpu")).tolist() == [3, 1, 2]
    assert cuda.memory_info(torch.device("cpu")) == (None, None)


# ---------------------------------------------------------------- park copy runs


def test_runs_merge_neighbouring_views_of_one_snapshot_into_one_copy() -> None:
    packed = blob(5, 4 * 100).view(4, 100)
    flats = [packed[j] for j in range(4)]
    (one,) = runs(flats, [(1000, 400)])  # adjacent in memory and in the pool: one copy
    assert one[1:] == (1000, 400) and torch.equal(one[0], packed.reshape(-1))
    split = runs(flats, [(0, 150), (500, 250)])  # the pool's segments cut it in two
    assert [(d, n) for _, d, n in split] == [(0, 150), (500, 250)]
    assert torch.equal(torch.cat([s for s, _, _ in split]), packed.reshape(-1))


def test_runs_never_merge_tensors_that_are_not_neighbours() -> None:
    a, b = blob(1, 64), blob(2, 64)  # two storages
    out = runs([a, b], [(0, 128)])
    assert [(d, n) for _, d, n in out] == [(0, 64), (64, 64)]
    base = blob(3, 300)
    gap = runs([base[0:100], base[150:250]], [(0, 200)])  # one storage, a hole between
    assert [(d, n) for _, d, n in gap] == [(0, 100), (100, 100)]
    assert torch.equal(gap[1][0], base[150:250])
    backwards = runs([base[100:200], base[0:100]], [(0, 200)])
    assert len(backwards) == 2 and torch.equal(backwards[0][0], base[100:200])


def test_a_park_of_many_views_of_one_snapshot_reads_back_exactly(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    packed = blob(8, 16 * 300 * 1024).view(16, 300 * 1024)  # 300 KiB blocks: slots and tails
    with Client(d.address, transport="shm") as c:
        c.park_batch({f"b{j}": [packed[j]] for j in range(16)})
        for j in range(16):
            (got,) = c.restore(f"b{j}")
            assert torch.equal(got, packed[j]), j


# ---------------------------------------------------------------- restore end order


def test_a_closed_restore_waits_for_its_copies_before_letting_go_of_its_outputs() -> None:
    """The cleanup (which waits for queued copies into the outputs) runs before the
    generator holding the outputs is closed: dropped first, their memory could be reused
    under a side-stream copy still writing it."""
    order: list[str] = []

    def tensors():
        try:
            yield 0, torch.zeros(1)
            yield 1, torch.zeros(1)
        finally:
            order.append("outputs released")

    r = Restoring(SeqInfo("x", 0, "host", 0), tensors(), lambda: order.append("copies waited, lease released"))
    next(r)
    r.close()
    assert order == ["copies waited, lease released", "outputs released"]
    r.close()  # once only
    assert len(order) == 2


# ---------------------------------------------------------------- one mapping per process


def test_clients_of_one_process_share_one_arena_mapping(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    before = mappings.mapped()
    a, b = Client(d.address, transport="shm"), Client(d.address, transport="shm")
    try:
        assert a._transport.arena is b._transport.arena and mappings.mapped() == before + 1
        a.park("m", [blob(1, 2 * MiB)])
        a.close()  # b's mapping stays: it is the same one
        (got,) = b.restore("m")
        assert torch.equal(got, blob(1, 2 * MiB))
        assert not b.pin_arena("cpu")  # only a GPU pins
    finally:
        a.close()
        b.close()
    assert mappings.mapped() == before


def test_a_restarted_daemons_arena_is_another_mapping(daemon: Callable[..., Daemon], tmp_path) -> None:
    first = daemon()
    old = Client(first.address, transport="shm")
    second = daemon(**{"tiers.disk.path": str(tmp_path / "disk2")})  # another daemon, another arena file
    new = Client(second.address, transport="shm")
    try:
        assert old._transport.arena is not new._transport.arena
        old.park("o", [blob(2, MiB)])
        new.park("o", [blob(3, MiB)])
        assert torch.equal(old.restore("o")[0], blob(2, MiB)) and torch.equal(new.restore("o")[0], blob(3, MiB))
    finally:
        old.close()
        new.close()


def test_many_clients_opening_and_closing_at_once_leave_no_mapping(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    before = mappings.mapped()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def user(w: int) -> None:
        for i in range(10):
            with Client(d.address, transport="shm") as c:
                c.park(f"u{w}", [blob(w * 100 + i, 256 << 10)], overwrite=True)
                with lock:
                    if not torch.equal(c.restore(f"u{w}")[0], blob(w * 100 + i, 256 << 10)):
                        errors.append(AssertionError(f"user {w} round {i}"))

    assert not run_threads([lambda w=w: user(w) for w in range(6)]) and not errors
    assert mappings.mapped() == before


# ---------------------------------------------------------------- auto-sized device pool


def test_auto_device_capacity_takes_a_bounded_share_of_the_free_memory() -> None:
    GiB = 1 << 30
    cap, why = auto_device_capacity(130 * GiB, 141 * GiB, 0.05, 256 * MiB, 8 * GiB)
    assert cap == int(130 * GiB * 0.05) and "0.05 of it" in why and "133120 MiB free" in why
    assert auto_device_capacity(400 * GiB, 500 * GiB, 0.05, 256 * MiB, 8 * GiB)[0] == 8 * GiB
    assert auto_device_capacity(2 * GiB, 80 * GiB, 0.05, 256 * MiB, 8 * GiB)[0] == 256 * MiB
    off, why = auto_device_capacity(300 * MiB, 80 * GiB, 0.05, 256 * MiB, 8 * GiB)
    assert off == 0 and why.startswith("off") and "tiers.device.capacity" in why
    assert auto_device_capacity(None, None, 0.05, 256 * MiB, 8 * GiB)[0] == 256 * MiB


def test_an_auto_sized_stand_in_pool_is_auto_min(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.device.enabled": "true", "tiers.device.device": "cpu", "tiers.device.capacity": "auto",
                  "tiers.device.auto_min": "4MiB"})
    with Client(d.address) as c:
        assert c.stat().tiers["device"].capacity_bytes == 4 * MiB


@pytest.mark.parametrize("key,value", [("auto_fraction", "0"), ("auto_fraction", "1.5"), ("auto_min", "0"),
                                       ("auto_max", "1MiB")])
def test_bad_auto_sizing_keys_are_refused(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"tiers.device.auto_"):
        load(env={}, overrides={f"tiers.device.{key}": value, "tiers.device.auto_min": "256MiB"}
             if key != "auto_min" else {f"tiers.device.{key}": value})


# ---------------------------------------------------------------- page-locked memory, reported


def test_stat_and_metrics_report_page_locked_memory(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"metrics.listen": "127.0.0.1:0"})
    with Client(d.address) as c:
        assert c.stat().pinned == {}  # no GPU here: nothing page-locked
    text = d.metrics.render().decode()
    assert 'kvpark_pinned_bytes{kind="registered"} 0.0' in text
    assert 'kvpark_pinned_bytes{kind="staging"} 0.0' in text


# ---------------------------------------------------------------- CUDA IPC handles


def test_an_ipc_handle_of_another_torch_release_is_refused_in_words() -> None:
    """The share tuple is torch's private layout: a handle names the release that made it,
    and another release refuses it instead of misreading it (the client then uses shm)."""
    import base64
    import json

    fields = [0, {"b64": base64.b64encode(b"handle").decode()}, 4096]
    other = json.dumps({"torch": "1.0", "fields": fields}).encode()
    with pytest.raises(RuntimeError, match="torch 1.0 shares its pool in a form"):
        cuda.open_ipc(other, 4096, torch.device("cuda", 0))
    for bad in (json.dumps(fields).encode(), b"not json", json.dumps({"fields": fields}).encode()):
        with pytest.raises(RuntimeError, match="malformed CUDA IPC handle"):
            cuda.open_ipc(bad, 4096, torch.device("cuda", 0))


def _client_maps(path: str) -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if path in line)


def test_a_client_dropped_without_close_lets_its_mapping_go(daemon: Callable[..., Daemon]) -> None:
    """A fresh-eyes attack: the process-wide registry held every mapping for the life of
    the process once a client was dropped unclosed, and later clients that did close
    never unmapped it either."""
    import gc

    d = daemon()
    before = mappings.mapped()
    for i in range(3):
        c = Client(d.address, transport="shm")
        path = c._transport.arena.path
        c.park(f"x{i}", [blob(i, 256 << 10)])
        del c
        gc.collect()
    assert mappings.mapped() == before
    assert _client_maps(path) == 1, "only the daemon's own mapping of its arena is left"
    with Client(d.address, transport="shm") as c:  # a fresh mapping works
        assert torch.equal(c.restore("x2")[0], blob(2, 256 << 10))


# ids without the word "cuda": the suite skips tests whose keywords carry it on a CPU.
@pytest.mark.parametrize("dev", ["cuda", "cuda:0", "cuda:3", "cpu"], ids=["gpu-bare", "gpu-0", "gpu-3", "cpu"])
def test_pin_arena_without_cuda_says_false(daemon: Callable[..., Daemon], dev: str) -> None:
    d = daemon()
    with Client(d.address, transport="shm") as c:
        assert c.pin_arena(dev) is False
    with Client(d.address, transport="inline") as c:
        assert c.pin_arena("cuda:0") is False


_GC_CHILD = """
import faulthandler, gc, sys
faulthandler.dump_traceback_later(60, exit=True)
from kvpark.client import Client, mappings
addr = sys.argv[1]
keep = Client(addr, transport="shm")  # a live use: the mapping stays
path, size = keep._transport.arena.path, keep._transport.arena.size
for n in range(60):
    gc.disable()
    c = Client(addr, transport="shm")
    c.me = c                      # a client in a cycle, dropped unclosed: only the collector frees it
    gc.collect(0)
    del c
    gc.set_threshold(n, 0, 100000)  # where the next automatic collection lands
    gc.enable()
    m = mappings.open_arena(path, size)  # an open on this thread, under the registry's lock
    gc.set_threshold(700, 10, 10)
    gc.collect()
    m.close()
keep.close()
print("OK", mappings.mapped())
"""


def test_a_collection_inside_open_arena_does_not_deadlock(daemon: Callable[..., Daemon]) -> None:
    """A fresh-eyes attack: a dropped use's finalizer runs on whichever thread starts a
    collection, also one inside ``open_arena`` holding the registry's lock; with a plain
    lock that thread waited on itself for ever. Run in a child (a hang ends it)."""
    import subprocess
    import sys

    d = daemon()
    p = subprocess.run([sys.executable, "-c", _GC_CHILD, d.address], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and "OK 0" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
