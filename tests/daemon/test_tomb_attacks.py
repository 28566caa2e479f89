"""Attacks on the remote tombstones (ac7f8b5): paths where a version Redis holds leaves
the index, or reaches Redis, outside the tombstone protocol, so a restore that begins
after an acknowledged drop returns the dropped bytes (docs/protocol.md, "The remote tier").
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

import pytest

from kvpark.client import Client, NotFound
from kvpark.daemon import disk_evict
from kvpark.daemon.server import Daemon

from ..conftest import wait_until
from ..redis_servers import RedisServer
from .test_remote_tier import _keys, _new_ns, _own_dirs, _remote, _synced, blob
from .test_remote_tombstones import _hold_remote_queue


def _gone(c: Client, seq_id: str) -> None:
    with pytest.raises(NotFound):
        got = c.restore(seq_id)
        pytest.fail(f"restored a dropped version of {seq_id!r} ({got[0][:4].tolist()}...)")
    assert c.present([seq_id]) == [False]


def _up(store) -> bool:
    try:
        return store.ping()
    except Exception:  # noqa: BLE001 - down or breaker open: not yet
        return False


def test_a_drop_after_a_restart_deletes_the_redis_copy_an_on_disk_version_has(
        daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    """on_evict: a version both on disk and in Redis loses ``on_remote`` at a restart
    (``Catalog.load``), so its drop neither tombstones nor deletes the Redis copy, and the
    next miss adopts the dropped version back."""
    ns = _new_ns()
    opts = _remote(redis_server.url, ns, write="on_evict")
    d = daemon(**opts)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("s", [blob(1)])
    eng.flush()  # on disk (and host)
    assert disk_evict.disk_to_remote(eng.mover, "s")  # copied to Redis; the disk copy goes, host stays
    d.stop(0.5)  # graceful: flush_on_shutdown writes it to disk again
    assert _keys(redis_server, ns) > 0
    d2 = daemon(**opts)
    with Client(d2.address, transport="inline") as c:
        assert c.info("s").tier in ("disk", "host")
        assert c.drop("s")
        assert wait_until(lambda: _synced(c), timeout=30)
        _gone(c, "s")


def test_an_eviction_copy_whose_reply_was_lost_is_deleted_by_the_drop(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer, stopped: list[int]) -> None:
    """on_evict: disk_to_remote's put times out on the manifest SET, yet Redis applies it
    (it was only stopped). ``on_remote`` stays False, no tombstone is kept for the unknown
    outcome, so the drop deletes nothing and a miss adopts the dropped version."""
    ns = _new_ns()
    d = daemon(**_remote(fresh_redis.url, ns, write="on_evict"))
    eng = d.engine
    assert eng is not None and eng.remote is not None
    pid = fresh_redis.proc.pid
    with Client(d.address, transport="inline") as c:
        c.park("s", [blob(1)])
        eng.flush()
        store = eng.remote.store
        real_call = store._call

        def call(what, fn):  # Redis stops right before the manifest SET reaches it
            if what == "put 's' manifest":
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                threading.Timer(2.0, os.kill, (pid, signal.SIGCONT)).start()
            return real_call(what, fn)

        store._call = call
        try:
            assert disk_evict.disk_to_remote(eng.mover, "s") is False  # DeadlineExceeded: kept on disk
        finally:
            store._call = real_call
        assert wait_until(lambda: _up(store), timeout=10)
        assert store.get_manifest("s") is not None  # the SET landed after all
        assert c.drop("s")
        assert wait_until(lambda: _synced(c), timeout=30)
        _gone(c, "s")


def test_a_lookup_that_read_the_manifest_before_the_delete_does_not_adopt_after_the_tombstone_goes(
        daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    """A miss reads the dropped version's manifest while Redis still holds it; the delete
    then lands and the tombstone goes before the miss checks ``tombed`` under the index
    lock. The dropped version is adopted back: info answers it, present says True, and a
    plain park of the id is refused (AlreadyExists) though the drop was acknowledged."""
    ns = _new_ns()
    d = daemon(**_remote(redis_server.url, ns, write="write_through"))
    eng = d.engine
    assert eng is not None and eng.remote is not None
    with Client(d.address, transport="inline") as c:
        c.park("s", [blob(1)])
        assert wait_until(lambda: _synced(c), timeout=30)
        go = _hold_remote_queue(d)
        c.drop("s")  # acknowledged; its delete waits behind the held queue
        store = eng.remote.store
        real = store.get_manifests
        looked = threading.Event()

        def get_manifests(ids):  # the real lookup; its answer arrives late
            out = real(ids)
            if "s" in ids and not looked.is_set():
                looked.set()
                wait_until(lambda: eng.remote.tombs == 0, timeout=10)
            return out

        store.get_manifests = get_manifests
        seen: list[object] = []
        t = threading.Thread(target=lambda: seen.append(_info_or_none(d, "s")))
        try:
            t.start()
            assert looked.wait(10)
            go.set()
            t.join(20)
        finally:
            go.set()
            store.get_manifests = real
        assert wait_until(lambda: _keys(redis_server, ns) == 0, timeout=10)
        assert seen == [None], f"info answered a dropped version: {seen}"
        assert c.present(["s"]) == [False]
        c.park("s", [blob(3)])  # a plain park of a dropped id


def _info_or_none(d: Daemon, seq_id: str) -> object:
    with Client(d.address, transport="inline") as c:
        try:
            return c.info(seq_id)
        except NotFound:
            return None


def test_another_daemon_stops_serving_a_version_dropped_here_once_its_delete_lands(
        daemon: Callable[..., Daemon], redis_server: RedisServer, tmp_path) -> None:
    """Two daemons share a namespace. A drops "s" (acknowledged) while its Redis delete
    waits behind A's background queue. The tombstone is A's (memory and disk): B may still
    adopt the version until the delete lands, by design (docs/protocol.md, "The remote
    tier": a slow Redis delays nothing local, so a drop does not wait for it). Pinned
    here: A never serves it, and once A's delete has landed B never does either, and B
    holds no stale index entry for it (it re-checks Redis on each miss)."""
    ns = _new_ns()
    a = daemon(**_own_dirs(tmp_path, "a"), **_remote(redis_server.url, ns, write="write_through"))
    b = daemon(**_own_dirs(tmp_path, "b"), **_remote(redis_server.url, ns, write="write_through"))
    with Client(a.address, transport="inline") as ca, Client(b.address, transport="inline") as cb:
        ca.park("s", [blob(1)])
        assert wait_until(lambda: _synced(ca), timeout=30)
        go = _hold_remote_queue(a)
        try:
            assert ca.drop("s")
            _gone(ca, "s")
        finally:
            go.set()
        assert wait_until(lambda: _synced(ca) and a.engine.remote.tombs == 0, timeout=30)
        assert _keys(redis_server, ns) == 0
        _gone(ca, "s")
        _gone(cb, "s")


def test_a_copy_that_lands_after_the_drops_delete_is_not_adopted_when_that_delete_ends_after_the_copy(
        daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    """disk_to_remote copies "s"; the drop lands during the copy, and its delete D1 runs
    in Redis before the copy lands, but D1's end (the ``_putting`` check) comes after the
    copy's ``put_end``: D1 removes the tombstone while the copy sits in Redis, and the
    copier's own ``forget`` has not yet put it back. A miss in that window adopts the
    dropped version and restores it."""
    ns = _new_ns()
    d = daemon(**_remote(redis_server.url, ns, write="on_evict"))
    eng = d.engine
    assert eng is not None and eng.remote is not None
    remote, store = eng.remote, eng.remote.store
    with Client(d.address, transport="inline") as c:
        c.park("s", [blob(1)])
        eng.flush()
        real_put, real_delete, real_forget = store.put, store.delete, remote.forget
        deleted, put_done = threading.Event(), threading.Event()
        copier = threading.get_ident()
        seen: list[object] = []
        drops: list[threading.Thread] = []

        def put(m, views):  # the drop, and its delete in Redis, come first
            if m.seq_id == "s":
                drops.append(threading.Thread(target=c.drop, args=("s",)))
                drops[0].start()
                assert deleted.wait(10)
            real_put(m, views)

        def delete(m):  # D1: its Redis delete now, its end after the copy's put_end
            real_delete(m)
            if m.seq_id == "s" and not deleted.is_set():
                deleted.set()
                put_done.wait(10)

        def forget(ms):  # the copier's forget, a moment late
            if threading.get_ident() == copier:
                put_done.set()
                drops[0].join(10)  # the drop is acknowledged
                wait_until(lambda: remote.tombs == 0, timeout=5)
                with Client(d.address, transport="inline") as c2:
                    try:
                        seen.append(c2.restore("s")[0][:4].tolist())
                    except NotFound:
                        seen.append(None)
            real_forget(ms)

        store.put, store.delete, remote.forget = put, delete, forget
        try:
            assert disk_evict.disk_to_remote(eng.mover, "s") is False
        finally:
            store.put, store.delete, remote.forget = real_put, real_delete, real_forget
            put_done.set()
        assert seen == [None], f"a restore after the drop's ack returned {seen}"
        assert wait_until(lambda: _synced(c) and remote.tombs == 0, timeout=30)
        _gone(c, "s")


def test_an_unreadable_tombstone_does_not_stop_the_daemon_from_starting(
        daemon: Callable[..., Daemon], redis_server: RedisServer, tmp_path) -> None:
    """An unreadable manifest on disk is skipped and logged (``load_manifests``); an
    unreadable tombstone (``Tombs.load`` decodes every value unguarded) refuses the start."""
    import lmdb

    ns = _new_ns()
    opts = _remote(redis_server.url, ns, write="write_through")
    d = daemon(**opts)
    d.stop(0.5)
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=5, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"s\x00" + (1).to_bytes(8, "big"), b"\x00not a manifest", db=env.open_db(b"tombs", txn=txn))
    finally:
        env.close()
    d2 = daemon(**opts)  # raises here today
    with Client(d2.address, transport="inline") as c:
        c.park("s", [blob(1)])
        assert c.restore("s")[0].equal(blob(1))
