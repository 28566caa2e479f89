"""The remote tier's promises through a real daemon and a real redis-server.

- "A sequence leaves the disk only once its copy is in Redis" (docs/remote.md): checked
  in Redis when the disk copy goes, not remembered; a copy Redis lost since (expired,
  evicted, flushed, deleted by another daemon) is written again first.
- A remote sequence found gone takes the shared blocks only it used out of the index
  and off the local disk (exact accounting).
- A Redis that hangs (SIGSTOP) rather than refusing: the daemon keeps serving its local
  tiers within every deadline, the breaker opens, and the tier resumes afterwards.
- A Redis slow but healthy (CLIENT PAUSE): write_through copies waiting for it are
  bounded (``tiers.remote.max_pending``); the rest are skipped and counted, drops still
  reach Redis, and every park restores from its local copy.
"""

from __future__ import annotations

import os
import signal
from typing import Callable

import pytest
import torch

from kvpark.client import Client, NotFound
from kvpark.daemon.server import Daemon
from kvpark.tiers.remote import RemoteOptions, RemoteStore

from ..conftest import wait_until
from ..redis_servers import RedisServer
from .test_remote_tier import _new_ns, _remote, _synced, blob

MiB = 1 << 20
SMALL = {"tiers.host.capacity": "4MiB", "tiers.disk.capacity": "8MiB"}


def check(d: Daemon) -> None:
    assert d.engine is not None
    d.engine.check_invariants()


def _tier(c: Client, seq_id: str) -> str:
    return c.info(seq_id).tier


def _park_until(c: Client, cond: Callable[[], bool], start: int, limit: int = 64) -> int:
    """Park 1 MiB fills (each synced to Redis) until ``cond()``; returns the next index."""
    i = start
    while not cond():
        c.park(f"fill{i}", [blob(100 + i)])
        assert wait_until(lambda: _synced(c), timeout=30)
        i += 1
        assert i < start + limit, "the condition never came"
    return i


def _lose(srv: RedisServer, ns: str, how: str) -> None:
    """Make Redis lose "s" behind the daemon's back."""
    if how == "flushed":
        srv.cli("flushdb")
        return
    keys = srv.cli("--scan", "--pattern", f"{ns}:*").split()
    mine = [k for k in keys if k == f"{ns}:o:m:s" or ":s:" in k]
    assert mine, keys
    if how == "manifest-deleted":  # another daemon's delete removes the manifest first
        srv.cli("del", f"{ns}:o:m:s")
    else:  # Redis's maxmemory evicted one chunk
        srv.cli("del", next(k for k in mine if ":v:" in k))


@pytest.mark.parametrize("how", ["manifest-deleted", "chunk-evicted", "flushed"])
def test_disk_eviction_copies_again_a_sequence_whose_remote_copy_is_gone(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer, how: str) -> None:
    ns = _new_ns()
    d = daemon(**SMALL, **_remote(fresh_redis.url, ns))
    with Client(d.address, transport="inline") as c:
        # Step: "s" is copied to Redis (write_through), then demoted to disk only.
        c.park("s", [blob(1)])
        assert wait_until(lambda: _synced(c), timeout=30)
        i = _park_until(c, lambda: _tier(c, "s") == "disk", 0)
        # Step: Redis loses it; then the disk evicts it (it is the coldest there).
        _lose(fresh_redis, ns, how)
        _park_until(c, lambda: _tier(c, "s") == "remote", i)
        # Step: the copy that let it leave the disk is the one in Redis now.
        assert torch.equal(c.restore("s")[0], blob(1)), "disk eviction deleted the only copy"
        check(d)


def test_disk_eviction_never_hides_a_later_version_another_daemon_wrote(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer) -> None:
    ns = _new_ns()
    d = daemon(**SMALL, **_remote(fresh_redis.url, ns))
    other = RemoteStore(RemoteOptions(url=fresh_redis.url, namespace=ns))
    try:
        with Client(d.address, transport="inline") as c:
            c.park("s", [blob(1)])
            assert wait_until(lambda: _synced(c), timeout=30)
            i = _park_until(c, lambda: _tier(c, "s") == "disk", 0)
            # Step: another daemon overwrites "s" in the shared namespace.
            assert d.engine is not None
            with d.engine.catalog.lock:
                mine = d.engine.catalog.find("s")
            assert mine is not None
            theirs = mine.manifest.replace(gen=mine.manifest.gen + 1000)
            other.put(theirs, [memoryview(blob(9).numpy().tobytes())])
            # Step: the disk evicts "s": its superseded version is not copied over theirs.
            _park_until(c, lambda: _tier(c, "s") == "remote", i)
            cur = other.get_manifest("s")
            assert cur is not None and cur.gen == theirs.gen, "eviction republished a superseded version"
            assert bytes(other.read(theirs)) == blob(9).numpy().tobytes()
            check(d)
    finally:
        other.close()


def test_a_restore_of_a_sequence_missing_a_chunk_is_not_found_not_data_loss(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer) -> None:
    ns = _new_ns()
    d = daemon(**SMALL, **_remote(fresh_redis.url, ns, chunk_size="64KiB"))
    with Client(d.address, transport="inline") as c:
        c.park("s", [blob(1)])
        assert wait_until(lambda: _synced(c), timeout=30)
        _park_until(c, lambda: _tier(c, "s") == "remote", 0)
        # Step: Redis evicts one chunk of it (maxmemory, or its TTL ran out first).
        chunks = [k for k in fresh_redis.cli("--scan", "--pattern", f"{ns}:o:v:*").split() if ":s:" in k]
        assert len(chunks) == 16
        fresh_redis.cli("del", chunks[5])
        with pytest.raises(NotFound):
            c.restore("s")
        assert c.stat().remote.data_loss == 0
        with pytest.raises(NotFound):
            c.info("s")
        check(d)


