"""An id leaves the index before the disk delete of its retired version lands (the delete
runs after the index lock). Absence is answered only once it is durable: another
client asking meanwhile (a drop answering False, ``present`` False, a restore
NOT_FOUND) waits for that delete, or is answered UNAVAILABLE while a failed one is
still queued, so a SIGKILL right after its answer never brings the id back
(docs/protocol.md, "Absence is durable when it is answered"). Found by a fresh-eyes
attack; these failed before ``Deletes.settle``.

Each test takes the crash image in the thread that got the answer, right after it:
what a SIGKILL at that moment would leave.
"""

from __future__ import annotations

import threading
from typing import Callable

import pytest

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import Manifest

from .disk_seams import crash_image, waiting_in
from .test_evict_retry_race import Seam, full

MiB = 1 << 20


def answer_then_crash(eng, ask: Callable[[], object], dst: str) -> tuple[threading.Thread, dict]:
    """Run ``ask`` in a thread; the moment it answers, take the crash image (``dst``)."""
    out: dict = {}

    def run() -> None:
        try:
            out["answer"] = ask()
        except BaseException as e:  # noqa: BLE001
            out["answer"] = e
        out["image"] = crash_image(eng.disk, dst)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def settle_or_answer(t: threading.Thread) -> None:
    """Until ``t`` has answered or waits in ``Deletes.settle`` (the fix; before it, the
    answer came at once)."""
    import time

    deadline = time.monotonic() + 30
    while t.is_alive() and not waiting_in("settle", "deletes.py") and time.monotonic() < deadline:
        time.sleep(0.01)


class HeldUnpublish(Seam):
    """``Seam`` (deletes of x's block records fail while ``fail``), and the next
    ``unpublish`` of "x" waits at ``u_gate`` (``u_entered`` set) once ``u_hold``."""

    u_hold = False
    u_entered = threading.Event()
    u_gate = threading.Event()

    def unpublish(self, m: Manifest, sync: bool = False) -> None:
        cls = HeldUnpublish
        if cls.u_hold and m.seq_id == "x":
            cls.u_hold = False
            cls.u_entered.set()
            assert cls.u_gate.wait(60), "the test never opened the unpublish gate"
        super().unpublish(m, sync=sync)


@pytest.fixture
def held():
    for e in (Seam.del_entered, Seam.del_gate, Seam.w_entered, Seam.w_gate,
              HeldUnpublish.u_entered, HeldUnpublish.u_gate):
        e.clear()
    Seam.fail = Seam.del_hold = Seam.w_hold = False
    HeldUnpublish.u_hold = False
    yield HeldUnpublish
    Seam.fail = Seam.del_hold = Seam.w_hold = False
    HeldUnpublish.u_hold = False
    for e in (Seam.del_gate, Seam.w_gate, HeldUnpublish.u_gate):
        e.set()


def _over(redis_url: str) -> dict:
    from .test_remote_tier import _new_ns, _remote

    return {"policy.promote_on_restore": "false", "policy.flush_on_shutdown": "false",
            "policy.write": "write_through", **_remote(redis_url, _new_ns(), write="on_evict")}


def test_a_drop_answered_while_remote_guard_retires_x_never_sees_x_come_back(
        daemon: Callable[..., Daemon], held: type[HeldUnpublish], redis_server, tmp_path) -> None:
    """x's disk copy was evicted to Redis and the disk delete failed (its manifest stays
    in LMDB, queued). Redis lost x. A restore of x fetches it, meets NotFound, and
    ``remote_guard`` retires x and then deletes that manifest; before the delete lands,
    another client drops x: the drop finds x gone and answers (nothing to drop; x is not
    present). SIGKILL right then: the restart indexes x again from the old manifest."""
    from kvpark.daemon.disk_evict import disk_to_remote

    d = daemon(disk_factory=held, **_over(redis_server.url))
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c, Client(d.address) as c2:
        c.park("x", [full(MiB, 5)])
        c.flush()
        assert eng.mover.demote("x", "host")  # its only copy on disk
        Seam.fail = True  # deletes of x's block records fail from now on
        moved = disk_to_remote(eng.mover, "x")  # copied to Redis; the disk delete failed: queued
        assert eng.deletes.pending >= 1 and c.info("x").tier == "remote", (moved, c.info("x"))
        seq = eng.catalog.find("x")
        assert seq is not None and eng.remote is not None
        eng.remote.store.delete(seq.manifest)  # Redis lost it
        held.u_hold = True
        errs: list[BaseException] = []

        def restore() -> None:
            try:
                c.restore("x", timeout=30)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        t = threading.Thread(target=restore)
        t.start()
        assert held.u_entered.wait(30), "the restore never reached remote_guard's delete"
        # x is out of the index now; its old manifest is still in LMDB.
        b, out = answer_then_crash(eng, lambda: (c2.drop("x", timeout=30), c2.present(["x"], timeout=30)),
                                   str(tmp_path / "crash"))
        settle_or_answer(b)
        held.u_gate.set()
        b.join(60)
        t.join(30)
    Seam.fail = False
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": out["image"], "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c3:
        after = c3.present(["x"])
    assert out["answer"] == (False, [False]), out["answer"]
    assert after == [False], (
        f"restore(x) raised {errs!r}; (drop(x), present(x)) answered {out['answer']} while remote_guard was "
        f"retiring x; after a SIGKILL right then present(x)={after}: the old manifest brought x back")


