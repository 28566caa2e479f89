"""write_through commits that lose on disk to newer, unanswered commits of their id, and
refusals that undo a write: an acknowledged park always keeps its disk copy, and a wait
that gives up leaves nothing pending. Found by a fresh-eyes attack on the change that made
a losing write wait; each test failed on that change as first written."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import lmdb
import pytest
import torch

from kvpark.client import Client, KVParkError, Unavailable
from kvpark.daemon import commit as commit_mod
from kvpark.daemon import window as window_mod
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest, Write

from ..conftest import wait_until
from .disk_seams import crash_image
from .test_refused_overwrite_attacks import waiting_for_other_commits

MiB = 1 << 20
WT = {"policy.write": "write_through"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class Hold:
    """One pinned point: ``entered`` set when reached, waits at ``gate``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

    def stop(self) -> None:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"


class Seams(DiskStore):
    """Pins for writes of "x" and for fsyncs (all class-level, reset by the fixture).

    - ``first_write``: the first ``write_many`` of "x" waits before its transaction; its
      generation is remembered as ``first_gen``.
    - ``second_write``: the second ``write_many`` of "x" at ``first_gen`` (the same commit
      writing again) waits before its transaction.
    - ``after_write``: armed by ``after_armed``; the next ``write_many`` of "x" waits just
      after it committed and synced.
    - ``syncs``: armed fsyncs, in order: each waits at its gate, then fails (EIO).
    - ``stage``: armed by ``stage_armed``; the next ``stage_commit`` of "x" waits before
      its transaction.
    """

    lock = threading.Lock()
    first_armed = False
    first_gen = -1
    first_write = Hold()
    second_write = Hold()
    after_armed = False
    after_write = Hold()
    calls: dict[int, int] = {}
    syncs: list[Hold] = []
    stage_armed = False
    stage = Hold()

    @classmethod
    def reset(cls) -> None:
        cls.first_armed, cls.first_gen, cls.after_armed, cls.stage_armed = False, -1, False, False
        cls.first_write, cls.second_write, cls.after_write, cls.stage = Hold(), Hold(), Hold(), Hold()
        cls.calls, cls.syncs = {}, []

    @classmethod
    def open_all(cls) -> None:
        for h in (cls.first_write, cls.second_write, cls.after_write, cls.stage, *cls.syncs):
            h.gate.set()
        cls.syncs = []
        cls.first_armed = cls.after_armed = cls.stage_armed = False

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = Seams
        hold: Hold | None = None
        after = False
        xs = [w.manifest for w in writes if w.manifest.seq_id == "x"]
        with cls.lock:
            for m in xs:
                cls.calls[m.gen] = cls.calls.get(m.gen, 0) + 1
                if cls.first_armed:
                    cls.first_armed, cls.first_gen, hold = False, m.gen, cls.first_write
                elif m.gen == cls.first_gen and cls.calls[m.gen] == 2:
                    hold = cls.second_write
            if xs and cls.after_armed:
                cls.after_armed, after = False, True
        if hold is not None:
            hold.stop()
        done = super().write_many(writes, sync=sync)
        if after:
            cls.after_write.stop()
        return done

    def sync(self) -> None:
        cls = Seams
        with cls.lock:
            h = cls.syncs.pop(0) if cls.syncs else None
        if h is not None:
            h.stop()
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        cls = Seams
        with cls.lock:
            mine = cls.stage_armed and m.seq_id == "x"
            if mine:
                cls.stage_armed = False
        if mine:
            cls.stage.stop()
        return super().stage_commit(m, replace, sync=sync)


@pytest.fixture
def seams() -> Iterator[type[Seams]]:
    Seams.reset()
    yield Seams
    Seams.open_all()


def parker(d: Daemon, out: dict[str, object], name: str, n: int, v: int) -> threading.Thread:
    def run() -> None:
        with Client(d.address, transport="inline") as c:
            try:
                c.park("x", [full(n, v)], overwrite=True)
                out[name] = "ok"
            except KVParkError as e:
                out[name] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def restored_after_crash(daemon: Callable[..., Daemon], image: str) -> list[int] | None:
    d2 = daemon(**{"tiers.disk.path": image, **WT})
    with Client(d2.address) as c:
        return [int(t[0]) for t in c.restore("x")] if c.present(["x"]) == [True] else None


