"""A fetch from Redis onto disk that takes a queued (failed) eviction delete over,
attacked: the remote copy gone meanwhile (the sequence is retired: its leftover manifest
goes before the restore answers), and a pin acknowledged meanwhile (it waits for the
fetch's disk write to land, as for any disk write of the sequence). Crash-after-
acknowledgment checks: ``crash_image`` copies LMDB as a SIGKILL right then would leave
it, and a fresh daemon is started on that copy. Found by a fresh-eyes attack."""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import pytest

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import NotFound
from kvpark.tiers.disk import DiskStore, Write

from .disk_seams import crash_image, waiting_in
from .test_evict_retry_race import Seam, full, seam  # noqa: F401 (fixture)

MiB = 1 << 20


def _over(redis_url: str) -> dict:
    from .test_remote_tier import _new_ns, _remote

    return {"policy.promote_on_restore": "false", "policy.flush_on_shutdown": "false",
            **_remote(redis_url, _new_ns(), write="on_evict")}


def test_a_remote_copy_gone_during_a_taken_over_fetch_leaves_nothing_a_crash_brings_back(
        daemon: Callable[..., Daemon], seam: type[Seam], redis_server, tmp_path) -> None:  # noqa: F811
    """x's disk copy was evicted to Redis and its disk delete failed (queued: its manifest
    is still in LMDB). A fetch of x from Redis now takes that queued delete over
    (``take_own``) instead of answering UNAVAILABLE. Redis lost x meanwhile: the fetch's
    ``remote_guard`` retires x (NOT_FOUND: x is gone) but never deletes the old manifest
    the taken-over delete left; the taken-over entry is just queued again. A crash before
    the maintenance retry brings the "gone" x back from that manifest."""
    from kvpark.daemon.disk_evict import disk_to_remote

    d = daemon(disk_factory=seam, **_over(redis_server.url))
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
        c.flush()
        assert eng.mover.demote("x", "host")  # its only copy on disk
        seam.fail = True  # deletes of x's records fail from now on (writes work)
        disk_to_remote(eng.mover, "x")  # copied to Redis; the disk delete failed: queued
        assert eng.deletes.pending >= 1 and c.info("x").tier == "remote"
        seq = eng.catalog.find("x")
        assert seq is not None
        assert eng.remote is not None
        eng.remote.store.delete(seq.manifest)  # Redis lost it (evicted, expired, another daemon)
        err: BaseException | None = None
        try:
            c.restore("x", timeout=20)  # the fetch takes x's queued delete over, then NotFound: x retired
        except BaseException as e:  # noqa: BLE001
            err = e
        present_now = c.present(["x"])
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    seam.fail = False
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c2:
        after = c2.present(["x"])
    assert isinstance(err, NotFound) and present_now == [False]
    assert after == [False], (
        f"fetch of x answered {err!r} and present(x)={present_now} (x is gone); after a crash "
        f"present(x)={after}: the old manifest the taken-over eviction delete left brought x back")


class HeldFetch(DiskStore):
    """The next write of "x" waits at ``gate`` just after its transaction committed."""

    hold = False
    entered = threading.Event()
    gate = threading.Event()

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = HeldFetch
        mine = cls.hold and any(w.manifest.seq_id == "x" for w in writes)
        if mine:
            cls.hold = False
        done = super().write_many(writes, sync=sync)
        if mine:
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
        return done


@pytest.fixture
def held():
    HeldFetch.entered.clear()
    HeldFetch.gate.clear()
    HeldFetch.hold = False
    yield HeldFetch
    HeldFetch.hold = False
    HeldFetch.gate.set()


def test_a_pin_acknowledged_during_a_fetch_from_redis_survives_a_crash(
        daemon: Callable[..., Daemon], held: type[HeldFetch], redis_server, tmp_path) -> None:
    """``Engine.pin`` waits for a disk write reading the sequence (``seq.moving``) before
    it decides whether to update the disk manifest; a fetch from Redis onto disk
    (``fetch_remote_locked``) never counts as such a write (no ``copy_begin``). A pin
    acknowledged after the fetch's transaction encoded the manifest but before the fetch
    marked x on disk updates nothing on disk: a crash then finds x unpinned."""
    from kvpark.daemon.disk_evict import disk_to_remote

    d = daemon(disk_factory=held, **_over(redis_server.url))
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
        c.flush()
        assert eng.mover.demote("x", "host")
        assert disk_to_remote(eng.mover, "x")
        assert c.info("x").tier == "remote"
        seq = eng.catalog.find("x")
        assert seq is not None
        held.hold = True
        errs: list[BaseException] = []

        def fetch() -> None:
            try:
                eng.mover.fetch_remote(seq)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        t = threading.Thread(target=fetch)
        t.start()
        assert held.entered.wait(30)  # its manifest (unpinned) is committed; x not yet on disk
        pins: list = []
        p = threading.Thread(target=lambda: pins.append(c.pin("x", True, timeout=60)))
        p.start()
        # The pin answers at once (it does not see the fetch), or it waits for the fetch to
        # land (it does): then let the fetch go on.
        deadline = time.monotonic() + 30
        while p.is_alive() and not waiting_in("pin", "engine.py") and time.monotonic() < deadline:
            time.sleep(0.01)
        held.gate.set()
        t.join(30)
        p.join(60)
        info = pins[0]
        assert not errs, errs
        assert c.info("x").pinned and c.info("x").tier == "disk"
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c2:
        after = c2.info("x")
    assert info.pinned and after.pinned, (
        f"pin(x) answered pinned={info.pinned} during a fetch from Redis; after a crash "
        f"x pinned={after.pinned}: the acknowledged pin was lost")


def test_a_pin_whose_wait_for_a_disk_write_runs_out_is_not_acknowledged(
        daemon: Callable[..., Daemon], held: type[HeldFetch], redis_server, tmp_path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch of x from Redis committed its manifest (unpinned) and has not yet marked
    x on disk when a pin of x arrives; the disk stalls there longer than the pin waits
    (``PIN_WAIT_S``, shortened here). The pin answers UNAVAILABLE and applies nothing:
    acknowledged there, it would be in memory only and lost at a crash."""
    from kvpark.client import Unavailable
    from kvpark.daemon import engine as engine_mod
    from kvpark.daemon.disk_evict import disk_to_remote

    monkeypatch.setattr(engine_mod, "PIN_WAIT_S", 0.3)
    d = daemon(disk_factory=held, **_over(redis_server.url))
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
        c.flush()
        assert eng.mover.demote("x", "host")
        assert disk_to_remote(eng.mover, "x")
        seq = eng.catalog.find("x")
        assert seq is not None
        held.hold = True
        errs: list[BaseException] = []

        def fetch() -> None:
            try:
                eng.mover.fetch_remote(seq)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        t = threading.Thread(target=fetch)
        t.start()
        assert held.entered.wait(30)  # committed, unpinned; x not marked on disk yet
        try:
            answered = c.pin("x", True, timeout=30).pinned  # once its bounded wait ran out
        except Unavailable:
            answered = False
        live = c.info("x").pinned
        held.gate.set()
        t.join(30)
        assert not errs, errs
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c2:
        after = c2.info("x")
    assert not answered and not live and not after.pinned, (
        f"pin(x) answered pinned={answered} after its wait for the fetch ran out (live {live}); "
        f"after a crash x pinned={after.pinned}")