class FailingUnpublish(Seam):
    """``Seam``, and every ``unpublish`` of "x" fails (EIO) while ``u_fail``."""

    u_fail = False

    def unpublish(self, m: Manifest, sync: bool = False) -> None:
        if FailingUnpublish.u_fail and m.seq_id == "x":
            import lmdb

            raise self._write_error(lmdb.Error("injected: EIO"))
        super().unpublish(m, sync=sync)


def test_after_remote_guard_answers_unavailable_no_call_says_not_found_before_the_retry(
        daemon: Callable[..., Daemon], held: type[HeldUnpublish], redis_server, tmp_path) -> None:
    """As above, but remote_guard's delete of the old manifest fails (the disk errs for a
    moment): the restore that met it answers UNAVAILABLE, as 173906d intends; x is out of
    the index already, so the next restore answers NOT_FOUND and a drop answers "not
    there", with no wait and the manifest still in LMDB. A crash brings x back."""
    from kvpark.daemon.disk_evict import disk_to_remote
    from kvpark.proto.errors import NotFound, Unavailable

    FailingUnpublish.u_fail = False
    d = daemon(disk_factory=FailingUnpublish, **_over(redis_server.url))
    eng = d.engine
    assert eng is not None
    try:
        with Client(d.address) as c:
            c.park("x", [full(MiB, 5)])
            c.flush()
            assert eng.mover.demote("x", "host")
            Seam.fail = True
            disk_to_remote(eng.mover, "x")
            assert eng.deletes.pending >= 1 and c.info("x").tier == "remote"
            seq = eng.catalog.find("x")
            assert seq is not None and eng.remote is not None
            eng.remote.store.delete(seq.manifest)
            FailingUnpublish.u_fail = True
            with pytest.raises(Unavailable):
                c.restore("x", timeout=20)  # remote_guard's delete failed: UNAVAILABLE
            # x is out of the index, its manifest still in LMDB: no call may say it is gone.
            with pytest.raises(Unavailable):
                c.restore("x", timeout=20)
            with pytest.raises(Unavailable):
                c.drop("x", timeout=20)
            with pytest.raises(Unavailable):
                c.present(["x"], timeout=20)
            with pytest.raises(Unavailable):
                c.info("x", timeout=20)
            FailingUnpublish.u_fail = False  # the disk is back: absence is answered, durably
            assert c.present(["x"], timeout=20) == [False]
            image = crash_image(eng.disk, str(tmp_path / "crash"))
    finally:
        FailingUnpublish.u_fail = False
        Seam.fail = False
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c3:
        after = c3.present(["x"])
    assert after == [False], f"present(x) answered [False]; after a crash present(x)={after}"


