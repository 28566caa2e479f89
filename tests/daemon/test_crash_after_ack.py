"""A drop (or an overwrite) is acknowledged only once a crash can no longer bring the
retired version back.

Each test pins the moment just after a drop's reply, while the version's disk copy is
still busy (a read lease reads it, or a background write of it is in its transaction),
and takes a crash image there: a consistent copy of what LMDB holds, which is what a
SIGKILL at that moment leaves (committed transactions outlive the process). A daemon
started on that image must not index the dropped version. The history checker found the
first one under SIGKILL in a busy run: the retired copy's manifest waited for the lease
to end before it went.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from kvpark.client import Client, NotFound, Unavailable
from kvpark.daemon.disk_evict import disk_drop
from kvpark.daemon.engine import Engine
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

from ..conftest import wait_until
from .disk_seams import GatedWrites, HeldAfterCommit, HeldBeforeAndAfter, crash_image

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def started_on(daemon: Callable[..., Daemon], image: str, **over: object) -> Daemon:
    return daemon(**{"tiers.disk.path": image, **over})


def assert_dropped(d: Daemon, seq_id: str, kept: str | None = None) -> None:
    with Client(d.address) as c:
        assert c.present([seq_id]) == [False], f"the dropped {seq_id!r} came back after a crash"
        with pytest.raises(NotFound):
            c.restore(seq_id)
        if kept is not None:
            assert int(c.restore(kept)[0][0]) == 3  # the image is a real one: the rest is there
    assert d.engine is not None
    d.engine.check_invariants()


def started(daemon: Callable[..., Daemon], **over: object) -> tuple[Daemon, Engine]:
    d = daemon(**over)
    assert d.engine is not None
    return d, d.engine


def read_all(eng: Engine, h: object) -> bytes:
    """Every byte a streamed restore's handle reads."""
    return b"".join(bytes(v) for _, views in eng.iter_chunks(h, MiB) for v in views)  # type: ignore[arg-type]


def leased_on_disk(eng: Engine, c: Client, seq_id: str, v: int) -> object:
    """Park "other" and ``seq_id`` (value ``v``), flush both, leave ``seq_id`` only on disk,
    and lease a streamed restore of it from there (read later): its handle."""
    c.park("other", [full(MiB, 3)])
    c.park(seq_id, [full(MiB, v)])
    c.flush()
    assert eng.mover.demote(seq_id, "host")
    h = eng.acquire(seq_id, stream=True)
    assert h.parts[0].tier == "disk" and h.lease is not None
    return h


@pytest.fixture
def held() -> Iterator[type[HeldBeforeAndAfter]]:
    for e in (GatedWrites.entered, GatedWrites.gate, HeldAfterCommit.after_entered, HeldAfterCommit.after_gate):
        e.clear()
    HeldBeforeAndAfter.hold = HeldBeforeAndAfter.after_hold = ""
    yield HeldBeforeAndAfter
    HeldBeforeAndAfter.hold = HeldBeforeAndAfter.after_hold = ""
    GatedWrites.gate.set()  # never leave a writer stuck past the test
    HeldAfterCommit.after_gate.set()


@pytest.mark.parametrize("action", ["drop", "overwrite"])
@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_a_retirement_acknowledged_while_a_disk_read_is_leased_leaves_nothing_a_crash_brings_back(
        daemon: Callable[..., Daemon], tmp_path: Path, write: str, action: str) -> None:
    over = {"policy.write": write, "policy.promote_on_restore": "false"}
    d, eng = started(daemon, **over)
    with Client(d.address) as c:
        h = leased_on_disk(eng, c, "s", 6)  # a restore granted from the disk copy, read later
    with Client(d.address) as c:
        # Acknowledged; the lease still reads the old records.
        if action == "drop":
            assert c.drop("s")
        else:
            c.park("s", [full(MiB, 7)], overwrite=True)
    image = crash_image(eng.disk, str(tmp_path / "crash"))
    # The lease still reads the version it leased, though its manifest went at the drop.
    assert read_all(eng, h) == b"\x06" * MiB
    eng.release(h.lease.lease_id)
    assert wait_until(lambda: eng.deletes.pending == 0)  # the records, by the next maintenance pass
    eng.check_invariants()
    d.stop(0.5)
    d2 = started_on(daemon, image, **over)
    if action == "drop":
        assert_dropped(d2, "s", kept="other")
        return
    with Client(d2.address) as c:
        # write_back: the new version was only in memory, so none; never the old one.
        want = [7] if write == "write_through" else []
        assert [int(t[0]) for t in (c.restore("s") if c.present(["s"]) == [True] else [])] == want
    assert d2.engine is not None
    d2.engine.check_invariants()


