"""Deadlines everywhere: a frozen daemon (SIGSTOP) makes every call raise within its
deadline, never hang; after SIGCONT the same client works again."""

from __future__ import annotations

import math
import signal
import threading

import pytest
import torch

from kvpark.client import Client
from kvpark.client.rpc import DEFAULT_TIMEOUT_S, FLOOR_RATE, resolve_timeout
from kvpark.proto.errors import DeadlineExceeded, InvalidArgument, Unavailable


def test_timeout_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPARK_TIMEOUT", raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("KVPARK_TIMEOUT", "2.5")
    assert resolve_timeout(None) == 2.5
    assert resolve_timeout(7) == 7.0
    assert resolve_timeout(math.inf) is None  # explicitly no deadline
    for bad in (0, -1, math.nan, "soon"):
        with pytest.raises(InvalidArgument):
            resolve_timeout(bad)  # type: ignore[arg-type]
    monkeypatch.setenv("KVPARK_TIMEOUT", "never")
    with pytest.raises(InvalidArgument):
        resolve_timeout(None)


def test_data_deadline_grows_with_size(daemon) -> None:
    d = daemon()
    with Client(d.address, timeout=3.0) as c:
        assert c.rpc.data_timeout(0) == 3.0
        assert c.rpc.data_timeout(int(FLOOR_RATE)) == pytest.approx(4.0)
        with c.deadline(math.inf):
            assert c.rpc.data_timeout(1 << 30) is None
        with c.deadline(None):  # None inside deadline() is the connection's default
            assert c.rpc.timeout == 3.0


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_frozen_daemon_raises_then_recovers(proc, monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    # 1. A real daemon process; a client with default settings (the default deadline
    #    comes from KVPARK_TIMEOUT, kept short so the test is quick).
    p = proc()
    monkeypatch.setenv("KVPARK_TIMEOUT", "1.5")
    small = [torch.arange(64, dtype=torch.float32)]
    big = [torch.randn(1 << 20)]  # 4 MiB: a streamed / leased transfer
    with Client(p.address, transport=transport) as c:
        assert c.timeout == 1.5
        c.park("a", big)
        c.park("s", small)
        # 2. Freeze it: every kind of call raises a typed error instead of hanging.
        p.popen.send_signal(signal.SIGSTOP)
        try:
            calls = {
                "park": lambda: c.park("b", big),
                "park_small": lambda: c.park("c", small),
                "restore": lambda: c.restore("a"),
                "restore_small": lambda: c.restore("s"),
                "info": lambda: c.info("a"),
                "stat": lambda: c.stat(),
                "lookup": lambda: c.lookup(["a"]),
                "per_call": lambda: c.list(timeout=0.5),
            }
            for name, fn in calls.items():
                box: list[BaseException | None] = []

                def run(fn=fn, box=box) -> None:
                    try:
                        fn()
                        box.append(None)
                    except BaseException as e:  # noqa: BLE001 - the test inspects it
                        box.append(e)

                t = threading.Thread(target=run, daemon=True)
                t.start()
                # Generous bound (load on a shared machine); a hang would never end.
                t.join(60)
                assert box, f"{name} hung on a frozen daemon"
                assert isinstance(box[0], (DeadlineExceeded, Unavailable)), f"{name}: {box[0]!r}"
        finally:
            # 3. Thaw it: the same client works again.
            p.popen.send_signal(signal.SIGCONT)
        out = c.restore("a")
        assert torch.equal(out[0], big[0])
        assert c.info("s").nbytes == small[0].numel() * 4
