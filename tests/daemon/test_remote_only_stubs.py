"""Versions only Redis holds, across a restart (``tiers/stubs.py``).

A disk eviction to the remote tier leaves a version that only Redis holds. Before stubs,
a restart forgot it (nothing of it was on disk): a create of the id succeeded over it, an
overwrite left it in Redis untombstoned, and a drop of the new version let it be adopted
back (``test_atk17_redis_older_version.py``). Now a stub written before the local records
go indexes it again at start, and every way the version leaves the index removes it, so
that a restart neither forgets a version nor brings back one that is gone.
"""

from __future__ import annotations

import threading
from typing import Callable

import pytest

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import AlreadyExists, NotFound
from kvpark.tiers.stubs import Stubs
from kvpark.tiers.tombs import Tombs

from ..conftest import wait_until
from .disk_seams import crash_image
from .test_remote_tier import _new_ns, _remote, blob


def _over(url: str, **kw: str) -> dict:
    return {"tiers.disk.capacity": "24MiB", "policy.flush_on_shutdown": "false",
            **_remote(url, _new_ns(), write="on_evict"), **kw}


def _evict_x_to_redis(c: Client) -> None:
    """x (blob 1) is the coldest of 49 parks of 1 MiB on a 24 MiB disk: host -> disk -> Redis."""
    c.park("x", [blob(1)])
    for i in range(48):
        c.park(f"f{i:02d}", [blob(100 + i)])
    assert wait_until(lambda: c.info("x").tier == "remote", timeout=30), "x never left the disk for Redis"


def _stubs(d: Daemon) -> dict[str, int]:
    # The daemon's own handle: a new ``Stubs(env)`` would open the sub-database, and
    # LMDB's open_db without a transaction waits for the writer lock holding the GIL (a
    # daemon thread in a write transaction then never finishes it: the process hangs).
    assert d.engine is not None and d.engine.remote is not None
    stubs = d.engine.remote._stubs  # noqa: SLF001
    assert stubs is not None
    return {m.seq_id: m.gen for m in stubs.load()}


def _gen(d: Daemon, sid: str) -> int:
    assert d.engine is not None
    with d.engine.catalog.lock:
        return d.engine.catalog.get(sid).gen


def _restore_or_not_found(c: Client, sid: str) -> object:
    try:
        return c.restore(sid)[0]
    except NotFound:
        return "NOT_FOUND"


def _x_in_redis_then_restart(daemon: Callable[..., Daemon], over: dict) -> tuple[Daemon, int]:
    """x evicted to Redis (its stub written), then a restart on the same disk: the new
    daemon and x's generation."""
    d = daemon(**over)
    with Client(d.address, transport="inline") as c:
        _evict_x_to_redis(c)
        gen = _gen(d, "x")
    assert _stubs(d).get("x") == gen
    d.stop(0.5)
    return daemon(**over), gen


def test_a_version_only_redis_holds_is_indexed_again_after_a_restart(
        daemon: Callable[..., Daemon], redis_server) -> None:
    d2, gen = _x_in_redis_then_restart(daemon, _over(redis_server.url))
    assert d2.engine is not None
    with d2.engine.catalog.lock:  # indexed at start, not adopted by the lookups below
        seq = d2.engine.catalog.find("x")
        assert seq is not None and seq.on_remote and not seq.on_disk and seq.gen == gen
    with Client(d2.address, transport="inline") as c:
        with pytest.raises(AlreadyExists):
            c.park("x", [blob(2)])  # a create of an id that is parked: refused, as before the restart
        assert c.restore("x")[0].equal(blob(1))


