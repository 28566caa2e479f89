"""A drop or an overwrite of an id raced against each background writer of it.

The writers: the flush (``Flush`` and the stop), a demotion from host to disk, the
write_through copy to Redis, and disk eviction's copy to Redis (on_evict). Each race is pinned, not hoped for: the writer is held
inside its write (the disk seam's ``GatedWrites``; for Redis, a redis-server stopped
with SIGSTOP while the copy is on the wire) until the test has dropped or overwritten
the id. Then the daemon restarts from its disk, and what was dropped stays dropped, an
overwrite's old version never comes back, and the accounting is exact
(``Engine.check_invariants``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Iterator

import pytest
import torch

from kvpark.client import Client, NotFound
from kvpark.daemon.model import Seq
from kvpark.daemon.server import Daemon

from ..conftest import wait_until
from ..redis_servers import RedisServer
from .disk_seams import GatedWrites

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


@pytest.fixture
def gated() -> Iterator[type[GatedWrites]]:
    GatedWrites.entered.clear()
    GatedWrites.gate.clear()
    GatedWrites.hold = "race"
    yield GatedWrites
    GatedWrites.hold = ""
    GatedWrites.gate.set()  # never leave a writer stuck past the test


def check(d: Daemon) -> None:
    assert d.engine is not None
    d.engine.check_invariants()


def after_restart(daemon: Callable[..., Daemon], action: str, **cfg: object) -> None:
    """The restarted daemon's view of "race": gone after a drop, and after an overwrite
    never the old version (the new one was only in memory and the stop did not flush)."""
    d2 = daemon(**cfg)
    with Client(d2.address) as c:
        assert c.present(["race"]) == [False], f"the {DONE[action]} version of 'race' came back after a restart"
        with pytest.raises(NotFound):
            c.restore("race")
        assert torch.equal(c.restore("other")[0], full(MiB, 3))
        check(d2)


def act(c: Client, action: str) -> None:
    if action == "drop":
        assert c.drop("race")
    else:
        c.park("race", [full(MiB, 2)], overwrite=True)


NO_FLUSH = {"policy.flush_on_shutdown": False}
DONE = {"drop": "dropped", "overwrite": "overwritten"}


@pytest.mark.parametrize("action", ["drop", "overwrite"])
def test_a_flush_batch_keeps_no_record_of_an_id_dropped_or_overwritten_while_it_wrote(
        daemon: Callable[..., Daemon], gated: type[GatedWrites], action: str) -> None:
    d = daemon(disk_factory=gated, **NO_FLUSH)
    with Client(d.address) as c:
        c.park("race", [full(MiB, 1)])
        c.park("other", [full(MiB, 3)])
        flushed: list[int] = []
        t = threading.Thread(target=lambda: flushed.append(c.flush()))
        t.start()
        assert gated.entered.wait(30), "the flush never reached the disk"
        # Step: while the batch holding "race" is inside its write transaction.
        act(c, action)
        gated.gate.set()
        t.join(60)
        assert flushed == [1]  # "other" only: "race"'s write is undone
        if action == "overwrite":
            assert torch.equal(c.restore("race")[0], full(MiB, 2))
        check(d)
    d.stop()
    after_restart(daemon, action)


@pytest.mark.parametrize("action", ["drop", "overwrite"])
def test_a_demotion_to_disk_keeps_no_record_of_an_id_dropped_or_overwritten_while_it_wrote(
        daemon: Callable[..., Daemon], gated: type[GatedWrites], action: str) -> None:
    gated.hold = ""
    d = daemon(disk_factory=gated, **NO_FLUSH)
    with Client(d.address) as c:
        c.park("other", [full(MiB, 3)])
        assert c.flush() == 1  # "other" survives the stop
        gated.hold = "race"
        c.park("race", [full(MiB, 1)])  # the coldest memory-only one: the first the host demotes to disk
        i = 0
        while not gated.entered.is_set():
            c.park(f"fill{i}", [full(MiB, 10 + i % 200)])
            i += 1
            assert i < 64, "no demotion of 'race' reached the disk"
        # Step: while the demotion of "race" is inside its write transaction.
        old = _find(d, "race")
        act(c, action)
        gated.gate.set()
        # The demotion ends with the old record's move lock (``check_invariants`` waits
        # only for moves of indexed records, and this one has left the index).
        assert wait_until(lambda: not old.moving and not old.move_lock.locked(), timeout=30)
        if action == "overwrite":
            assert torch.equal(c.restore("race")[0], full(MiB, 2))
        check(d)
    d.stop()
    after_restart(daemon, action)


def _find(d: Daemon, seq_id: str) -> Seq:
    assert d.engine is not None
    with d.engine.catalog.lock:
        seq = d.engine.catalog.find(seq_id)
    assert seq is not None
    return seq


def _in_remote_put(seq_id: str = "") -> bool:
    """Some thread is inside ``RemoteStore.put`` (on the wire), of ``seq_id`` if named."""
    for frame in sys._current_frames().values():
        f = frame
        while f is not None:
            if f.f_code.co_name == "put" and f.f_code.co_filename.endswith(os.path.join("tiers", "remote.py")):
                m = f.f_locals.get("m")
                if not seq_id or getattr(m, "seq_id", None) == seq_id:
                    return True
            f = f.f_back
    return False


@pytest.mark.parametrize("action", ["drop", "overwrite"])
def test_a_write_through_copy_to_redis_leaves_nothing_of_an_id_dropped_or_overwritten_while_it_copied(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer, action: str) -> None:
    ns = f"bg{os.getpid()}{action}"
    remote = {"tiers.remote.url": fresh_redis.url, "tiers.remote.namespace": ns,
              "tiers.remote.write": "write_through", "tiers.remote.timeout_s": 60.0}
    d = daemon(**remote, **NO_FLUSH)
    assert d.engine is not None and d.engine.remote is not None
    tier = d.engine.remote
    hold = threading.Event()

    def held() -> None:  # the background queue's next job waits for the test
        hold.wait(60)

    pid = fresh_redis.proc.pid if fresh_redis.proc else 0
    try:
        with Client(d.address) as c:
            c.park("other", [full(MiB, 3)])
            assert c.flush() == 1
            # Step: the copy of "race" queues behind a job the test holds; Redis stops
            # answering; the copy starts and hangs on the wire.
            tier.submit("test hold", held)
            c.park("race", [full(MiB, 1)])
            os.kill(pid, signal.SIGSTOP)
            hold.set()
            assert wait_until(lambda: _in_remote_put(), timeout=30), "the copy never reached Redis"
            # Step: dropped or overwritten while its copy is on the wire.
            act(c, action)
            os.kill(pid, signal.SIGCONT)
            assert wait_until(lambda: c.stat().remote.pending_writes == 0, timeout=60)
            keys = fresh_redis.cli("--scan", "--pattern", f"{ns}:*").split()
            if action == "drop":
                left = [k for k in keys if k.endswith(":m:race") or ":race:" in k]
                assert not left, f"a dropped id left keys in Redis: {left}"
            else:
                gen = _find(d, "race").manifest.gen
                old = [k for k in keys if ":race:" in k and not k.split(":")[-2] == str(gen)]
                assert not old, f"the overwritten version left chunks in Redis: {old}"
                assert torch.equal(c.restore("race")[0], full(MiB, 2))
            check(d)
    finally:
        hold.set()
        os.kill(pid, signal.SIGCONT)
    d.stop()
    # Step: restarted: the id is gone locally and, after a drop, in Redis too; after an
    # overwrite Redis serves the new version only.
    d2 = daemon(**remote)
    with Client(d2.address) as c:
        if action == "drop":
            assert c.present(["race"]) == [False], "a dropped id came back from Redis"
        else:
            assert torch.equal(c.restore("race")[0], full(MiB, 2))
        assert torch.equal(c.restore("other")[0], full(MiB, 3))
        check(d2)


@pytest.mark.parametrize("action", ["drop", "overwrite"])
def test_an_eviction_to_redis_leaves_nothing_of_an_id_dropped_or_overwritten_while_it_copied(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer, action: str) -> None:
    ns = f"ev{os.getpid()}{action}"
    remote = {"tiers.remote.url": fresh_redis.url, "tiers.remote.namespace": ns,
              "tiers.remote.write": "on_evict", "tiers.remote.timeout_s": 60.0}
    d = daemon(**remote, **NO_FLUSH)
    assert d.engine is not None
    mover = d.engine.mover
    pid = fresh_redis.proc.pid if fresh_redis.proc else 0
    try:
        with Client(d.address) as c:
            c.park("race", [full(MiB, 1)])  # the coldest: the first the disk evicts
            c.park("other", [full(MiB, 3)])
            assert c.flush() == 2
            # Step: Redis stops answering; the disk evicts everything, "race" first, and
            # its copy to Redis hangs on the wire.
            os.kill(pid, signal.SIGSTOP)
            evicting = threading.Thread(target=lambda: mover.evict_disk(0, target=0))
            evicting.start()
            assert wait_until(lambda: _in_remote_put("race"), timeout=30), "the eviction never reached Redis"
            # Step: dropped or overwritten while its copy is on the wire.
            act(c, action)
            os.kill(pid, signal.SIGCONT)
            evicting.join(120)
            assert not evicting.is_alive()
            assert wait_until(lambda: c.stat().remote.pending_writes == 0, timeout=60)
            keys = fresh_redis.cli("--scan", "--pattern", f"{ns}:*").split()
            left = [k for k in keys if k.endswith(":m:race") or ":race:" in k]
            assert not left, f"the {DONE[action]} version of 'race' left keys in Redis: {left}"
            if action == "overwrite":
                assert torch.equal(c.restore("race")[0], full(MiB, 2))
            check(d)
    finally:
        os.kill(pid, signal.SIGCONT)
    d.stop()
    after_restart(daemon, action, **remote)  # asks Redis too: nothing there either
