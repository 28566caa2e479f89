"""A refused write_through commit whose undo failed keeps its id pending until the retry
redoes the undo, and that hold is released exactly once (by the commit, or by the queued
undo that owns it), on the fsync path and the publish path alike: never a second create
of the id let through. Found by a fresh-eyes attack; each test failed on the code as it
was.

The seam is one ``DiskStore`` subclass (``Faults``): an fsync that fails once, an undo
(the block deletes inside ``revert``'s transaction) that fails for one generation for as
long as the test says, one write transaction held at a gate, and a hook on ``holds``.
Nothing of the daemon is mocked."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import lmdb
import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest, Write

from .disk_seams import crash_image

WT = {"policy.write": "write_through"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class Faults(DiskStore):
    """``sync_armed``: the next fsync fails (EIO). ``stuck_id``: the next undo of that
    id fails (its transaction rolls back) and every later undo of that generation fails
    too while ``stuck`` is set. ``hold``: the next write transaction of that id waits at
    ``gate`` (``entered`` set). ``on_holds``: ``(seq_id, fn)``: ``fn`` runs once when
    ``holds`` is asked about that id."""

    sync_armed = False
    stuck_id = ""
    stuck_gen: int | None = None
    stuck = False
    hold = ""
    entered = threading.Event()
    gate = threading.Event()
    on_holds: tuple[str, Callable[[], None]] | None = None
    on_delete: tuple[str, Callable[[DiskStore], None]] | None = None

    @classmethod
    def reset(cls) -> None:
        cls.sync_armed = cls.stuck = False
        cls.stuck_id, cls.stuck_gen, cls.hold, cls.on_holds, cls.on_delete = "", None, "", None, None
        cls.entered, cls.gate = threading.Event(), threading.Event()

    def sync(self) -> None:
        if Faults.sync_armed:
            Faults.sync_armed = False
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        cls = Faults
        if cls.stuck_id and m.seq_id == cls.stuck_id and cls.stuck_gen is None:
            cls.stuck_gen, cls.stuck = m.gen, True
            raise lmdb.Error("mdb_del: Input/output error")
        if cls.stuck and m.seq_id == cls.stuck_id and m.gen == cls.stuck_gen:
            raise lmdb.Error("mdb_del: Input/output error")
        super()._delete_blocks(txn, m)

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = Faults
        if cls.hold and any(w.manifest.seq_id == cls.hold for w in writes):
            cls.hold = ""
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
        return super().write_many(writes, sync=sync)

    def delete(self, m: Manifest, sync: bool = False) -> None:
        hook = Faults.on_delete
        if hook is not None and m.seq_id == hook[0]:
            Faults.on_delete = None
            hook[1](self)
        super().delete(m, sync=sync)

    def holds(self, m: Manifest) -> bool:
        hook = Faults.on_holds
        if hook is not None and m.seq_id == hook[0]:
            Faults.on_holds = None
            hook[1]()
        return super().holds(m)


@pytest.fixture
def faults() -> Iterator[type[Faults]]:
    Faults.reset()
    yield Faults
    Faults.gate.set()
    Faults.reset()


def invariants(d: Daemon) -> str:
    assert d.engine is not None
    try:
        d.engine.check_invariants()
        return ""
    except AssertionError as e:
        return str(e)


class Bg:
    """A call in its own thread; ``result()`` joins it."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.value: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.value = fn()
        except BaseException as e:  # noqa: BLE001 - surfaced to the test
            self.error = e

    def result(self, timeout: float = 90.0) -> object:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call never returned"
        return self.error if self.error is not None else self.value


def unused_block(daemon: Callable[..., Daemon], faults: type[Faults], tmp_path: Path) -> Daemon:
    """A write_through daemon whose index holds shared block "b" v1, on disk and used by
    nobody: a crash between the drop of its last user's manifest and its own delete (a
    crash image taken there), started again."""
    d0 = daemon(disk_factory=faults, **WT)
    image = str(tmp_path / "unused-block")
    with Client(d0.address, transport="inline") as c:
        c.park("s1", [full(64, 9)], refs=["b"], new_blocks={"b": [full(4096, 1)]})
        faults.on_delete = ("b", lambda disk: crash_image(disk, image))
        assert c.drop("s1")
    d0.stop(0.5)
    d = daemon(disk_factory=faults, **{"tiers.disk.path": image, **WT})
    with Client(d.address) as c:
        assert c.present(["s1", "b"]) == [False, True]
    return d


def refuse_overwrite_at_publish(d: Daemon, faults: type[Faults], c: Client) -> None:
    """Shared block "b" v1 on disk, used by nobody (``unused_block``). Overwrite P of "b" (a plain
    sequence) passes its validation, is held at its write; meanwhile "s2" takes "b" up
    (refs), so P's publish fails (FailedPrecondition: a shared block in use) after P's
    transaction committed and synced: P's manifest replaced v1's. P's undo (``revert``)
    fails and stays failing (``stuck``): queued for the maintenance pass."""
    faults.hold = "b"
    p = Bg(lambda: c.park("b", [full(4096, 2)], overwrite=True))
    assert faults.entered.wait(30), "P never reached its write"
    with Client(d.address, transport="inline") as c2:
        c2.park("s2", [full(64, 8)], refs=["b"])  # "b" in use now
    faults.stuck_id = "b"
    faults.gate.set()
    got = p.result()
    assert isinstance(got, KVParkError) and "in use" in str(got), f"P was not refused at its publish: {got!r}"
    assert d.engine is not None and d.engine.deletes.pending == 1 and faults.stuck, "P's undo did not fail and queue"


