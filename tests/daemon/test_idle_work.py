"""Work held for a lull in reads and parks (``daemon/idle_work.py``): the promotions a
disk grant asks for wait until the client's reads pause, or until they have waited
``max_wait_s``; they are never lost silently while queued, except by ``close`` or the
queue bound (a promotion not made leaves the sequence on disk, where it is read)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.idle_work import IdleWork, due

from ..client.test_disk_grants import Reads, blob, on_disk_only
from ..conftest import wait_until

MiB = 1 << 20


def test_due_is_the_earlier_of_a_quiet_moment_and_the_longest_wait() -> None:
    # Busy a moment ago: the quiet moment comes first.
    assert due(last_busy=9.99, oldest=9.5, quiet_s=0.05, max_wait_s=1.0) == 9.99 + 0.05
    # Busy all along: the longest wait decides.
    assert due(last_busy=10.0, oldest=8.9, quiet_s=0.05, max_wait_s=1.0) == 8.9 + 1.0
    # Never busy: at once (a time long past).
    assert due(last_busy=0.0, oldest=10.0, quiet_s=0.05, max_wait_s=1.0) == 0.05


def test_work_runs_once_quiet() -> None:
    w = IdleWork(quiet_s=0.01, max_wait_s=30.0)
    ran = threading.Event()
    try:
        w.add(ran.set)
        assert ran.wait(10.0)
        assert w.pending == 0
    finally:
        w.close()


def test_work_waits_while_reads_start_and_runs_at_its_longest_wait() -> None:
    held = IdleWork(quiet_s=30.0, max_wait_s=60.0)
    waits = IdleWork(quiet_s=30.0, max_wait_s=0.2)
    ran_held, ran_waits = threading.Event(), threading.Event()
    try:
        held.busy()
        held.add(ran_held.set)
        waits.busy()
        waits.add(ran_waits.set)
        # A read started just now: nothing runs before the quiet moment, however the
        # thread is scheduled (it can be late, never early) ...
        assert not ran_held.wait(0.3)
        assert held.pending == 1
        # ... except what has waited its longest.
        assert ran_waits.wait(10.0)
    finally:
        held.close()
        waits.close()


def test_close_drops_what_is_queued_and_refuses_more() -> None:
    w = IdleWork(quiet_s=30.0, max_wait_s=60.0)
    ran = threading.Event()
    w.busy()
    w.add(ran.set)
    w.close()
    assert w.pending == 0
    w.add(ran.set)
    assert w.pending == 0
    assert not ran.wait(0.2)


def test_close_drops_the_rest_of_what_the_thread_has_taken() -> None:
    # Found by attack: the thread took the whole queue at once, and a close while it ran
    # did not stop the rest: items ran after close() had returned, when the engine had
    # gone on to close its tiers.
    w = IdleWork(quiet_s=0.0, max_wait_s=60.0)
    first_running, let_go = threading.Event(), threading.Event()
    after: list[int] = []

    def first() -> None:
        first_running.set()
        let_go.wait(10.0)

    w.add(first)
    for i in range(5):
        w.add(lambda i=i: after.append(i))
    assert first_running.wait(10.0)
    closer = threading.Thread(target=w.close)
    closer.start()
    assert wait_until(lambda: w.closed)
    let_go.set()  # the item running returns; close() returns with it
    closer.join(10.0)
    assert not closer.is_alive()
    thread = w._thread
    assert thread is not None
    thread.join(10.0)  # it ends after the item running: nothing taken runs after that
    assert not thread.is_alive()
    assert after == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_died_is_started_again() -> None:
    w = IdleWork(quiet_s=0.0, max_wait_s=60.0)
    ran = threading.Event()
    try:
        def dies() -> None:
            raise SystemExit  # not an Exception: it ends the thread

        w.add(dies)
        assert wait_until(lambda: w._thread is not None and not w._thread.is_alive())
        w.add(ran.set)
        assert ran.wait(10.0)
    finally:
        w.close()


def test_past_the_bound_the_oldest_goes_counted_by_weight() -> None:
    w = IdleWork(quiet_s=30.0, max_wait_s=60.0, max_queued=2)
    done: list[str] = []
    try:
        w.busy()
        w.add(lambda: done.append("first"))
        w.add(lambda: done.append("second"))
        w.add(lambda: done.append("third"))
        assert w.pending == 2  # the first went
        w.add(lambda: done.append("heavy"), weight=2)  # two ids' worth: both others go
        assert w.pending == 1
        w.quiet_s = 0.0
        w._last_busy = 0.0
        w.add(lambda: done.append("light"))  # over the bound again: "heavy" goes; wakes the thread
        assert wait_until(lambda: done == ["light"])
    finally:
        w.close()


def test_one_failure_stops_nothing() -> None:
    w = IdleWork(quiet_s=0.0, max_wait_s=60.0)
    ran = threading.Event()
    try:
        def fails() -> None:
            raise RuntimeError("one promotion failed")

        w.add(fails)
        w.add(ran.set)
        assert ran.wait(10.0)
    finally:
        w.close()


def test_a_grant_promotes_once_the_reads_pause(daemon, monkeypatch) -> None:
    t = blob(2 * MiB, 7)
    d = on_disk_only(daemon, {"a": t, "b": t})
    idle = d.engine.mover.idle
    idle.quiet_s = 30.0  # the reads below never pause long enough, as in a burst
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        assert torch.equal(c.restore("a")[0], t)
        assert reads.grants == 1
        assert idle.pending == 1
        # Held: the promotion did not compete with the reads (a deadline, not a wait it can pass).
        assert not wait_until(lambda: c.info("a").tier != "disk", timeout=0.3)
        assert torch.equal(c.restore("b")[0], t)  # another read: still held, both queued
        assert idle.pending == 2 and c.info("a").tier == "disk"
        idle.quiet_s = 0.0
        idle._last_busy = 0.0
        idle.add(lambda: None)  # wakes it: the reads have paused
        assert wait_until(lambda: c.info("a").tier == "host" and c.info("b").tier == "host")
        assert torch.equal(c.restore("a")[0], t)  # from the arena now: no grant
        assert reads.grants == 2
    d.engine.check_invariants()


def test_a_stop_with_promotions_held_loses_nothing(daemon, monkeypatch) -> None:
    t = blob(MiB, 8)
    cfg: dict[str, str] = {}
    d = on_disk_only(daemon, {"a": t}, **cfg)
    d.engine.mover.idle.quiet_s = 30.0
    with Client(d.address, transport="shm") as c:
        assert torch.equal(c.restore("a")[0], t)
    assert d.engine.mover.idle.pending == 1
    d.stop(0.5)  # drops the held promotion; returns promptly
    d2 = daemon(**cfg)
    with Client(d2.address, transport="shm") as c:
        assert c.info("a").tier == "disk"
        assert torch.equal(c.restore("a")[0], t)
    d2.engine.check_invariants()
