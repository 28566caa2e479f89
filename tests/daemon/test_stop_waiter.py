"""A stop ends the waits on pending ids before it waits for the handler threads of
cancelled calls (``Engine.end_waits``): the handler waiting on a pending id leaves at
once, not after the stop's whole handler wait (``HANDLER_WAIT_S``), when ``Engine.close``
used to end it. Found by a fresh-eyes attack."""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon import commit as commit_mod
from kvpark.daemon import server as server_mod
from kvpark.daemon.server import Daemon

from .disk_seams import waiting_in
from .test_retry_exception import Flaky, flaky  # noqa: F401 (fixture)

WT = {"policy.write": "write_through"}


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_a_stop_ends_a_handlers_wait_on_a_pending_id_before_it_waits_for_that_handler(
        daemon: Callable[..., Daemon], flaky: type[Flaky], monkeypatch: pytest.MonkeyPatch) -> None:
    """write_through: x's overwrite is refused and its undo keeps failing (the queued undo
    owns x's hold). A client's park of x waits in its handler on that hold. ``stop()``:
    gRPC is stopped, then the stop joins the handler threads for ``HANDLER_WAIT_S``, and
    only then closes the engine, which ends the handler's wait. The handler cannot leave
    before the engine closes, so the stop takes the whole handler wait."""
    monkeypatch.setattr(commit_mod, "PENDING_WAIT_S", 600.0)  # no wait ends by its own deadline here
    monkeypatch.setattr(server_mod, "HANDLER_WAIT_S", 300.0)  # 30 s by default; long here, to see it
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

    handler = threading.Thread(target=client_waiter, daemon=True)
    handler.start()
    deadline = time.monotonic() + 30
    while not waiting_in("wait", "commit.py") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waiting_in("wait", "commit.py"), "the park never waited on x's pending hold"
    stopper = threading.Thread(target=d.stop, args=(0.5,), daemon=True)
    stopper.start()
    stopper.join(30)  # "at once": far below the handler wait
    stuck = stopper.is_alive()
    closed = eng.pending._closed  # noqa: SLF001 (whether the stop has ended the waits yet)
    # Let the test end: the disk works again, the undo goes through, the hold is released.
    flaky.txn_armed = False
    eng.deletes.retry()
    stopper.join(120)
    handler.join(120)
    assert not stuck, (f"the stop was still running 30 s after it began (pending closed: {closed}); "
                       "the handler it waits for waits on a pending id only the engine's close ends")
