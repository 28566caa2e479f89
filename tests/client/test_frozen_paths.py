"""Every data path against a frozen daemon: each restore and park path (shm, inline over
the data channel, inline over gRPC streams, windowed sequences larger than the host
tier, ``restore_many``) ends with a typed error by the caller's deadline, whether the
daemon froze before the call or in the middle of its transfer.

The connection's default deadline is long (``LONG_S``) and the caller's short, so a call
that ends well before the default ended because the caller's deadline reached it.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable, Iterator, Sequence

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest
from ..conftest import Proc
from .test_deadlines import LONG_S, SHORT_S, assert_cut_by_deadline, freeze

MIB = 1 << 20
SMALL = [torch.arange(64, dtype=torch.float32)]
MID = [torch.randn(MIB)]  # 4 MiB: leased (shm) or a data-channel / streamed transfer (inline)
HUGE = [torch.randn(MIB // 4) for _ in range(20)]  # 20 MiB, past the 16 MiB host tier: windowed


@pytest.fixture
def frozen_daemon(proc: Callable[..., Proc]) -> Iterator[Callable[[bool], Proc]]:
    """A ``kvpark serve`` process (data channel on or off) holding ``s``, ``m`` and the
    windowed ``w``; the caller freezes it. Thawed at teardown."""
    started: list[Proc] = []

    def start(data_channel: bool) -> Proc:
        p = proc("--set", f"server.data_channel={str(data_channel).lower()}")
        with Client(p.address, transport="inline", timeout=LONG_S) as c:
            c.park("s", SMALL)
            c.park("m", MID)
            c.park("w", HUGE)
        started.append(p)
        return p

    yield start
    for p in started:
        p.popen.send_signal(signal.SIGCONT)


RESTORES: dict[str, Callable[[Client], object]] = {
    "small": lambda c: c.restore("s", timeout=SHORT_S),
    "mid": lambda c: c.restore("m", timeout=SHORT_S),
    "mid_into": lambda c: c.restore("m", into=[torch.empty_like(MID[0])], timeout=SHORT_S),
    "windowed": lambda c: c.restore("w", timeout=SHORT_S),
    "many": lambda c: c.restore_many(["s", "m"], timeout=SHORT_S),
    "many_flat": lambda c: c.restore_many(["s", "m"], into_flat=torch.empty(MIB * 4 + 256, dtype=torch.uint8),
                                          timeout=SHORT_S),
}
PARKS: dict[str, Callable[[Client], object]] = {
    "small": lambda c: c.park("s2", SMALL, timeout=SHORT_S),
    "mid": lambda c: c.park("m2", MID, timeout=SHORT_S),
    "windowed": lambda c: c.park("w2", HUGE, timeout=SHORT_S),
    "batch": lambda c: c.park_batch({"b1": MID, "b2": SMALL}, timeout=SHORT_S),
}
CLIENTS = [("shm", True), ("inline", True), ("inline", False)]
IDS = ["shm", "inline-data_channel", "inline-grpc_stream"]


@pytest.mark.parametrize("transport,data_channel", CLIENTS, ids=IDS)
def test_every_restore_and_park_path_on_a_frozen_daemon_ends_by_its_deadline(
        frozen_daemon, transport: str, data_channel: bool) -> None:
    p = frozen_daemon(data_channel)
    with Client(p.address, transport=transport, timeout=LONG_S) as c:
        assert c.transport == transport
        assert (getattr(c._transport, "channel", None) is not None) == (transport == "inline" and data_channel)
        freeze(p)
        for name, fn in {**{f"restore_{k}": v for k, v in RESTORES.items()},
                         **{f"park_{k}": v for k, v in PARKS.items()}}.items():
            assert_cut_by_deadline(name, lambda fn=fn: fn(c))
        # Thawed before the client closes: gRPC's channel close waits on a Park stream
        # abandoned mid-send to a frozen peer.
        p.popen.send_signal(signal.SIGCONT)


# A transfer under way when the daemon freezes: 64 MiB in memory (far more than socket
# and gRPC buffers hold), or the windowed 20 MiB.
MANY = [torch.full((MIB // 4,), float(i)) for i in range(64)]


@pytest.mark.parametrize("transport,data_channel,seq", [
    ("inline", True, "many"),  # a data-channel GET
    ("inline", False, "many"),  # a gRPC Restore stream
    ("inline", False, "w"),  # a gRPC Restore stream read from disk
    ("shm", True, "w"),  # arena windows, each asked for with Window
], ids=["data_channel_get", "grpc_stream", "grpc_stream_from_disk", "shm_windows"])
@pytest.mark.parametrize("bound", ["deadline", "timeout"])
def test_a_daemon_frozen_mid_restore_ends_it_by_the_deadline(proc: Callable[..., Proc], transport: str,
                                                              data_channel: bool, seq: str, bound: str) -> None:
    # 1. A daemon process; big enough a host tier for the 64 MiB one to stay in memory.
    host = "256MiB" if seq == "many" else "16MiB"
    # Disk grants off: a shm client would read the windowed sequence from the files
    # without the daemon, and the windows are the path under test here.
    p = proc("--set", f"tiers.host.capacity={host}", "--set", f"server.data_channel={str(data_channel).lower()}",
             "--set", "tiers.disk.direct_reads=false")
    try:
        with Client(p.address, transport=transport, timeout=LONG_S) as c:
            ts = MANY if seq == "many" else HUGE
            c.park(seq, ts)

            def restore() -> None:
                # 2. Under a deadline (an enclosing block, or the call's own timeout, which
                #    also bounds the steps taken after the call returned), a layer-wise
                #    restore hands over its first tensor; then the daemon freezes with
                #    the transfer under way.
                with c.deadline(5.0 if bound == "deadline" else None):
                    r = c.restore(seq, layerwise=True, timeout=5.0 if bound == "timeout" else None)
                i, first = next(r)  # type: ignore[call-overload]
                assert i == 0 and torch.equal(first, ts[0])
                freeze(p)
                with c.deadline(5.0 if bound == "deadline" else None):
                    for _ in r:  # type: ignore[union-attr]
                        pass

            # 3. The rest raises, typed, by the deadline, not the connection's default.
            assert_cut_by_deadline("layer-wise restore", restore)
    finally:
        p.popen.send_signal(signal.SIGCONT)


class StallsAfterFirstStage(DiskStore):
    """A disk whose second staged write of a windowed park hangs until released: the
    daemon stops reading that park's stream part-way."""

    entered = threading.Event()
    release = threading.Event()
    calls = 0

    def stage_blocks(self, m: Manifest, first: int, blocks: Sequence[memoryview]) -> None:
        cls = type(self)
        cls.calls += 1
        if cls.calls == 2:
            cls.entered.set()
            cls.release.wait(120)
        super().stage_blocks(m, first, blocks)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_a_park_whose_daemon_hangs_mid_stream_ends_by_the_deadline(daemon: Callable[..., Daemon],
                                                                    transport: str) -> None:
    StallsAfterFirstStage.entered.clear()
    StallsAfterFirstStage.release.clear()
    StallsAfterFirstStage.calls = 0
    # The data channel off: a windowed inline park is a gRPC Park stream either way.
    d = daemon(disk_factory=StallsAfterFirstStage, **{"server.data_channel": False})
    big = [torch.randn(MIB // 4) for _ in range(40)]  # 40 MiB through 4 MiB windows
    try:
        with Client(d.address, transport=transport, timeout=LONG_S) as c:
            def park() -> None:
                with c.deadline(SHORT_S * 5):
                    c.park("big", big)

            assert_cut_by_deadline("windowed park", park)
            assert StallsAfterFirstStage.entered.is_set()  # it hung mid-park, not before
    finally:
        StallsAfterFirstStage.release.set()
    with Client(d.address, transport=transport, timeout=LONG_S) as c:
        assert not c.present(["big"])[0]  # nothing half-parked became visible
