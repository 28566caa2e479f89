"""The commit side of the park protocol: generations, creates, overwrites, dedup losers.

Each test pins one interleaving of two parks (or a park and a delete) through the disk
seam: a ``DiskStore`` subclass that holds one call on an ``Event`` until the other park
has got as far as it can, or fails one call once. Real in-process daemons, real LMDB,
real Redis.

On a fixed daemon the park that is held may wait for the other one, which itself waits
for the first to publish (creates of one id are serialised): the gates therefore wait
with a deadline (``GATE_S``), and the test then checks the outcome, not the timing.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch

from kvpark.client import AlreadyExists, Client
from kvpark.daemon.model import ParkSpec
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import Unavailable
from kvpark.proto.layout import TensorMeta
from kvpark.tiers.disk import DiskStore, Manifest, Write

from ..conftest import wait_until
from ..redis_servers import RedisServer

MiB = 1 << 20
GATE_S = 2.0  # how long a held park waits for the other one to reach its point
_ns = itertools.count()


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def check(d: Daemon) -> None:
    assert d.engine is not None
    d.engine.check_invariants()


class Gate:
    """Hold the first disk call that names ``seq_id`` until ``release`` is set (or the
    deadline passes); ``entered`` is set once it is held."""

    def __init__(self, seq_id: str) -> None:
        self.seq_id = seq_id
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.lock = threading.Lock()

    def first(self, ids: Sequence[str]) -> bool:
        if self.seq_id not in ids:
            return False
        with self.lock:
            self.calls += 1
            return self.calls == 1

    def hold(self) -> None:
        self.entered.set()
        self.release.wait(GATE_S)


def gated_store(gate: Gate, on: str) -> type[DiskStore]:
    """A ``DiskStore`` whose first ``on`` call (``write_many``, ``stage_blocks`` or
    ``stage_commit``) naming the gate's id waits at the gate first."""

    class Gated(DiskStore):
        def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
            if on == "write_many" and gate.first([w.manifest.seq_id for w in writes]):
                gate.hold()
            return super().write_many(writes, sync=sync)

        def stage_blocks(self, m: Manifest, first: int, blocks: Sequence[memoryview]) -> None:
            if on == "stage_blocks" and gate.first([m.seq_id]):
                gate.hold()
            super().stage_blocks(m, first, blocks)

        def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
            if on == "stage_commit" and gate.first([m.seq_id]):
                gate.hold()
            return super().stage_commit(m, replace, sync)

    return Gated


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # checked by the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


# ------------------------------------------------------------------ dedup losers (#3)


class Ordered(DiskStore):
    """Two writes of one new block, ordered by the test: the first one that names
    ``blk`` waits for the second one (``second_wrote``), or for the first park to
    have published before the second writes (``first_published``)."""

    order = "first_writes_first"
    first_in = threading.Event()
    second_in = threading.Event()
    second_wrote = threading.Event()
    first_published = threading.Event()

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.seen = 0
        self.seen_lock = threading.Lock()

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        if not any(w.manifest.seq_id == "blk" for w in writes):
            return super().write_many(writes, sync=sync)
        with self.seen_lock:
            self.seen += 1
            me = self.seen
        cls = type(self)
        if me == 1:
            cls.first_in.set()
        if cls.order == "first_writes_first":
            if me == 1:
                cls.second_in.wait(GATE_S)  # the second park has validated too
                return super().write_many(writes, sync=sync)
            cls.second_in.set()
            cls.first_published.wait(GATE_S)  # then writes over the winner's manifest
            return super().write_many(writes, sync=sync)
        if me == 1:
            cls.second_wrote.wait(GATE_S)  # the second writes first; this write is then stale
            return super().write_many(writes, sync=sync)
        done = super().write_many(writes, sync=sync)
        cls.second_wrote.set()
        cls.first_published.wait(GATE_S)  # publishes only after the first park did
        return done


