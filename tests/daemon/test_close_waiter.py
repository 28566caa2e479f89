"""A park waiting in ``Pending.wait`` for a queued undo's hold gives up when the engine
closes: a stop never waits for its handler until the wait's own deadline."""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError, Unavailable
from kvpark.daemon import commit as commit_mod
from kvpark.daemon.server import Daemon

from .test_retry_exception import Flaky, flaky  # noqa: F401 (fixture)

WT = {"policy.write": "write_through"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_a_stop_ends_the_wait_of_a_park_on_a_queued_undo(
        daemon: Callable[..., Daemon], flaky: type[Flaky], monkeypatch: pytest.MonkeyPatch) -> None:
    """write_through: x's overwrite refused (fsync failed), its undo failing (the disk still
    failing): the queued undo owns x's hold. A park of x waits for it (a client's, and one
    at the engine as ``commit`` waits). The stop ends both waits with ``UNAVAILABLE``
    ("shutting down") at once; before, they waited out their deadline, and the stop
    waited for the handler thread that long."""
    monkeypatch.setattr(commit_mod, "PENDING_WAIT_S", 600.0)  # no wait ends by its deadline here
    d = daemon(disk_factory=flaky, **WT)
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 1)])
        flaky.sync_armed = flaky.txn_armed = True  # the undo keeps failing
        with pytest.raises(KVParkError):
            c.park("x", [full(4096, 2)], overwrite=True)
        assert eng.deletes.pending == 1

    def client_waiter() -> None:
        try:
            with Client(d.address, transport="inline") as c2:
                c2.park("x", [full(4096, 3)], overwrite=True, timeout=600)
        except BaseException:  # noqa: BLE001 (the stop cancels its call)
            pass

    seen: list[BaseException] = []
    entered = threading.Event()

    def engine_waiter() -> None:
        with eng.catalog.lock:
            entered.set()
            try:
                eng.pending.wait(eng.catalog, ["x"], time.monotonic() + 600)
            except BaseException as e:  # noqa: BLE001
                seen.append(e)

    handler = threading.Thread(target=client_waiter, daemon=True)
    handler.start()
    direct = threading.Thread(target=engine_waiter, daemon=True)
    direct.start()
    assert entered.wait(30)
    with eng.catalog.lock:
        assert eng.pending.busy(["x"])  # the waiters wait on the queued undo's hold
    d.stop(0.5)
    direct.join(120)  # far below the wait's own deadline
    handler.join(120)
    flaky.txn_armed = False
    assert not direct.is_alive() and not handler.is_alive(), "a wait on a pending id outlived the stop"
    assert len(seen) == 1 and isinstance(seen[0], Unavailable) and "shutting down" in str(seen[0]), seen