def test_an_overwrite_after_a_restart_deletes_the_old_version_from_redis_and_its_stub(
        daemon: Callable[..., Daemon], redis_server) -> None:
    over = _over(redis_server.url)
    d2, old = _x_in_redis_then_restart(daemon, over)
    eng = d2.engine
    assert eng is not None and eng.remote is not None
    with Client(d2.address, transport="inline") as c:
        c.park("x", [blob(2)], overwrite=True)
        assert "x" not in _stubs(d2)
        assert wait_until(lambda: not any(m is not None and m.gen == old for m in eng.remote.store.get_manifests(["x"])),
                          timeout=30), "x's old version is still in Redis after the overwrite"
        assert c.drop("x") is True
        assert c.present(["x"]) == [False]
        assert _restore_or_not_found(c, "x") == "NOT_FOUND"
    d2.stop(0.5)
    d3 = daemon(**over)
    with Client(d3.address) as c:
        assert c.present(["x"]) == [False]


def test_a_stub_whose_removal_failed_never_brings_a_dropped_version_back(
        daemon: Callable[..., Daemon], redis_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop's tombstone is on disk, its Redis delete has not landed, and removing the
    stub failed: the restart finds stub and tombstone, indexes nothing, removes the stub."""
    from kvpark.proto.errors import Unavailable

    over = _over(redis_server.url)
    d = daemon(**over)
    eng = d.engine
    assert eng is not None and eng.remote is not None
    with Client(d.address, transport="inline") as c:
        _evict_x_to_redis(c)

        def never(self, m) -> None:
            raise Unavailable("test: this Redis delete never lands")

        def failing_remove(self, m) -> None:
            import lmdb
            raise lmdb.Error("injected: EIO")

        monkeypatch.setattr(type(eng.remote.store), "delete", never)
        monkeypatch.setattr(Stubs, "remove", failing_remove)
        assert c.drop("x") is True
    assert "x" in _stubs(d)
    d.stop(0.5)
    monkeypatch.undo()
    d2 = daemon(**over)
    assert "x" not in _stubs(d2)
    with Client(d2.address) as c:
        assert c.present(["x"]) == [False]
        assert _restore_or_not_found(c, "x") == "NOT_FOUND"


def test_a_stub_older_than_the_disks_version_is_deleted_from_redis_at_start(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash after an overwrite published v2 over the remote-only v1 and before v1's
    tombstone reached the disk (here: that write failed): the restart finds v2 on disk and
    v1's stub. v1 is tombstoned and deleted from Redis then, as the overwrite would have:
    a later drop of v2 leaves nothing to adopt back."""
    import lmdb

    over = _over(redis_server.url, **{"policy.write": "write_through"})  # v2 is on disk when acknowledged
    d2, v1 = _x_in_redis_then_restart(daemon, over)
    eng = d2.engine
    assert eng is not None
    original = Tombs.add

    def failing_add(self: Tombs, manifests) -> None:
        if any(m.seq_id == "x" for m in manifests):
            raise lmdb.Error("injected: EIO")
        original(self, manifests)

    with Client(d2.address, transport="inline") as c:
        monkeypatch.setattr(Tombs, "add", failing_add)
        c.park("x", [blob(2)], overwrite=True)
        image = crash_image(eng.disk, str(tmp_path / "crash"))  # the SIGKILL: v1 in Redis, no tombstone
        monkeypatch.setattr(Tombs, "add", original)
    d2.stop(0.5)
    d3 = daemon(**{**over, "tiers.disk.path": image})
    e3 = d3.engine
    assert e3 is not None and e3.remote is not None
    assert "x" not in _stubs(d3)
    assert wait_until(lambda: not any(m is not None and m.gen == v1 for m in e3.remote.store.get_manifests(["x"])),
                      timeout=30), "x's replaced version is still in Redis after the restart"
    with Client(d3.address, transport="inline") as c:
        assert c.restore("x")[0].equal(blob(2))
        assert c.drop("x") is True
        assert c.present(["x"]) == [False]
        assert _restore_or_not_found(c, "x") == "NOT_FOUND"


def test_a_crash_between_the_stub_and_the_local_delete_keeps_the_disk_copy_and_a_drop_removes_both(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    over = _over(redis_server.url)
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    images: list[str] = []
    original = Stubs.put

    def put_then_crash(self: Stubs, m) -> None:
        original(self, m)
        if m.seq_id == "x" and not images:
            images.append(crash_image(eng.disk, str(tmp_path / "crash")))

    monkeypatch.setattr(Stubs, "put", put_then_crash)
    with Client(d.address, transport="inline") as c:
        _evict_x_to_redis(c)
    d.stop(0.5)
    monkeypatch.undo()
    assert images, "x's stub was never written"
    over2 = {**over, "tiers.disk.path": images[0]}
    d2 = daemon(**over2)
    assert d2.engine is not None
    with d2.engine.catalog.lock:
        seq = d2.engine.catalog.find("x")
        assert seq is not None and seq.on_disk  # the disk copy, not the stub
    with Client(d2.address, transport="inline") as c:
        assert c.restore("x")[0].equal(blob(1))
        assert c.drop("x") is True
    assert "x" not in _stubs(d2)
    d2.stop(0.5)
    d3 = daemon(**over2)
    with Client(d3.address) as c:
        assert c.present(["x"]) == [False]


def test_a_version_found_gone_from_redis_loses_its_stub(daemon: Callable[..., Daemon], redis_server) -> None:
    """Redis lost x (expiry, eviction, another daemon's delete): the restore that finds it
    gone answers NOT_FOUND and removes x's stub, so a restart does not index x again."""
    over = _over(redis_server.url)
    d = daemon(**over)
    eng = d.engine
    assert eng is not None and eng.remote is not None
    with Client(d.address, transport="inline") as c:
        _evict_x_to_redis(c)
        with eng.catalog.lock:
            m = eng.catalog.find("x").manifest
        eng.remote.store.delete(m)  # Redis loses it behind the daemon's back
        assert _restore_or_not_found(c, "x") == "NOT_FOUND"
    assert "x" not in _stubs(d)
    d.stop(0.5)
    d2 = daemon(**over)
    with Client(d2.address) as c:
        assert c.present(["x"]) == [False]


def test_a_drop_racing_the_stubs_write_never_leaves_the_stub_behind(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop unindexes x while its eviction writes x's stub: the drop's removal of the
    stub waits for that write (``RemoteTier._stub_lock``), so the acknowledged drop leaves
    no stub to index x again at a restart."""
    import sys

    def drop_waits_for_the_stub() -> bool:
        return any(f.f_code.co_name == "_unstub" for f in sys._current_frames().values())

    over = _over(redis_server.url)
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    entered, gate = threading.Event(), threading.Event()
    original = Stubs.put

    def held_put(self: Stubs, m) -> None:
        if m.seq_id == "x" and not gate.is_set():
            entered.set()
            assert gate.wait(60), "the test never opened the stub gate"
        original(self, m)

    monkeypatch.setattr(Stubs, "put", held_put)
    out: dict = {}
    with Client(d.address, transport="inline") as c, Client(d.address) as c2:
        c.park("x", [blob(1)])
        t = threading.Thread(target=lambda: [c.park(f"f{i:02d}", [blob(100 + i)]) for i in range(48)])
        t.start()
        try:
            assert entered.wait(60), "x's eviction never reached its stub"
            dropper = threading.Thread(target=lambda: out.setdefault("drop", c2.drop("x", timeout=60)))
            dropper.start()
            wait_until(lambda: not dropper.is_alive() or drop_waits_for_the_stub(), timeout=30, interval=0.01)
        finally:
            gate.set()
        dropper.join(60)
        t.join(120)
        assert out.get("drop") is True
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    assert "x" not in _stubs(d)
    d.stop(0.5)
    monkeypatch.undo()
    d2 = daemon(**{**over, "tiers.disk.path": image})
    with Client(d2.address) as c:
        assert c.present(["x"]) == [False]
