"""write_through overwrites refused after their transaction committed (the fsync failed),
racing a drop or an older overwrite of the same id: what a crash right after the answers
leaves. Found by a fresh-eyes attack."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

import lmdb
import pytest
import torch

from kvpark.client import Client, KVParkError, Unavailable
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

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


def waiting_for_a_commit_of_its_id() -> bool:
    """Some thread waits in ``Pending.wait`` (a commit waiting for another of its ids)."""
    for frame in sys._current_frames().values():
        f = frame
        while f is not None:
            if f.f_code.co_name == "wait" and f.f_code.co_filename.endswith("commit.py"):
                return True
            f = f.f_back
    return False


class GatedThenFailingSyncs(GatedWrites):
    """A write held before its transaction (``GatedWrites``); once ``fail_at`` is set,
    the fsync that many syncs later fails (LMDB's I/O error), after its transaction."""

    fail_at = 0
    stage_hold = ""  # the same hold for a windowed park's commit transaction

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        cls = GatedThenFailingSyncs
        if cls.stage_hold and m.seq_id == cls.stage_hold:
            cls.stage_hold = ""
            GatedWrites.entered.set()
            assert GatedWrites.gate.wait(60), "the test never opened the gate"
        return super().stage_commit(m, replace, sync=sync)

    def sync(self) -> None:
        cls = GatedThenFailingSyncs
        if cls.fail_at:
            cls.fail_at -= 1
            if cls.fail_at == 0:
                raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()


@pytest.fixture
def gated() -> Iterator[type[GatedThenFailingSyncs]]:
    GatedWrites.entered.clear()
    GatedWrites.gate.clear()
    GatedThenFailingSyncs.hold = GatedThenFailingSyncs.stage_hold = ""
    GatedThenFailingSyncs.fail_at = 0
    yield GatedThenFailingSyncs
    GatedThenFailingSyncs.hold = GatedThenFailingSyncs.stage_hold = ""
    GatedThenFailingSyncs.fail_at = 0
    GatedWrites.gate.set()


@pytest.mark.parametrize("refused", ["none", "first", "second"])
@pytest.mark.parametrize("first_kind", ["plain", "windowed"])
def test_a_write_through_commit_waits_for_the_one_of_its_id_under_way_and_a_refusal_undoes_only_itself(
        daemon: Callable[..., Daemon], gated: type[GatedThenFailingSyncs], tmp_path: Path,
        refused: str, first_kind: str) -> None:
    """write_through, "x" v1 on disk. Overwrite B (plain or windowed) is held before its
    write; overwrite A of "x" then waits for B's commit to end before it takes its
    generation (one commit of an id on disk at a time). Either may be refused after its
    transaction committed (its fsync failing): the refusal puts back the manifest it
    replaced, and the other answers with its copy on disk. Concurrent commits once let an
    older write lose to a newer unanswered one and be acknowledged with no copy on disk
    (a crash lost it), or a refusal put back the wrong manifest."""
    over = {"policy.write": "write_through", "tiers.host.capacity": "4MiB"}
    d = daemon(disk_factory=gated, **over)
    eng = d.engine
    assert eng is not None
    out: dict[str, object] = {}
    size = 5 * MiB + 1 if first_kind == "windowed" else 4096

    def park(name: str, n: int, v: int) -> None:
        with Client(d.address, transport="inline") as c2:
            try:
                c2.park("x", [full(n, v)], overwrite=True)
                out[name] = "ok"
            except KVParkError as e:
                out[name] = e

    with Client(d.address, transport="inline") as c:
        c.park("other", [full(4096, 3)])
        c.park("x", [full(4096, 1)])
        if first_kind == "plain":
            gated.hold = "x"  # B's write transaction waits at the gate
        else:
            gated.stage_hold = "x"  # B's commit transaction (windowed) waits at the gate
        b = threading.Thread(target=park, args=("B", size, 2))
        b.start()
        assert GatedWrites.entered.wait(30), "B never reached its commit"
        a = threading.Thread(target=park, args=("A", 4096, 4))
        a.start()
        assert wait_until(waiting_for_a_commit_of_its_id, timeout=30), "A did not wait for B"
        gated.fail_at = {"none": 0, "first": 1, "second": 2}[refused]
        GatedWrites.gate.set()
        b.join(60)
        a.join(60)
        want = {"none": ("ok", "ok", 4), "first": (Unavailable, "ok", 4), "second": ("ok", Unavailable, 2)}[refused]
        for name, w in zip("BA", want[:2]):
            assert out.get(name) == w if w == "ok" else isinstance(out.get(name), w), out
        assert [int(t[0]) for t in c.restore("x")] == [want[2]]
        eng.check_invariants()
        image = crash_image(eng.disk, str(tmp_path / "crash"))  # a SIGKILL after both answers
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, **over})
    with Client(d2.address) as c:
        assert [int(t[0]) for t in c.restore("x")] == [want[2]] and int(c.restore("other")[0][0]) == 3


def test_a_write_through_commit_that_gives_up_waiting_leaves_nothing_pending(
        daemon: Callable[..., Daemon], gated: type[GatedThenFailingSyncs], monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for the commit of the id under way is bounded: past it the park answers
    UNAVAILABLE and holds nothing, so the id parks again once the other commit ended."""
    from kvpark.daemon import commit as commit_mod

    monkeypatch.setattr(commit_mod, "PENDING_WAIT_S", 1.0)
    d = daemon(disk_factory=gated, **{"policy.write": "write_through"})
    eng = d.engine
    assert eng is not None
    out: dict[str, object] = {}
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        gated.hold = "x"
        b = threading.Thread(target=lambda: out.update(B=c.park("x", [full(4096, 2)], overwrite=True)))
        b.start()
        assert GatedWrites.entered.wait(30)
        with Client(d.address, transport="inline") as c2, pytest.raises(Unavailable, match="did not finish"):
            c2.park("x", [full(4096, 4)], overwrite=True)
        GatedWrites.gate.set()
        b.join(30)
        assert "B" in out and not eng.pending.busy(["x"])
        c.park("x", [full(4096, 5)], overwrite=True)
        assert [int(t[0]) for t in c.restore("x")] == [5]
        eng.check_invariants()