def test_a_write_that_loses_twice_to_refused_overwrites_waits_again_until_it_is_on_disk(
        daemon: Callable[..., Daemon], seams: type[Seams], tmp_path: Path) -> None:
    """write_through, "x" v1 on disk. A (overwrite, generation a) waits before its write.
    B (b > a) commits its transaction, its fsync held. A's write loses to b; A waits for B
    (``wait_newer``). B's fsync fails: refused, v1's manifest put back. A writes again,
    but held just before that transaction, C (c > b) commits its transaction and holds in
    its fsync. A's second write loses to c, and A waits again (it once published then and
    was acknowledged with no disk copy: after C's refusal a crash found no "x"). A is on
    disk when it answers."""
    d = daemon(disk_factory=seams, **WT)
    eng = d.engine
    assert eng is not None
    out: dict[str, object] = {}
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        seams.first_armed = True
        a = parker(d, out, "A", 4096, 2)
        assert seams.first_write.entered.wait(30), "A never reached its write"
        fb = Hold()
        seams.syncs = [fb]
        b = parker(d, out, "B", 4096, 3)
        assert fb.entered.wait(30), "B never reached its fsync"
        seams.first_write.gate.set()  # A's write loses to B's manifest
        assert wait_until(lambda: "A" in out or waiting_for_other_commits(), timeout=30)
        fb.gate.set()  # B refused, reverted
        b.join(30)
        assert seams.second_write.entered.wait(30), "A never wrote again"
        fc = Hold()
        seams.syncs = [fc]
        cth = parker(d, out, "C", 4096, 4)
        assert fc.entered.wait(30), "C never reached its fsync"
        seams.second_write.gate.set()  # A's second write loses to C's manifest
        assert wait_until(lambda: "A" in out or waiting_for_other_commits(), timeout=30)
        fc.gate.set()  # C refused
        cth.join(30)
        a.join(30)
        assert isinstance(out.get("B"), KVParkError) and isinstance(out.get("C"), KVParkError), out
        acked = out.get("A") == "ok"
        image = crash_image(eng.disk, str(tmp_path / "crash"))
        if acked:
            assert [int(t[0]) for t in c.restore("x")] == [2]
    d.stop(0.5)
    got = restored_after_crash(daemon, image)
    if acked:
        assert got == [2], f"A (acknowledged, write_through) lost by a crash: 'x' restores {got}"
    else:
        assert got == [1], got


def test_a_refused_overwrite_puts_back_the_manifest_its_own_transaction_replaced(
        daemon: Callable[..., Daemon], seams: type[Seams], tmp_path: Path) -> None:
    """write_through, "x" v1 on disk. A (overwrite, generation a) writes and fsyncs its
    manifest, and is held before it publishes (it is still pending; the index still has
    v1). B (b > a) commits its transaction over A's manifest; its fsync fails. B's refusal
    puts back the manifest its own transaction replaced: A's (it once put back v1's, the
    version the index held, over A's; A then published as on disk and its delete of v1
    left LMDB with no manifest of "x")."""
    d = daemon(disk_factory=seams, **WT)
    eng = d.engine
    assert eng is not None
    out: dict[str, object] = {}
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        seams.after_armed = True
        a = parker(d, out, "A", 4096, 2)
        assert seams.after_write.entered.wait(30), "A never wrote"
        fb = Hold()
        fb.gate.set()  # B's fsync fails at once
        seams.syncs = [fb]
        b = parker(d, out, "B", 4096, 3)
        b.join(30)
        assert isinstance(out.get("B"), KVParkError), out
        seams.after_write.gate.set()
        a.join(30)
        assert out.get("A") == "ok", out
        assert [int(t[0]) for t in c.restore("x")] == [2]
        image = crash_image(eng.disk, str(tmp_path / "crash"))
        try:
            eng.check_invariants()
        except AssertionError as e:
            invariant = str(e)
        else:
            invariant = ""
    d.stop(0.5)
    got = restored_after_crash(daemon, image)
    assert got == [2] and not invariant, \
        f"A (acknowledged, write_through) lost by a crash: 'x' restores {got}; invariants: {invariant!r}"


def test_a_windowed_park_whose_wait_for_a_newer_commit_gives_up_leaves_nothing_pending(
        daemon: Callable[..., Daemon], seams: type[Seams], monkeypatch: pytest.MonkeyPatch) -> None:
    """write_through: windowed park W of "x" loses on disk to overwrite A, whose fsync
    hangs. W's ``wait_newer`` gives up (UNAVAILABLE) from inside ``with catalog.lock``
    without ``pending.done``: "x" stays pending for good. After A ends and "x" is dropped,
    a create of "x" waits for that phantom commit and is refused UNAVAILABLE every time.
    (The wait limit is shortened from 60 s so the test runs quickly.)"""
    monkeypatch.setattr(window_mod, "PENDING_WAIT_S", 1.0)
    monkeypatch.setattr(commit_mod, "PENDING_WAIT_S", 1.0)
    d = daemon(disk_factory=seams, **{**WT, "tiers.host.capacity": "4MiB"})
    eng = d.engine
    assert eng is not None
    out: dict[str, object] = {}
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        seams.stage_armed = True
        w = parker(d, out, "W", 5 * MiB + 1, 2)
        assert seams.stage.entered.wait(30), "W never reached its commit"
        fa = Hold()
        seams.syncs = [fa]
        a = parker(d, out, "A", 4096, 3)
        assert fa.entered.wait(30), "A never reached its fsync"
        seams.stage.gate.set()  # W loses to A's manifest, waits for A, gives up
        w.join(30)
        assert isinstance(out.get("W"), Unavailable), out
        fa.gate.set()  # A refused
        a.join(30)
        assert isinstance(out.get("A"), KVParkError), out
        assert c.drop("x")
        leaked = dict(eng.pending._ids)
        try:
            c.park("x", [full(4096, 5)])  # a create
            created = "ok"
        except KVParkError as e:
            created = repr(e)
        assert created == "ok" and not leaked, f"create of 'x' after its drop: {created}; pending ids: {leaked}"