def test_an_overwrite_refused_at_its_publish_whose_undo_failed_keeps_its_id_pending(
        daemon: Callable[..., Daemon], faults: type[Faults], tmp_path: Path) -> None:
    """The publish-failure path (``commit.py``: ``undo`` after ``publish_commit`` raised;
    ``window.py`` likewise) runs the same undo as the fsync path, but releases its ids in
    its ``finally`` whatever became of the undo: with the undo queued, P's refused
    manifest is current in LMDB over "b" v1's, and "b" is not pending. The rule
    (docs/protocol.md, "Versions and commits"): until the undo succeeds the refused
    commit keeps its ids pending."""
    d = unused_block(daemon, faults, tmp_path)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        refuse_overwrite_at_publish(d, faults, c)
        with eng.catalog.lock:
            busy = eng.pending.busy(["b"])
        assert busy, "P's undo is queued (its refused manifest current on disk) and 'b' is no longer pending"


def test_the_undo_of_an_overwrite_refused_at_its_publish_releases_the_next_commits_hold(
        daemon: Callable[..., Daemon], faults: type[Faults], tmp_path: Path) -> None:
    """As above (P refused at its publish, its undo queued, "b" released at once). Then
    "s2" is dropped ("b", its last user gone, goes with it), and create C of "b" is at its
    write, holding "b" pending. The maintenance pass redoes P's undo and calls
    ``on_undone(["b"])``: ``pending.done`` for a hold P gave up long ago, so it releases
    C's. Create D of "b" then does not wait for C: D publishes; C's write loses to D's
    newer generation on disk, C is "superseded" and answered OK too. Two creates of one
    id both succeed (the rule: exactly one create wins)."""
    d = unused_block(daemon, faults, tmp_path)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        refuse_overwrite_at_publish(d, faults, c)
        assert c.drop("s2")
        assert c.present(["b"]) == [False]
        faults.entered, faults.gate = threading.Event(), threading.Event()
        faults.hold = "b"
        cc = Bg(lambda: c.park("b", [full(4096, 3)]))  # create C
        faults.entered.wait(1.0)  # on 9031bd7 C is at its write at once
        faults.stuck = False  # the disk heals
        eng.deletes.retry()  # the maintenance pass: P's undo goes through
        assert faults.entered.wait(30), "C never reached its write"
        with eng.catalog.lock:
            busy = eng.pending.busy(["b"])
        dd = Bg(lambda: c.park("b", [full(4096, 4)]))  # create D
        dd.thread.join(1.0)  # on 9031bd7 D does not wait for C
        faults.gate.set()
        got_c, got_d = cc.result(), dd.result()
    wins = [v for v, g in (("C", got_c), ("D", got_d)) if not isinstance(g, BaseException)]
    assert busy and len(wins) == 1, \
        f"'b' pending while C writes: {busy}; creates that succeeded: {wins} (C: {got_c!r}, D: {got_d!r})"


def test_a_retry_that_undoes_a_refused_commits_write_before_the_commit_looks_releases_its_ids_twice(
        daemon: Callable[..., Daemon], faults: type[Faults]) -> None:
    """Park R of "y" with new shared block "x" (one transaction: ``mine`` = [x, y]); its
    fsync fails: refused. R's error path undoes each: x's undo fails and is queued. The
    maintenance pass runs before R's ``finally`` looks (pinned at R's ``holds(y)``): it
    undoes x and ``on_undone(["x"])`` releases "x". Create Q of "x" then (rightly) goes
    ahead and is at its write, holding "x". R's ``finally`` finds no undo queued for x
    and releases "x" again: Q's hold. Create D of "x" does not wait for Q: both creates
    of "x" succeed."""
    d = daemon(disk_factory=faults, **WT)
    eng = d.engine
    assert eng is not None
    q: list[Bg] = []

    def maintenance_then_q() -> None:  # in R's error path, between x's undo and y's
        faults.stuck = False
        t = threading.Thread(target=eng.deletes.retry)  # the maintenance pass
        t.start()
        t.join(30)
        with eng.catalog.lock:
            assert not eng.pending.busy(["x"]), "the retry did not release x"
        faults.hold = "x"

        def create_q() -> object:
            with Client(d.address, transport="inline") as c2:
                return c2.park("x", [full(4096, 5)])

        q.append(Bg(create_q))
        assert faults.entered.wait(30), "Q never reached its write"

    with Client(d.address, transport="inline") as c:
        faults.sync_armed, faults.stuck_id = True, "x"
        faults.on_holds = ("y", maintenance_then_q)
        with pytest.raises(KVParkError):
            c.park("y", [full(64, 7)], refs=["x"], new_blocks={"x": [full(4096, 6)]})
        assert faults.stuck_gen is not None and q, "x's undo never failed, or the seam never ran"
        with eng.catalog.lock:
            busy = eng.pending.busy(["x"])
        dd = Bg(lambda: c.park("x", [full(4096, 4)]))  # create D
        dd.thread.join(1.0)  # on 9031bd7 D does not wait for Q
        faults.gate.set()
        got_q, got_d = q[0].result(), dd.result()
    wins = [v for v, g in (("Q", got_q), ("D", got_d)) if not isinstance(g, BaseException)]
    assert busy and len(wins) == 1, \
        f"'x' pending while Q writes: {busy}; creates that succeeded: {wins} (Q: {got_q!r}, D: {got_d!r})"