@pytest.mark.parametrize("order", ["first_writes_first", "second_writes_first"])
def test_two_batch_parks_of_one_new_block_keep_the_winners_disk_copy(
        daemon: Callable[..., Daemon], order: str) -> None:
    store = type("Store", (Ordered,), {"order": order, "first_in": threading.Event(), "second_in": threading.Event(),
                                       "second_wrote": threading.Event(), "first_published": threading.Event()})
    # No flush at shutdown: what write_through acknowledged must already be on disk.
    d = daemon(disk_factory=store, **{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    blk = full(5000, 7)
    with Client(d.address) as c1, Client(d.address) as c2:
        t1, out1 = in_thread(lambda: c1.park_batch({"blk": [blk]}))
        assert store.first_in.wait(60)  # the second park starts once the first one is at the disk
        t2, out2 = in_thread(lambda: c2.park_batch({"blk": [blk]}))
        t1.join(60)
        store.first_published.set()
        t2.join(60)
        assert not isinstance(out1[0], BaseException), out1
        assert not isinstance(out2[0], BaseException), out2
        c1.park_batch({"next": [full(10, 1)]})
    check(d)
    d.stop()
    d2 = daemon()
    with Client(d2.address) as c:
        assert torch.equal(c.restore("blk")[0], blk)
        # The vLLM connector restores a request as one composite of its blocks.
        _, parts = c.restore_many(["blk", "next"])
        assert torch.equal(parts[0], blk) and torch.equal(parts[1], full(10, 1))
        assert c.stat().tiers["disk"].used_bytes == 5000 + 10
    check(d2)


# ------------------------------------------------------------------ windowed vs plain (#4)


def test_windowed_park_that_commits_after_a_plain_overwrite_wins(daemon: Callable[..., Daemon]) -> None:
    gate = Gate("v")
    d = daemon(disk_factory=gated_store(gate, "stage_blocks"), **{"tiers.host.capacity": "8MiB"})
    big = full(9 * MiB + 3, 5)
    with Client(d.address, transport="inline") as cw, Client(d.address) as cp:
        cp.park("v", [full(1000, 1)])
        t, out = in_thread(lambda: cw.park("v", [big], overwrite=True))  # larger than the host tier
        assert gate.entered.wait(60)  # reserved, staging its first window
        cp.park("v", [full(2000, 2)], overwrite=True)  # commits first
        gate.release.set()
        t.join(120)
        assert not isinstance(out[0], BaseException), out
        # The windowed park committed last: it is the version that stands.
        assert torch.equal(cp.restore("v")[0], big)
        assert cp.info("v").nbytes == big.numel()
    check(d)
    # Its records keep the generation they were staged under: found again after a restart.
    d.stop()
    d2 = daemon(**{"tiers.host.capacity": "8MiB"})
    with Client(d2.address) as c:
        assert torch.equal(c.restore("v")[0], big)
    check(d2)


# ------------------------------------------------------------------ two creates (#7)

KINDS = ("shm", "stream", "small", "windowed")


def _park_kind(d: Daemon, kind: str, seq_id: str, value: int) -> Callable[[], object]:
    size = {"shm": 3 * MiB + 1, "stream": 3 * MiB + 1, "small": 1000, "windowed": 9 * MiB + 1}[kind]
    transport = "shm" if kind == "shm" else "inline"

    def park() -> object:
        with Client(d.address, transport=transport) as c:
            return c.park(seq_id, [full(size, value)])

    return park


@pytest.mark.parametrize("first,second", list(itertools.product(KINDS, KINDS)))
def test_two_creates_of_one_id_exactly_one_wins(daemon: Callable[..., Daemon], first: str, second: str) -> None:
    gate = Gate("c")
    on = "stage_commit" if first == "windowed" else "write_many"
    # The inline stream: no data channel, so a plain inline park is one Park stream.
    d = daemon(disk_factory=gated_store(gate, on), **{"policy.write": "write_through",
                                                      "tiers.host.capacity": "8MiB", "server.data_channel": "false"})
    t1, out1 = in_thread(_park_kind(d, first, "c", 1))
    assert gate.entered.wait(60)  # the first create is between its commit point and publishing
    t2, out2 = in_thread(_park_kind(d, second, "c", 2))
    t2.join(GATE_S + 60)
    gate.release.set()
    t1.join(120)
    t2.join(120)
    results = out1 + out2
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(lost) == 1 and isinstance(lost[0], AlreadyExists), results
    winner = 1 if not isinstance(out1[0], BaseException) else 2
    with Client(d.address) as c:
        assert int(c.restore("c")[0][0]) == winner
    check(d)


# ------------------------------------------------------------------ a failed delete (#10b)


class FailsDeleteOnce(DiskStore):
    failed = 0

    def delete(self, m: Manifest, sync: bool = False) -> None:
        if m.seq_id == "x" and not type(self).failed:
            type(self).failed += 1
            # As a failing disk does: the store lets go of the generation, the records stay.
            with self._acct:
                self._forget((m.seq_id, m.gen))
            raise Unavailable("injected fault deleting 'x'")
        super().delete(m, sync)


def test_overwrite_whose_old_copy_fails_to_delete_is_a_success(daemon: Callable[..., Daemon]) -> None:
    store = type("Store", (FailsDeleteOnce,), {"failed": 0})
    d = daemon(disk_factory=store)
    e = d.engine
    assert e is not None
    with Client(d.address) as c:
        c.park("x", [full(3000, 1)])
        e.flush()  # the old version has a disk copy to delete
        info = c.park("x", [full(4000, 2)], overwrite=True)  # visible: must be acknowledged
        assert info.nbytes == 4000 and store.failed == 1
        assert torch.equal(c.restore("x")[0], full(4000, 2))
        # The old version's records are collected later; the accounting is exact meanwhile.
        assert c.stat().tiers["disk"].used_bytes == 0
        assert wait_until(lambda: not any(k[0] == "x" for k in e.disk.scan()[1]), timeout=30)
    check(d)


# ------------------------------------------------------------------ daemons sharing Redis (#5)


def _remote(url: str, ns: str) -> dict:
    return {"tiers.remote.url": url, "tiers.remote.namespace": ns, "tiers.remote.write": "write_through",
            "tiers.remote.timeout_s": 1.0, "tiers.remote.breaker_cooldown_s": 0.2}


def _own_dirs(tmp_path: Path, name: str) -> dict:
    (tmp_path / name / "shm").mkdir(parents=True)
    return {"tiers.disk.path": str(tmp_path / name / "disk"), "tiers.host.shm_dir": str(tmp_path / name / "shm")}


def _synced(c: Client) -> bool:
    r = c.stat().remote
    return r is not None and r.pending_writes == 0


def test_a_drop_on_one_daemon_never_deletes_another_daemons_version(
        tmp_path: Path, daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    ns = f"gen{os.getpid()}-{next(_ns)}"
    a = daemon(**_own_dirs(tmp_path, "a"), **_remote(redis_server.url, ns))
    b = daemon(**_own_dirs(tmp_path, "b"), **_remote(redis_server.url, ns))
    with Client(a.address) as ca, Client(b.address) as cb:
        ca.park("x", [full(3000, 1)])  # each daemon's first generation
        assert wait_until(lambda: _synced(ca), timeout=30)
        cb.park("x", [full(4000, 2)], overwrite=True)  # B's version replaces A's in Redis
        assert wait_until(lambda: _synced(cb), timeout=30)
        assert ca.drop("x")  # A drops its own version: not B's
        assert wait_until(lambda: _synced(ca), timeout=30)
    c = daemon(**_own_dirs(tmp_path, "c"), **_remote(redis_server.url, ns))
    with Client(c.address) as cc:
        assert torch.equal(cc.restore("x")[0], full(4000, 2))


@pytest.mark.parametrize("old_gen", [7, 3 << 40])
def test_a_store_written_with_plain_counter_generations_orders_new_versions_above_them(
        tmp_path: Path, daemon: Callable[..., Daemon], old_gen: int) -> None:
    # As an earlier build left it: generations with no instance component.
    store = DiskStore(str(tmp_path / "disk"), 256 * MiB)
    m = ParkSpec("old", (TensorMeta("uint8", (3000,), 3000),), 3000).manifest(old_gen, MiB)
    store.write(m, [memoryview(bytes([1]) * 3000)], sync=True)
    store.close()
    d = daemon(**{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    with Client(d.address) as c:
        assert torch.equal(c.restore("old")[0], full(3000, 1))
        c.park("old", [full(4000, 2)], overwrite=True)
    check(d)
    d.stop()
    d2 = daemon()
    with Client(d2.address) as c:
        assert torch.equal(c.restore("old")[0], full(4000, 2))
    check(d2)


def test_generations_of_two_daemons_never_collide(tmp_path: Path, daemon: Callable[..., Daemon]) -> None:
    a = daemon(**_own_dirs(tmp_path, "a"))
    b = daemon(**_own_dirs(tmp_path, "b"))
    gens: dict[str, set[int]] = {}
    for name, d in (("a", a), ("b", b)):
        with Client(d.address) as c:
            for i in range(5):
                c.park(f"s{i}", [full(100, i)])
        d.engine.flush()  # type: ignore[union-attr]
        gens[name] = {m.gen for m in d.engine.disk.scan()[0].values()}  # type: ignore[union-attr]
    assert gens["a"] and gens["b"] and not gens["a"] & gens["b"]
