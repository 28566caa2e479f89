"""Disk eviction to remote, several sequences at once (``tiers.remote.evict_parallel``).

Each move is the one-at-a-time move whole (``disk_evict.disk_to_remote``), so what must
hold is what held for several threads making room at once: every sequence restores
bit-exact from wherever it went, readers racing the eviction get the right bytes, the
accounting agrees, and a Redis that dies mid-eviction stops it without losing a
sequence that still had its disk copy.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from ..conftest import run_threads
from .test_remote_tier import _new_ns, _remote, blob

MiB = 1 << 20
N = 12


def size(i: int) -> int:
    return MiB + 4096 * i


def on_disk_only(daemon: Callable[..., Daemon], cfg: dict[str, Any]) -> Daemon:
    """A daemon whose index holds N sequences on disk only (parked, flushed, restarted)."""
    d = daemon(**cfg)
    with Client(d.address, transport="inline") as c:
        for i in range(N):
            c.park(f"s{i:02d}", [blob(i, size(i))])
        c.flush()
    d.stop(0.5)
    return daemon(**cfg)


@pytest.mark.parametrize("parallel", [1, 4])
def test_one_eviction_moves_many_and_each_restores_bit_exact(daemon, redis_server, parallel: int) -> None:
    cfg = {**_remote(redis_server.url, _new_ns(), write="on_evict", evict_parallel=parallel),
           "tiers.disk.capacity": "64MiB"}
    d = on_disk_only(daemon, cfg)
    eng = d.engine
    assert (eng.mover.evict_pool is not None) == (parallel > 1)
    assert eng.mover.evict_disk(0, target=0)
    assert eng.disk.used == 0
    with Client(d.address, transport="inline") as c:
        assert {c.info(f"s{i:02d}").tier for i in range(N)} == {"remote"}
        for i in range(N):
            assert torch.equal(c.restore(f"s{i:02d}")[0], blob(i, size(i)))
    eng.check_invariants()


def test_readers_racing_a_parallel_eviction_get_the_right_bytes(daemon, redis_server) -> None:
    cfg = {**_remote(redis_server.url, _new_ns(), write="on_evict", evict_parallel=4),
           "tiers.disk.capacity": "64MiB", "policy.promote_on_restore": "false"}
    d = on_disk_only(daemon, cfg)
    eng = d.engine
    go = threading.Event()

    def evict() -> None:
        go.wait(10)
        for _ in range(50):  # readers' leases keep some; go again until the disk is empty
            if eng.mover.evict_disk(0, target=0):
                return

    def read(k: int) -> None:
        with Client(d.address, transport="shm" if k % 2 else "inline") as c:
            go.set()
            for r in range(3):
                for i in range(N):
                    assert torch.equal(c.restore(f"s{i:02d}")[0], blob(i, size(i))), (k, r, i)

    assert run_threads([evict] + [lambda k=k: read(k) for k in range(3)]) == []
    with eng.mover.quiet():
        eng.check_invariants()


def test_redis_dying_mid_eviction_stops_it_and_loses_no_disk_copy(daemon, fresh_redis) -> None:
    cfg = {**_remote(fresh_redis.url, _new_ns(), write="on_evict", evict_parallel=4),
           "tiers.disk.capacity": "64MiB"}
    d = on_disk_only(daemon, cfg)
    eng = d.engine
    killer = threading.Timer(0.05, fresh_redis.stop)
    killer.start()
    try:
        eng.mover.evict_disk(0, target=0)  # True or False: it ends, whatever Redis does
    finally:
        killer.join()
    with eng.catalog.lock:
        left = [s.seq_id for s in (eng.catalog.find(f"s{i:02d}") for i in range(N)) if s is not None and s.on_disk]
    with Client(d.address, transport="inline") as c:
        for sid in left:  # every sequence that kept its disk copy is whole
            i = int(sid[1:])
            assert torch.equal(c.restore(sid)[0], blob(i, size(i)))
    with eng.mover.quiet():
        eng.check_invariants()
