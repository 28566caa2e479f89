"""Windowed overwrites of one id under write_back, refused at their publish (the id is a
shared block in use). They once ran their disk commits side by side (an overwrite waited
for no pending commit under write_back): the second remembered the *first one's*
manifest as what it replaced, the first undo let go of that generation, and the second
undo deleted the manifest of the acknowledged, flushed version that stays indexed. A
windowed park now waits for the pending commits of its id in every write mode (its disk
copy is written at its commit), so each refusal undoes exactly its own write. Found by a
fresh-eyes attack."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

from .disk_seams import waiting_in

SMALL = {"tiers.host.capacity": "4MiB"}
BIG = 5 * (1 << 20) + 1


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def _second_arrives(second: threading.Event, open_first: threading.Event) -> None:
    """Wait until the second overwrite reaches its disk commit. If it waits for the first
    one's pending commit instead (the rule now), let the first one go on first."""
    deadline = time.monotonic() + 60
    while not second.is_set() and not waiting_in("wait", "commit.py") and time.monotonic() < deadline:
        time.sleep(0.01)
    if not second.is_set():
        open_first.set()  # the first goes on, is refused and undone; then the second comes
    assert second.wait(60), "W2 never committed its manifest"


class Ordered(DiskStore):
    """While ``armed``: the first ``stage_commit`` of "B" waits at ``gate1`` after its
    transaction (``in1`` set); the second waits at ``gate2`` after its own (``in2``).
    ``reverted`` collects the generations ``revert`` undid."""

    armed = False
    calls = 0
    in1 = threading.Event()
    gate1 = threading.Event()
    in2 = threading.Event()
    gate2 = threading.Event()
    lock = threading.Lock()
    reverted: list[int] = []

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        cls = Ordered
        won = super().stage_commit(m, replace, sync=sync)
        if cls.armed and m.seq_id == "B":
            with cls.lock:
                cls.calls += 1
                n = cls.calls
            if n == 1:
                cls.in1.set()
                assert cls.gate1.wait(60), "the test never opened gate 1"
            elif n == 2:
                cls.in2.set()
                assert cls.gate2.wait(60), "the test never opened gate 2"
        return won

    def revert(self, m: Manifest, previous: Manifest | None, sync: bool = False, pinned=None) -> None:  # type: ignore[no-untyped-def]
        super().revert(m, previous, sync=sync, pinned=pinned)
        if m.seq_id == "B":
            Ordered.reverted.append(m.gen)


@pytest.fixture
def ordered():
    for e in (Ordered.in1, Ordered.gate1, Ordered.in2, Ordered.gate2):
        e.clear()
    Ordered.armed, Ordered.calls, Ordered.reverted = False, 0, []
    yield Ordered
    Ordered.armed = False
    Ordered.gate1.set()
    Ordered.gate2.set()


def test_two_refused_windowed_overwrites_keep_the_shared_blocks_manifest(
        daemon: Callable[..., Daemon], ordered: type[Ordered], tmp_path: Path) -> None:
    """write_back (the default). Shared block "B" (used by "p") is flushed. W1 and W2,
    windowed overwrites of B, both commit their manifests (W1's, then W2's over it: W2
    remembers W1's as what it replaced). W1's publish is refused (B in use) and undone:
    its blocks go, the manifest (W2's) stays, W1's generation is let go. W2's publish is
    refused; its undo would put back W1's manifest, finds that generation gone, and
    deletes the manifest: B (indexed on disk, acknowledged) has none in LMDB."""
    d = daemon(disk_factory=ordered, **SMALL)
    eng = d.engine
    assert eng is not None
    errors: dict[str, BaseException | None] = {}

    def overwrite(tag: str, v: int) -> None:
        try:
            with Client(d.address, transport="inline") as cw:
                cw.park("B", [full(BIG, v)], overwrite=True)
            errors[tag] = None
        except BaseException as e:  # noqa: BLE001
            errors[tag] = e

    with Client(d.address, transport="inline") as c:
        c.park("p", [full(4096, 7)], refs=["B"], new_blocks={"B": [full(4096, 3)]})
        c.flush()
        ordered.armed = True
        t1 = threading.Thread(target=overwrite, args=("w1", 8))
        t1.start()
        assert ordered.in1.wait(60), "W1 never committed its manifest"
        t2 = threading.Thread(target=overwrite, args=("w2", 9))
        t2.start()
        _second_arrives(ordered.in2, ordered.gate1)
        ordered.gate1.set()  # W1 publishes (refused) and is undone first
        t1.join(60)
        ordered.gate2.set()  # then W2
        t2.join(60)
        assert isinstance(errors.get("w1"), KVParkError) and isinstance(errors.get("w2"), KVParkError), errors
        scan = eng.disk.scan()
        try:
            eng.check_invariants()
            invariant = ""
        except AssertionError as e:
            invariant = str(e)
        # Memory pressure: B's memory copy goes (its disk copy is the index's).
        demoted = eng.mover.demote("B", "host")
        try:
            live = [int(t[0]) for t in c.restore("p")]
        except Exception as e:  # noqa: BLE001
            live = repr(e)
        path = eng.disk.path
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": path, **SMALL})
    with Client(d2.address, transport="inline") as c2:
        present = c2.present(["p", "B"])
    assert not invariant and live == [3, 7] and present == [True, True], (
        f"reverted {ordered.reverted}; manifests in LMDB {sorted(scan.manifests)}; invariants: {invariant!r}; "
        f"restore of p after demote(B)={demoted}: {live}; after a clean restart present(p, B)={present}")


