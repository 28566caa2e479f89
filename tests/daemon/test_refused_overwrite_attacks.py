"""write_through overwrites refused after their transaction committed (the fsync failed),
racing a drop or an older overwrite of the same id: what a crash right after the answers
leaves. Found by a fresh-eyes attack."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import lmdb
import pytest
import torch

from kvpark.client import Client, KVParkError, Unavailable
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest, Write

from ..conftest import wait_until
from .disk_seams import GatedWrites, crash_image

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class HeldFailingSync(DiskStore):
    """Once armed, the next fsync (its write transaction already committed) waits at
    ``gate`` (``entered`` set) and then fails as LMDB reports an I/O error."""

    armed = False
    entered = threading.Event()
    gate = threading.Event()

    def sync(self) -> None:
        cls = HeldFailingSync
        if cls.armed:
            cls.armed = False
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()


@pytest.fixture
def failing() -> Iterator[type[HeldFailingSync]]:
    HeldFailingSync.armed = False
    HeldFailingSync.entered.clear()
    HeldFailingSync.gate.clear()
    yield HeldFailingSync
    HeldFailingSync.armed = False
    HeldFailingSync.gate.set()


def test_a_drop_acknowledged_while_a_refused_overwrite_of_the_id_is_in_its_error_path_stays_dropped_after_a_crash(
        daemon: Callable[..., Daemon], failing: type[HeldFailingSync], tmp_path: Path) -> None:
    """write_through: an overwrite of "x" commits its transaction (its manifest replaces
    v1's) and its fsync fails; before its error path runs, a drop of "x" is acknowledged.
    A crash before the overwrite's answer may show its bytes (it is undecided then, so
    possibly applied after the drop); once it has answered with its refusal, a crash must
    find "x" gone."""
    over = {"policy.write": "write_through"}
    d = daemon(disk_factory=failing, **over)
    eng = d.engine
    assert eng is not None
    errs: list[BaseException] = []
    with Client(d.address, transport="inline") as c:
        c.park("other", [full(MiB, 3)])
        c.park("x", [full(MiB, 1)])

        def overwrite() -> None:
            with Client(d.address, transport="inline") as c2:
                try:
                    c2.park("x", [full(MiB, 2)], overwrite=True)
                except KVParkError as e:
                    errs.append(e)

        failing.armed = True
        t = threading.Thread(target=overwrite)
        t.start()
        assert failing.entered.wait(30), "the overwrite never reached its fsync"
        assert c.drop("x")  # acknowledged
        failing.gate.set()
        t.join(30)
        assert errs, "the overwrite was to be refused"
        image = crash_image(eng.disk, str(tmp_path / "crash"))  # a SIGKILL after both answers
        eng.check_invariants()
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, **over})
    with Client(d2.address) as c:
        assert int(c.restore("other")[0][0]) == 3
        got = [int(t[0]) for t in c.restore("x")] if c.present(["x"]) == [True] else None
        assert got is None, f"the acknowledged drop of 'x' was undone by a crash: it restores {got}"


def waiting_for_other_commits() -> bool:
    """Some thread waits in ``Pending.wait_newer`` (a commit waiting for a newer one of its id)."""
    for frame in sys._current_frames().values():
        f = frame
        while f is not None:
            if f.f_code.co_name == "wait_newer":
                return True
            f = f.f_back
    return False


class GatedThenFailingSync(GatedWrites, HeldFailingSync):
    """A write held before its transaction (``GatedWrites``), and a failing fsync held."""


@pytest.fixture
def gated() -> Iterator[type[GatedThenFailingSync]]:
    GatedWrites.entered.clear()
    GatedWrites.gate.clear()
    GatedThenFailingSync.hold = ""
    HeldFailingSync.armed = False
    HeldFailingSync.entered.clear()
    HeldFailingSync.gate.clear()
    yield GatedThenFailingSync
    GatedThenFailingSync.hold = ""
    HeldFailingSync.armed = False
    GatedWrites.gate.set()
    HeldFailingSync.gate.set()


def test_an_acknowledged_write_through_overwrite_is_on_disk_when_a_newer_refused_overwrite_of_the_id_is_reverted(
        daemon: Callable[..., Daemon], gated: type[GatedThenFailingSync], tmp_path: Path) -> None:
    """write_through, three versions of "x": v1 on disk. Overwrite B takes its generation
    (g) and waits before its transaction; overwrite A takes g' > g, commits its
    transaction (its manifest replaces v1's) and its fsync fails. B's transaction finds
    g' on disk and skips its write. B once published and was acknowledged with no disk
    copy, and A's refusal then deleted A's manifest: a SIGKILL lost B. Now B waits for A
    to end and writes again."""
    over = {"policy.write": "write_through"}
    d = daemon(disk_factory=gated, **over)
    eng = d.engine
    assert eng is not None
    out: dict[str, object] = {}

    def park(name: str, v: int) -> None:
        with Client(d.address, transport="inline") as c2:
            try:
                c2.park("x", [full(MiB, v)], overwrite=True)
                out[name] = "ok"
            except KVParkError as e:
                out[name] = e

    with Client(d.address, transport="inline") as c:
        c.park("other", [full(MiB, 3)])
        c.park("x", [full(MiB, 1)])
        gated.hold = "x"
        b = threading.Thread(target=park, args=("B", 2))
        b.start()
        assert GatedWrites.entered.wait(30), "B never reached its write"
        HeldFailingSync.armed = True
        a = threading.Thread(target=park, args=("A", 4))
        a.start()
        assert HeldFailingSync.entered.wait(30), "A never reached its fsync"
        GatedWrites.gate.set()  # B's write finds A's newer manifest on disk
        # Step: B has either answered (it once did, with no disk copy) or waits for A.
        assert wait_until(lambda: "B" in out or waiting_for_other_commits(), timeout=30)
        HeldFailingSync.gate.set()
        a.join(30)
        b.join(30)
        assert isinstance(out.get("A"), KVParkError), out  # A refused
        assert out.get("B") == "ok", out  # B acknowledged (write_through), after writing again
        eng.check_invariants()
        assert [int(t[0]) for t in c.restore("x")] == [2]
        image = crash_image(eng.disk, str(tmp_path / "crash"))  # a SIGKILL after both answers
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, **over})
    with Client(d2.address) as c:
        assert int(c.restore("other")[0][0]) == 3
        got = [int(t[0]) for t in c.restore("x")] if c.present(["x"]) == [True] else None
        assert got == [2], f"the acknowledged write_through overwrite of 'x' was lost by a crash: {got}"


class HeldStageCommit(HeldFailingSync):
    """``stage_commit`` of ``hold`` waits at ``commit_gate`` once (``commit_entered`` set),
    before its transaction; a failing fsync held as in ``HeldFailingSync``."""

    hold = ""
    commit_entered = threading.Event()
    commit_gate = threading.Event()

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        cls = HeldStageCommit
        if cls.hold and m.seq_id == cls.hold:
            cls.hold = ""
            cls.commit_entered.set()
            assert cls.commit_gate.wait(60), "the test never opened the gate"
        return super().stage_commit(m, replace, sync=sync)


def test_a_windowed_park_that_lost_to_a_refused_overwrite_is_not_acknowledged(
        daemon: Callable[..., Daemon], failing: type[HeldFailingSync], tmp_path: Path) -> None:
    """write_through: windowed park W of "x" takes its generation and waits before its
    commit transaction; overwrite A takes a newer one, commits, and its fsync fails. W's
    commit finds A's manifest and loses (its records go). W then waits for A: A is refused
    and v1's manifest comes back, so W answers UNAVAILABLE (never a success with no copy
    on disk), and a crash finds v1."""
    HeldStageCommit.commit_entered.clear()
    HeldStageCommit.commit_gate.clear()
    over = {"policy.write": "write_through", "tiers.host.capacity": "4MiB"}
    d = daemon(disk_factory=HeldStageCommit, **over)
    eng = d.engine
    assert eng is not None
    out: dict[str, object] = {}

    def park(name: str, n: int, v: int) -> None:
        with Client(d.address, transport="inline") as c2:
            try:
                c2.park("x", [full(n, v)], overwrite=True)
                out[name] = "ok"
            except KVParkError as e:
                out[name] = e

    try:
        with Client(d.address, transport="inline") as c:
            c.park("other", [full(4096, 3)])
            c.park("x", [full(4096, 1)])
            HeldStageCommit.hold = "x"
            w = threading.Thread(target=park, args=("W", 5 * MiB + 1, 2))
            w.start()
            assert HeldStageCommit.commit_entered.wait(30), "W never reached its commit"
            failing.armed = True
            a = threading.Thread(target=park, args=("A", 4096, 4))
            a.start()
            assert failing.entered.wait(30), "A never reached its fsync"
            HeldStageCommit.commit_gate.set()
            assert wait_until(lambda: "W" in out or waiting_for_other_commits(), timeout=30)
            failing.gate.set()
            a.join(30)
            w.join(30)
            assert isinstance(out.get("A"), KVParkError), out
            assert isinstance(out.get("W"), Unavailable), out
            assert [int(t[0]) for t in c.restore("x")] == [1]
            image = crash_image(eng.disk, str(tmp_path / "crash"))
            eng.check_invariants()
    finally:
        HeldStageCommit.hold = ""
        HeldStageCommit.commit_gate.set()
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, **over})
    with Client(d2.address) as c:
        assert [int(t[0]) for t in c.restore("x")] == [1] and int(c.restore("other")[0][0]) == 3


class HeldWrites(DiskStore):
    """The next ``n`` write transactions holding "x" wait at ``gate`` (``arrived`` counts them)."""

    n = 0
    arrived = 0
    lock = threading.Lock()
    gate = threading.Event()

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = HeldWrites
        with cls.lock:
            mine = cls.n > 0 and any(w.manifest.seq_id == "x" for w in writes)
            if mine:
                cls.n -= 1
                cls.arrived += 1
        if mine:
            assert cls.gate.wait(60), "the test never opened the gate"
        return super().write_many(writes, sync=sync)


def test_two_older_overwrites_that_lost_to_a_newer_one_on_disk_both_answer(daemon: Callable[..., Daemon]) -> None:
    """write_through, three overwrites of "x": the two older ones wait before their write
    transactions while the newest commits and answers. Both older writes then lose to it
    on disk, and each waits only for commits newer than itself, never for the other
    (waiting for each other, they hung until the pending wait gave up)."""
    HeldWrites.n, HeldWrites.arrived = 2, 0
    HeldWrites.gate.clear()
    d = daemon(disk_factory=HeldWrites, **{"policy.write": "write_through"})
    out: dict[str, object] = {}

    def park(name: str, v: int) -> None:
        with Client(d.address, transport="inline") as c2:
            try:
                c2.park("x", [full(4096, v)], overwrite=True)
                out[name] = "ok"
            except KVParkError as e:
                out[name] = e

    try:
        older = [threading.Thread(target=park, args=(f"old{v}", v)) for v in (1, 2)]
        for t in older:
            t.start()
        assert wait_until(lambda: HeldWrites.arrived == 2, timeout=30)
        park("new", 3)  # not held: commits and answers first
        HeldWrites.gate.set()
        for t in older:
            t.join(30)
        assert out == {"old1": "ok", "old2": "ok", "new": "ok"}, out
        with Client(d.address) as c:
            assert [int(t[0]) for t in c.restore("x")] == [3]  # the newest stands
        assert d.engine is not None
        d.engine.check_invariants()
    finally:
        HeldWrites.gate.set()
