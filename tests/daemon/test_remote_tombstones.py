"""An acknowledged drop stays dropped while Redis still holds the copy (docs/protocol.md,
"The remote tier": a dropped version is never adopted back).

A drop is acknowledged before its remote delete runs (in the background, behind other
remote work, or not at all while Redis is down). The history checker found a restore that
began after a drop's acknowledgement return the dropped bytes: the local miss adopted the
version back from Redis. Every path is pinned here with the delete held back on purpose:
- the drop's delete still queued (a plain drop, and an overwrite followed by a drop: the
  first version's delete is queued too);
- the daemon killed before the delete ran, restarted with Redis back: the tombstone on
  disk still refuses the version, and the restarted daemon finishes the delete;
- a disk-to-remote eviction copying the version while it is dropped.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

import pytest

from kvpark.client import Client, NotFound
from kvpark.daemon.server import Daemon

from ..conftest import Proc, wait_until
from ..redis_servers import RedisServer
from .test_remote_tier import _keys, _new_ns, _remote, _synced, blob


def _hold_remote_queue(d: Daemon) -> threading.Event:
    """Occupy the remote tier's one background thread until the event is set: every
    delete submitted meanwhile waits behind it."""
    assert d.engine is not None and d.engine.remote is not None
    go, running = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        go.wait(60)

    d.engine.remote.submit("held by the test", hold)
    assert running.wait(10)
    return go


def _gone(c: Client, seq_id: str) -> None:
    with pytest.raises(NotFound):
        c.restore(seq_id)
    assert c.present([seq_id]) == [False]


@pytest.mark.parametrize("overwrite", [False, True], ids=["drop", "overwrite-then-drop"])
def test_a_drop_whose_remote_delete_is_still_queued_is_not_adopted_back(
        daemon: Callable[..., Daemon], redis_server: RedisServer, overwrite: bool) -> None:
    ns = _new_ns()
    d = daemon(**_remote(redis_server.url, ns, write="write_through"))
    with Client(d.address, transport="inline") as c:
        c.park("s", [blob(1)])
        assert wait_until(lambda: _synced(c), timeout=30)
        go = _hold_remote_queue(d)
        try:
            if overwrite:  # the first version's delete waits too; the second is never copied
                c.park("s", [blob(2)], overwrite=True)
            c.drop("s")
            # Before: the miss found the manifest still in Redis and restored the dropped bytes.
            _gone(c, "s")
            _gone(c, "s")  # and nothing was adopted by the first miss either
        finally:
            go.set()
        assert wait_until(lambda: _synced(c) and d.engine.remote.tombs == 0, timeout=30)
        _gone(c, "s")
        assert wait_until(lambda: _keys(redis_server, ns) == 0, timeout=10)
        d.engine.check_invariants()


def test_a_reparked_id_is_served_while_the_old_versions_delete_waits(
        daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    """The tombstone is one version's, not the id's: a new park of the id is restored."""
    ns = _new_ns()
    d = daemon(**_remote(redis_server.url, ns, write="write_through"))
    with Client(d.address, transport="inline") as c:
        c.park("s", [blob(1)])
        assert wait_until(lambda: _synced(c), timeout=30)
        go = _hold_remote_queue(d)
        try:
            c.drop("s")
            c.park("s", [blob(3)])
            assert c.restore("s")[0].equal(blob(3))
        finally:
            go.set()
        assert wait_until(lambda: _synced(c), timeout=30)
        assert c.restore("s")[0].equal(blob(3))
        c.drop("s")
        assert wait_until(lambda: _synced(c) and d.engine.remote.tombs == 0, timeout=30)
        _gone(c, "s")


def test_a_drop_acknowledged_before_a_kill_stays_dropped_after_the_restart(
        proc: Callable[..., Proc], fresh_redis: RedisServer, stopped: list[int], tmp_path) -> None:
    ns = _new_ns()
    args = [a for k, v in _remote(fresh_redis.url, ns, write="write_through").items()
            for a in ("--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}")]
    p = proc(*args)
    with Client(p.address, transport="inline") as c:
        c.park("s", [blob(1)])
        assert wait_until(lambda: _synced(c), timeout=30)
        os.kill(fresh_redis.proc.pid, signal.SIGSTOP)  # the drop's delete cannot land
        stopped.append(fresh_redis.proc.pid)
        c.drop("s")
    p.kill()
    os.kill(fresh_redis.proc.pid, signal.SIGCONT)
    assert _keys(fresh_redis, ns) > 0  # Redis still holds the dropped version
    p2 = proc(*args)
    with Client(p2.address, transport="inline") as c:
        # Before: the miss adopted the dropped version from Redis and restored it.
        _gone(c, "s")
        # The restarted daemon finishes the delete the killed one could not.
        assert wait_until(lambda: _keys(fresh_redis, ns) == 0, timeout=30)
        _gone(c, "s")
    assert p2.terminate() == 0


def test_a_version_dropped_while_eviction_copies_it_to_remote_is_not_adopted_back(
        daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    """disk_to_remote: the drop lands during the copy; the copy lands after the drop's
    own delete ran. The tombstone outlives both until the copy's end deletes it again."""
    from kvpark.daemon import disk_evict

    ns = _new_ns()
    d = daemon(**{"tiers.host.capacity": "4MiB", "tiers.disk.capacity": "64MiB"},
               **_remote(redis_server.url, ns, write="on_evict"))
    eng = d.engine
    assert eng is not None and eng.remote is not None
    with Client(d.address, transport="inline") as c:
        c.park("s", [blob(1)])
        for i in range(8):  # pushes "s" out of host memory: on disk only
            c.park(f"fill{i}", [blob(10 + i)])
        assert wait_until(lambda: c.info("s").tier == "disk", timeout=30)
        store = eng.remote.store
        real_put = store.put
        dropped = threading.Event()

        def put_overtaken(m, views):  # the drop, and its own delete, run first
            if m.seq_id == "s":
                threading.Thread(target=lambda: (c.drop("s"), dropped.set())).start()
                assert dropped.wait(10)
                assert wait_until(lambda: _synced(c), timeout=10)  # its delete found nothing yet
                assert eng.remote.tombs == 1  # kept: this copy is still under way
            real_put(m, views)

        store.put = put_overtaken  # the real put, late: a timing seam, not a stand-in
        try:
            assert disk_evict.disk_to_remote(eng.mover, "s") is False
        finally:
            store.put = real_put
        # Before: the copy landed after the drop's delete, and a miss adopted it.
        _gone(c, "s")
        assert wait_until(lambda: _synced(c) and eng.remote.tombs == 0, timeout=30)
        _gone(c, "s")
        assert _keys_of(redis_server, ns, "s") == []
        eng.check_invariants()


def _keys_of(srv: RedisServer, ns: str, seq_id: str) -> list[str]:
    keys = srv.cli("--scan", "--pattern", f"{ns}:*").split()
    return [k for k in keys if k == f"{ns}:o:m:{seq_id}" or f":{seq_id}:" in k]
