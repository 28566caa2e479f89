"""A prefetch whose promotion has ended by the time its caller registers the bookkeeping
callback.

``Future.add_done_callback`` runs the callback at once, in the caller's thread, when the
future is already done, and that callback takes the index lock. Registered under the
index lock, a future that was done already (cancelled by a stop's pool shutdown, or a
promotion that ended before the caller's next line) deadlocked the caller, and with it
every thread that then wanted the index lock (the full suite hung so in a stop, with a
disk grant's background promotion under way).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest
import torch

from kvpark.client import Client
from kvpark.proto.errors import KVParkError


def on_disk_only(daemon: Any, n: int) -> Any:
    d = daemon()
    with Client(d.address, transport="inline") as c:
        for i in range(n):
            c.park(f"q{i}", [torch.full((4096,), i, dtype=torch.uint8)])
        c.flush()
    d.stop(0.5)
    return daemon()


def test_a_prefetch_whose_promotion_has_already_ended_does_not_deadlock(daemon, monkeypatch) -> None:
    d = on_disk_only(daemon, 2)
    eng = d.engine
    pool = eng.mover.prefetches._pool

    def ended_at_once(fn: Any, *args: Any) -> concurrent.futures.Future:
        # What the caller holds when the pool's thread ran the promotion (here: nothing
        # to do) before the caller's next line, or a stop cancelled it: a done future.
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(pool, "submit", ended_at_once)
    finished = threading.Event()

    def prefetch() -> None:
        eng.prefetch("q0", "host")
        finished.set()

    threading.Thread(target=prefetch, daemon=True).start()
    assert finished.wait(30), "the prefetch deadlocked on the index lock"
    assert eng.catalog.lock.acquire(timeout=30)
    eng.catalog.lock.release()


def test_a_prefetch_after_the_stop_began_is_typed(daemon) -> None:
    d = on_disk_only(daemon, 1)
    eng = d.engine
    eng.mover.prefetches.close()  # what a stop does first
    with pytest.raises(KVParkError):
        eng.prefetch("q0", "host")
