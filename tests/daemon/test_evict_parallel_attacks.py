"""Attacks on parallel disk eviction to remote (tiers.remote.evict_parallel), from a fresh-eyes review."""

from __future__ import annotations

import threading
import time

import pytest

from .test_evict_parallel import N, on_disk_only
from .test_remote_tier import _new_ns, _remote


@pytest.mark.parametrize("parallel", [1, 4])
def test_eviction_whose_victims_are_busy_waits_for_them(daemon, redis_server, parallel: int) -> None:
    """Victims held by a promotion (or another eviction) for a moment: evict_disk waits
    for them within ROOM_WAIT_S ("Nothing moved: the victims were busy ... Wait for that
    to end"), as the one-at-a-time path does. The parallel path sets ``plan = []`` after
    trying them, so the wait's ``not plan`` check gives up at once: the caller's park or
    flush then fails with RESOURCE_EXHAUSTED though room was a moment away."""
    cfg = {**_remote(redis_server.url, _new_ns(), write="on_evict", evict_parallel=parallel),
           "tiers.disk.capacity": "64MiB"}
    d = on_disk_only(daemon, cfg)
    eng = d.engine
    with eng.catalog.lock:
        seqs = [eng.catalog.find(f"s{i:02d}") for i in range(N)]
    for s in seqs:  # as a promotion of each would: its move lock held
        assert eng.catalog.claim(s, blocking=False)

    def release() -> None:
        for s in seqs:
            eng.catalog.unclaim(s)

    timer = threading.Timer(0.5, release)
    timer.start()
    try:
        t0 = time.monotonic()
        ok = eng.mover.evict_disk(0, target=0)
        took = time.monotonic() - t0
    finally:
        timer.join()
    assert ok, f"gave up after {took:.2f}s; the victims were free {0.5 - took:.2f}s later"
    assert eng.disk.used == 0
    with eng.mover.quiet():
        eng.check_invariants()



def test_more_remote_callers_than_pool_connections_do_not_open_the_breaker(fresh_redis) -> None:
    """redis-py's pool holds max(8, 2*inflight) + evict_parallel = 12 connections, but the
    daemon's remote callers are the eviction pool (4), the store's pipeline pool (4) and
    every gRPC handler reading remote on its own thread (server.max_workers, 32). The 13th
    caller at once gets ``MaxConnectionsError: Too many connections``, which ``_call``
    counts as a Redis failure: the breaker opens and every remote read and eviction fails
    fast for the cooldown though Redis is fine. A Redis latency blip (CLIENT PAUSE here: a
    fork, a slow fsync) is enough to make callers overlap."""
    from kvpark.tiers.remote import RemoteOptions, RemoteStore

    store = RemoteStore(RemoteOptions(url=fresh_redis.url, namespace=_new_ns(), timeout_s=2.0,
                                      breaker_cooldown_s=5.0))
    try:
        assert store.get_manifest("warm") is None
        fresh_redis.cli("CLIENT", "PAUSE", "300", "ALL")
        errors: list[BaseException] = []

        def call() -> None:
            try:
                store.get_manifest("x")
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=call) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert errors == [], [repr(e) for e in errors[:2]]
        assert store.breaker.state == "closed"
    finally:
        store.close()