@pytest.mark.parametrize("when", ["its write committed first", "it had not yet begun its transaction"])
def test_a_drop_acknowledged_during_a_flush_of_the_id_leaves_nothing_a_crash_brings_back(
        daemon: Callable[..., Daemon], held: type[HeldBeforeAndAfter], tmp_path: Path, when: str) -> None:
    over = {"policy.flush_on_shutdown": "false"}
    d, eng = started(daemon, disk_factory=held, **over)
    with Client(d.address) as c:
        c.park("other", [full(MiB, 3)])
        assert c.flush() == 1
        c.park("race", [full(MiB, 1)])
        held.after_hold = "race"
        if when != "its write committed first":
            held.hold = "race"
        flushed: list[int] = []
        t = threading.Thread(target=lambda: flushed.append(c.flush()))
        t.start()
        if when == "its write committed first":
            assert held.after_entered.wait(30), "the flush never committed 'race'"
            assert c.drop("race")  # acknowledged, the flush's own cleanup not yet run
        else:
            assert held.entered.wait(30), "the flush never reached the disk"
            assert c.drop("race")  # acknowledged before the flush's transaction
            held.gate.set()
            assert held.after_entered.wait(30), "the flush's transaction never ended"
        image = crash_image(eng.disk, str(tmp_path / "crash"))
        held.after_gate.set()
        t.join(60)
        assert flushed == [0]
        eng.check_invariants()
    assert_dropped(started_on(daemon, image, **over), "race", kept="other")


class FailsOrHoldsUnpublish(HeldBeforeAndAfter):
    """``unpublish`` of ``fail`` fails once, as a write transaction on a failing disk does;
    ``unpublish`` of ``pause`` waits at ``paused_gate`` once (``paused`` set)."""

    fail = pause = ""
    paused = threading.Event()
    paused_gate = threading.Event()

    def unpublish(self, m: Manifest, sync: bool = False) -> None:
        cls = type(self)
        if cls.fail and m.seq_id == cls.fail:
            cls.fail = ""
            raise Unavailable(f"injected: the disk tier cannot be written (unpublish of {m.seq_id!r})")
        if cls.pause and m.seq_id == cls.pause:
            cls.pause = ""
            cls.paused.set()
            assert cls.paused_gate.wait(60), "the test never opened the gate"
        super().unpublish(m, sync=sync)


@pytest.fixture
def faulty(held: type[HeldBeforeAndAfter]) -> Iterator[type[FailsOrHoldsUnpublish]]:
    FailsOrHoldsUnpublish.paused.clear()
    FailsOrHoldsUnpublish.paused_gate.clear()
    FailsOrHoldsUnpublish.fail = FailsOrHoldsUnpublish.pause = ""
    yield FailsOrHoldsUnpublish
    FailsOrHoldsUnpublish.fail = FailsOrHoldsUnpublish.pause = FailsOrHoldsUnpublish.hold = ""
    FailsOrHoldsUnpublish.after_hold = ""
    FailsOrHoldsUnpublish.paused_gate.set()




def test_a_drop_whose_manifest_delete_fails_under_a_lease_answers_unavailable_and_the_records_go_after(
        daemon: Callable[..., Daemon], faulty: type[FailsOrHoldsUnpublish], tmp_path: Path) -> None:
    over = {"policy.promote_on_restore": "false"}
    d, eng = started(daemon, disk_factory=faulty, **over)
    with Client(d.address) as c:
        h = leased_on_disk(eng, c, "s", 6)
        faulty.fail = "s"
        with pytest.raises(Unavailable):
            c.drop("s")  # not acknowledged: its manifest is still in LMDB
        assert faulty.fail == ""
        assert read_all(eng, h) == b"\x06" * MiB  # the lease still reads what it leased
        eng.release(h.lease.lease_id)
        assert wait_until(lambda: eng.deletes.pending == 0)  # manifest and records, after the lease
        eng.check_invariants()
        assert c.present(["s"]) == [False]
    image = crash_image(eng.disk, str(tmp_path / "crash"))
    assert_dropped(started_on(daemon, image, **over), "s", kept="other")