def test_a_second_drop_answered_during_the_first_drops_delete_never_sees_x_come_back(
        daemon: Callable[..., Daemon], held: type[HeldUnpublish], tmp_path) -> None:
    """No Redis: drop A retires x and is held in its disk delete; drop B finds nothing and
    answers; SIGKILL then. Same window as remote_guard's (pre-existing for drops)."""
    d = daemon(disk_factory=held, **{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c, Client(d.address) as c2:
        c.park("x", [full(MiB, 5)])
        Seam.del_hold = True
        t = threading.Thread(target=lambda: c.drop("x", timeout=30))
        t.start()
        assert Seam.del_entered.wait(30)
        b, out = answer_then_crash(eng, lambda: c2.drop("x", timeout=30), str(tmp_path / "crash"))
        settle_or_answer(b)
        Seam.del_gate.set()
        b.join(60)
        t.join(30)
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": out["image"], "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c3:
        after = c3.present(["x"])
    assert out["answer"] is False, out["answer"]
    assert after == [False], f"second drop answered {out['answer']}; after a crash present(x)={after}"


def test_a_stop_ends_an_answer_of_absence_waiting_for_a_delete(
        daemon: Callable[..., Daemon], held: type[HeldUnpublish], monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop A is held in its disk delete; drop B waits in ``settle`` for it. A stop ends
    B's wait at once (UNAVAILABLE), as it ends waits on pending ids: the stop does not
    sit out its handler wait (``HANDLER_WAIT_S``) for a wait only a delete ends."""
    import time

    from kvpark.daemon import deletes as deletes_mod
    from kvpark.daemon import server as server_mod

    monkeypatch.setattr(deletes_mod, "SETTLE_WAIT_S", 600.0)  # no wait ends by its own deadline here
    monkeypatch.setattr(server_mod, "HANDLER_WAIT_S", 300.0)
    d = daemon(disk_factory=held, **{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
    Seam.del_hold = True
    out: dict = {}

    def drop(key: str) -> None:
        try:
            with Client(d.address) as cc:
                out[key] = cc.drop("x", timeout=600)
        except BaseException as e:  # noqa: BLE001 (the stop cancels the call)
            out[key] = e

    a = threading.Thread(target=drop, args=("a",), daemon=True)
    a.start()
    assert Seam.del_entered.wait(30)
    b = threading.Thread(target=drop, args=("b",), daemon=True)
    b.start()
    deadline = time.monotonic() + 30
    while not waiting_in("settle", "deletes.py") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waiting_in("settle", "deletes.py"), f"drop B never waited for drop A's delete: {out}"
    stopper = threading.Thread(target=d.stop, args=(0.5,), daemon=True)
    stopper.start()
    # The stop joins handlers for HANDLER_WAIT_S; B's handler must leave before, at once.
    deadline = time.monotonic() + 30
    while waiting_in("settle", "deletes.py") and time.monotonic() < deadline:
        time.sleep(0.05)
    b_stuck = waiting_in("settle", "deletes.py")  # B's handler, whatever its client saw
    Seam.del_gate.set()  # let drop A's delete land and the test end
    stopper.join(120)
    a.join(60)
    b.join(60)
    assert not b_stuck, "drop B still waited in settle 30 s into the stop"


@pytest.mark.parametrize("retire", ["drop", "overwrite_orphans_x"])
def test_absence_waits_from_the_moment_the_version_leaves_the_index(
        daemon: Callable[..., Daemon], held: type[HeldUnpublish], monkeypatch: pytest.MonkeyPatch,
        tmp_path, retire: str) -> None:
    """The retiring call is paused after the index lock, before its delete of x begins
    (a thread descheduled there). A ``present`` of x meanwhile must wait: the delete is
    claimed in the step that unindexed x (``Deletes.claim``), not only once it starts.
    ``overwrite_orphans_x``: x is a shared block that an overwrite of the composite using
    it leaves unreferenced (retired with the commit)."""
    from kvpark.daemon.deletes import Deletes

    gate, entered = threading.Event(), threading.Event()
    original = Deletes.delete

    def paused(self: Deletes, seq) -> None:  # widens the window the claim covers; changes nothing else
        if seq.seq_id == "x" and not gate.is_set():
            entered.set()
            assert gate.wait(60)
        original(self, seq)

    monkeypatch.setattr(Deletes, "delete", paused)
    d = daemon(disk_factory=held, **{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c, Client(d.address) as c2:
        if retire == "drop":
            c.park("x", [full(MiB, 5)])
            t = threading.Thread(target=lambda: c.drop("x", timeout=30))
        else:
            c.park("c", [full(MiB, 1)], refs=["x"], new_blocks={"x": [full(MiB, 5)]})
            t = threading.Thread(target=lambda: c.park("c", [full(MiB, 2)], overwrite=True, timeout=30))
        t.start()
        try:
            assert entered.wait(30), "the retiring call never reached its delete of x"
            b, out = answer_then_crash(eng, lambda: c2.present(["x"], timeout=30), str(tmp_path / "crash"))
            settle_or_answer(b)
        finally:
            gate.set()
        b.join(60)
        t.join(30)
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": out["image"], "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c3:
        after = c3.present(["x"])
    assert out["answer"] == [False], out["answer"]
    assert after == [False], f"present(x) answered {out['answer']}; after a crash present(x)={after}"
