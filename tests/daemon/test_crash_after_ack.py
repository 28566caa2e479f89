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

from kvpark.client import Client, NotFound
from kvpark.daemon.server import Daemon

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
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("s", [full(MiB, 6)])
        c.park("other", [full(MiB, 3)])
        c.flush()  # both on disk under either write mode
        assert eng.mover.demote("s", "host")  # its only copy on disk
    h = eng.acquire("s", stream=True)  # a restore granted from the disk copy, read later
    assert h.parts[0].tier == "disk" and h.lease is not None
    with Client(d.address) as c:
        # Acknowledged; the lease still reads the old records.
        if action == "drop":
            assert c.drop("s")
        else:
            c.park("s", [full(MiB, 7)], overwrite=True)
    image = crash_image(eng.disk, str(tmp_path / "crash"))
    # The lease still reads the version it leased, though its manifest went at the drop.
    got = b"".join(bytes(v) for _, views in eng.iter_chunks(h, MiB) for v in views)
    assert got == b"\x06" * MiB
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
    d = daemon(disk_factory=held, **over)
    eng = d.engine
    assert eng is not None
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