def test_a_drop_during_a_flush_whose_manifest_delete_fails_answers_unavailable(
        daemon: Callable[..., Daemon], faulty: type[FailsOrHoldsUnpublish], tmp_path: Path) -> None:
    over = {"policy.flush_on_shutdown": "false"}
    d, eng = started(daemon, disk_factory=faulty, **over)
    with Client(d.address) as c:
        c.park("other", [full(MiB, 3)])
        assert c.flush() == 1
        c.park("race", [full(MiB, 1)])
        faulty.after_hold = faulty.fail = "race"
        t = threading.Thread(target=c.flush)
        t.start()
        assert faulty.after_entered.wait(30), "the flush never committed 'race'"
        with pytest.raises(Unavailable):
            c.drop("race")  # the flush published it and its manifest could not go
        faulty.after_gate.set()
        t.join(60)
        assert wait_until(lambda: eng.deletes.pending == 0)
        eng.check_invariants()
    image = crash_image(eng.disk, str(tmp_path / "crash"))
    assert_dropped(started_on(daemon, image, **over), "race", kept="other")


def test_a_lease_ending_while_its_drop_deletes_the_manifest_leaves_nothing_kept(
        daemon: Callable[..., Daemon], faulty: type[FailsOrHoldsUnpublish], tmp_path: Path) -> None:
    """The lease ends, and the maintenance pass deletes the retired copy, while the drop
    is between queueing that delete and deleting the manifest: nothing stays kept from the
    orphan sweep (``check_invariants``), and nothing of it stays on disk."""
    over = {"policy.promote_on_restore": "false"}
    d, eng = started(daemon, disk_factory=faulty, **over)
    with Client(d.address) as c:
        h = leased_on_disk(eng, c, "s", 6)
    faulty.pause = "s"
    dropped: list[bool] = []
    t = threading.Thread(target=lambda: dropped.append(eng.drop("s")))
    t.start()
    assert faulty.paused.wait(30)
    eng.release(h.lease.lease_id)
    eng.mover.retry_deletes()  # the maintenance pass: the lease is over, the records go
    faulty.paused_gate.set()
    t.join(30)
    assert dropped == [True]
    assert wait_until(lambda: eng.deletes.pending == 0)
    eng.check_invariants()
    image = crash_image(eng.disk, str(tmp_path / "crash"))
    assert_dropped(started_on(daemon, image, **over), "s", kept="other")


class HeldDelete(DiskStore):
    """``delete`` of ``hold`` waits at ``gate`` once (``entered`` set), before its transaction."""

    hold = ""
    entered = threading.Event()
    gate = threading.Event()

    def delete(self, m: Manifest, sync: bool = False) -> None:
        cls = type(self)
        if cls.hold and m.seq_id == cls.hold:
            cls.hold = ""
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
        super().delete(m, sync=sync)


def test_a_disk_eviction_of_a_sequence_still_in_memory_deletes_its_records_and_a_flush_waits_for_that(
        daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """Evicting the disk copy of a sequence that keeps its memory copy frees the disk at
    once (its records went only at its drop before). A flush of it meanwhile writes the
    same record keys, so it leaves the sequence to a later pass instead of racing the
    delete; that pass writes it whole."""
    HeldDelete.entered.clear()
    HeldDelete.gate.clear()
    over = {"policy.flush_on_shutdown": "false"}
    d, eng = started(daemon, disk_factory=HeldDelete, **over)
    try:
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            c.park("other", [full(MiB, 3)])
            assert c.flush() == 2
            HeldDelete.hold = "x"
            evicted: list[bool] = []
            t = threading.Thread(target=lambda: evicted.append(disk_drop(eng.mover, "x")))
            t.start()
            assert HeldDelete.entered.wait(30), "the eviction never deleted 'x'"
            assert c.flush() == 0  # "x" is being deleted: left to a later pass
            HeldDelete.gate.set()
            t.join(30)
            assert evicted == [True] and c.info("x").tier == "host"
            scan = eng.disk.scan()
            assert "x" not in scan.manifests and not [k for k in scan.records if k[0] == "x"]
            eng.check_invariants()
            assert c.flush() == 1  # now it is written again, whole
            eng.check_invariants()
        d.stop(0.5)
        d2 = daemon(**over)
        with Client(d2.address) as c:
            assert c.info("x").tier == "disk" and int(c.restore("x")[0][0]) == 5
    finally:
        HeldDelete.hold = ""
        HeldDelete.gate.set()