class PreGated(Ordered):
    """While ``armed``: the first ``stage_commit`` of "B" waits at ``gate1`` *before* its
    transaction (``in1`` set); the second waits at ``gate2`` after its own (``in2``)."""

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        cls = Ordered
        n = 0
        if cls.armed and m.seq_id == "B":
            with cls.lock:
                cls.calls += 1
                n = cls.calls
        if n == 1:
            cls.in1.set()
            assert cls.gate1.wait(60), "the test never opened gate 1"
        won = DiskStore.stage_commit(self, m, replace, sync=sync)
        if n == 2:
            cls.in2.set()
            assert cls.gate2.wait(60), "the test never opened gate 2"
        return won


def test_a_windowed_overwrite_superseded_by_one_that_is_then_refused_is_not_acknowledged(
        daemon: Callable[..., Daemon], ordered: type[Ordered], tmp_path: Path) -> None:
    """write_back (the default). Shared block "B" (used by "p"). W1 then W2, windowed
    overwrites of B, take their generations in that order; W2's manifest reaches the disk
    first. W1's ``stage_commit`` loses to it (a newer generation on disk) and W1 is
    answered OK as superseded. W2 is then refused at its publish (B in use) and undone: B
    is still the old version. The client was told its overwrite W1 took effect, yet
    B restores the old bytes (and W1 should have been refused: B is in use)."""
    d = daemon(disk_factory=PreGated, **SMALL)
    eng = d.engine
    assert eng is not None
    errors: dict[str, BaseException | None] = {}

    def overwrite(tag: str, v: int) -> None:
        try:
            with Client(d.address, transport="inline") as cw:
                cw.park("B", [full(BIG, v)], overwrite=True)
            errors[tag] = None
        except BaseException as e:  # noqa: BLE001
            errors[tag] = e

    with Client(d.address, transport="inline") as c:
        c.park("p", [full(4096, 7)], refs=["B"], new_blocks={"B": [full(4096, 3)]})
        c.flush()
        ordered.armed = True
        t1 = threading.Thread(target=overwrite, args=("w1", 8))
        t1.start()
        assert ordered.in1.wait(60), "W1 never reached its disk commit"
        t2 = threading.Thread(target=overwrite, args=("w2", 9))
        t2.start()
        _second_arrives(ordered.in2, ordered.gate1)
        ordered.gate1.set()  # W1 commits after W2's manifest (if W2 came first): it loses on disk
        t1.join(60)
        ordered.gate2.set()  # W2 publishes: refused, undone
        t2.join(60)
        info = c.info("B")
        got = [int(t[0]) for t in c.restore("p")]
    assert errors.get("w1") is not None or got[0] == 8, (
        f"W1 answered {errors.get('w1')!r} (acknowledged), W2 answered {errors.get('w2')!r}; "
        f"B is now {info.nbytes} bytes and p restores {got}")


class FailingUndo(DiskStore):
    """While ``armed``: every transaction deleting "B"'s block records fails (EIO)."""

    armed = False

    def _delete_blocks(self, txn, m: Manifest) -> None:  # type: ignore[no-untyped-def]
        if FailingUndo.armed and m.seq_id == "B":
            import lmdb
            raise lmdb.Error("injected: EIO")
        super()._delete_blocks(txn, m)


def test_a_refused_windowed_overwrite_over_a_queued_undo_keeps_the_blocks_manifest(
        daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """write_back (the default). Shared block "B" (used by "p") is flushed. W0, a windowed
    overwrite of B, is refused at its publish (B in use); its undo fails (EIO) and is
    queued, W0's manifest still current. The disk works again. W1, another windowed
    overwrite of B (an overwrite waits for no pending hold under write_back), commits
    over W0's manifest and remembers *it* as what it replaced; W1 is refused and undone:
    W0's generation is no longer held, so the manifest is deleted. The retry of W0's undo
    then finds no manifest of W0's to replace and puts nothing back. Every undo went
    through, and B (acknowledged, indexed on disk) has no manifest in LMDB."""
    FailingUndo.armed = False
    try:
        d = daemon(disk_factory=FailingUndo, **SMALL)
        eng = d.engine
        assert eng is not None
        with Client(d.address, transport="inline") as c:
            c.park("p", [full(4096, 7)], refs=["B"], new_blocks={"B": [full(4096, 3)]})
            c.flush()
            FailingUndo.armed = True
            with pytest.raises(KVParkError):
                c.park("B", [full(BIG, 8)], overwrite=True)  # W0: refused, its undo queued
            assert eng.deletes.pending >= 1
            FailingUndo.armed = False
            with pytest.raises(KVParkError):
                c.park("B", [full(BIG, 9)], overwrite=True)  # W1: refused, undone at once
            eng.deletes.retry()  # W0's undo goes through now
            assert eng.deletes.pending == 0
            scan = eng.disk.scan()
            try:
                eng.check_invariants()
                invariant = ""
            except AssertionError as e:
                invariant = str(e)
            path = eng.disk.path
        d.stop(0.5)
        d2 = daemon(**{"tiers.disk.path": path, **SMALL})
        with Client(d2.address, transport="inline") as c2:
            present = c2.present(["p", "B"])
        assert not invariant and present == [True, True], (
            f"manifests in LMDB {sorted(scan.manifests)}; invariants: {invariant!r}; "
            f"after a clean restart present(p, B)={present}")
    finally:
        FailingUndo.armed = False