def test_a_remote_sequence_found_gone_takes_its_unshared_blocks_off_the_disk(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer) -> None:
    ns = _new_ns()
    d = daemon(**SMALL, **_remote(fresh_redis.url, ns))
    with Client(d.address, transport="inline") as c:
        # Step: "s" uses shared block "B"; the disk evicts "s" to Redis and keeps "B"
        # (a referenced block is never a victim).
        c.park("s", [blob(1, 100_000)], refs=["B"], new_blocks={"B": [blob(2, 3 * MiB)]})
        assert wait_until(lambda: _synced(c), timeout=30)
        _park_until(c, lambda: _tier(c, "s") == "remote", 0)
        assert c.info("B").tier == "disk"
        assert d.engine is not None
        with d.engine.catalog.lock:
            block = d.engine.catalog.find("B")
        assert block is not None
        # Step: Redis loses "s"; the restore finds it gone.
        fresh_redis.cli("del", f"{ns}:o:m:s")
        with pytest.raises(NotFound):
            c.restore("s")
        # Step: "B" left the index with it, and its disk copy went too (its remote copy
        # stays: other daemons' sequences may use it).
        with d.engine.catalog.lock:
            assert d.engine.catalog.find("B") is None
        assert not d.engine.disk.holds(block.manifest), "an orphaned block kept its disk copy"
        check(d)  # the disk store holds exactly what the index has on disk


def test_a_hung_redis_leaves_the_daemon_serving_its_local_tiers(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer, stopped: list[int]) -> None:
    ns = _new_ns()
    d = daemon(**_remote(fresh_redis.url, ns, timeout_s=0.5, breaker_failures=2))
    with Client(d.address, transport="inline", timeout=20) as c:
        c.park("a", [blob(1)])
        assert wait_until(lambda: _synced(c), timeout=30)
        assert fresh_redis.proc is not None
        os.kill(fresh_redis.proc.pid, signal.SIGSTOP)
        stopped.append(fresh_redis.proc.pid)
        # Step: Redis hangs. Parks, restores and misses go on, each within its deadline.
        for i in range(6):
            c.park(f"k{i}", [blob(10 + i)])
            assert torch.equal(c.restore(f"k{i}")[0], blob(10 + i))
        assert torch.equal(c.restore("a")[0], blob(1))
        with pytest.raises(NotFound):
            c.info("never-parked")
        assert c.present(["never-parked", "k1"]) == [False, True]
        # The copies queued for Redis time out and the breaker opens: nothing piles up.
        assert wait_until(lambda: c.stat().remote.state != "closed" and _synced(c), timeout=60)
        assert c.stat().remote.errors >= 2
        # Step: Redis answers again: the tier resumes and a new park reaches it.
        os.kill(fresh_redis.proc.pid, signal.SIGCONT)

        def resumed() -> bool:
            c.park("z", [blob(7)], overwrite=True)
            return wait_until(lambda: _synced(c), timeout=10) and c.stat().remote.state == "closed" \
                and fresh_redis.cli("exists", f"{ns}:o:m:z").strip() == "1"

        assert wait_until(resumed, timeout=60, interval=0.3)
        check(d)


def test_write_through_copies_queued_for_a_slow_redis_are_bounded_and_no_park_is_lost(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer) -> None:
    ns = _new_ns()
    n = 1200
    # Slow but healthy: Redis holds every write (CLIENT PAUSE) for less than timeout_s,
    # so nothing fails and the breaker stays closed.
    d = daemon(**{"tiers.host.slot_size": "64KiB", "tiers.host.capacity": "96MiB"},
               **_remote(fresh_redis.url, ns, timeout_s=60.0))
    assert d.engine is not None and d.engine.remote is not None
    bound = d.engine.remote.max_pending  # the default of tiers.remote.max_pending
    assert bound < n
    try:
        with Client(d.address) as c:
            fresh_redis.cli("client", "pause", "60000", "WRITE")
            c.park_batch({f"b{i}": [blob(i, 1024)] for i in range(n)})
            # Step: what waits for Redis is bounded; the rest is skipped and counted.
            st = c.stat().remote
            assert st.state == "closed"
            assert st.pending_writes <= bound + 1, f"{st.pending_writes} copies queued behind a slow Redis"
            assert d.engine.remote.skipped >= n - bound - 1
            # A drop is never skipped: it reaches Redis once Redis answers.
            assert c.drop("b0")
            fresh_redis.cli("client", "unpause")
            assert wait_until(lambda: _synced(c), timeout=120)
            assert c.stat().remote.state == "closed"
            assert fresh_redis.cli("exists", f"{ns}:o:m:b0").strip() == "0"
            # Step: no park is lost: every one restores from its local copy.
            for i in range(1, n, 97):
                assert torch.equal(c.restore(f"b{i}")[0], blob(i, 1024))
            check(d)
    finally:
        fresh_redis.cli("client", "unpause")
