"""Shutdown never closes LMDB under a read that outlived the server's drain.

A restore streaming a disk copy holds an LMDB read transaction and zero-copy views into
LMDB's map. A gRPC handler past ``server.grace_s``, or a data-channel GET past its join,
stalled on a slow disk, still holds them when the engine closes the disk store. Before:
``DiskStore.close`` closed the environment at once, unmapping what the reader was about
to touch. Now it waits for every open read transaction (``CLOSE_WAIT_S``), and the stalled
restore ends with its bytes or a typed error, in a daemon that stopped cleanly.

The stall goes through the ``disk_factory`` seam: a ``DiskStore`` whose block reads wait
for the test. If the store is closed under it, the read refuses to touch the unmapped
records (so the test fails, rather than the test process crashing).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon import datachannel
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import Unavailable
from kvpark.tiers.disk import DiskStore, ReadTxn

from ..conftest import wait_until


class _StalledReads(DiskStore):
    stall = threading.Event()  # set: reads wait for ``go``
    stalled = threading.Event()
    go = threading.Event()
    closed = False

    @contextmanager
    def read_txn(self) -> Iterator[ReadTxn]:
        with super().read_txn() as r:
            real = r.read_block

            def read_block(m, index, length):  # type: ignore[no-untyped-def]
                if _StalledReads.stall.is_set():
                    _StalledReads.stalled.set()
                    _StalledReads.go.wait(30)
                    if _StalledReads.closed:
                        raise Unavailable("the store was closed under this read (the map is gone)")
                return real(m, index, length)

            r.read_block = read_block  # type: ignore[method-assign]
            yield r

    def close(self) -> None:
        super().close()
        _StalledReads.closed = True


@pytest.mark.parametrize("path", ["grpc-stream", "data-channel"])
def test_shutdown_waits_for_a_disk_read_that_outlived_the_drain(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    for e in (_StalledReads.stall, _StalledReads.stalled, _StalledReads.go):
        e.clear()
    _StalledReads.closed = False
    # The data channel's stop joins each transfer for IDLE_S: shortened, so the stalled
    # GET outlives the join within the test (the constant, not the code, changes).
    monkeypatch.setattr(datachannel, "IDLE_S", 0.5)
    d = daemon(disk_factory=_StalledReads, **{"policy.write": "write_through", "policy.promote_on_restore": "false",
                                             "server.data_channel": path == "data-channel"})
    eng = d.engine
    assert eng is not None
    data = torch.arange(1 << 22, dtype=torch.int32)  # 16 MiB: past inline_max, so streamed
    with Client(d.address, transport="inline") as c:
        c.park("s", [data])
        # On disk only, so the restore reads LMDB (the maintenance pass may have demoted it
        # already: a 16 MiB park is past the host tier's high mark).
        eng.mover.demote("s", "host")
        assert wait_until(lambda: c.info("s").tier == "disk", timeout=30)
    got: list[object] = []
    stopped = threading.Event()

    def restore() -> None:
        try:
            with Client(d.address, transport="inline", timeout=30) as c:
                got.append(c.restore("s")[0])
        except KVParkError as e:
            got.append(e)

    _StalledReads.stall.set()
    reader = threading.Thread(target=restore)
    reader.start()
    assert _StalledReads.stalled.wait(10)
    stopper = threading.Thread(target=lambda: (d.stop(0.2), stopped.set()))
    stopper.start()
    try:
        # Before: the store was closed here, under the stalled read.
        assert not stopped.wait(2.0), "the daemon closed its disk store under a read still running"
    finally:
        _StalledReads.go.set()
    reader.join(30)
    stopper.join(30)
    assert stopped.is_set() and not reader.is_alive()
    assert not _StalledReads.closed or got, got
    assert len(got) == 1
    if isinstance(got[0], torch.Tensor):
        assert got[0].equal(data)
    else:  # cancelled by the drain: typed, never wrong bytes
        assert isinstance(got[0], KVParkError), got


def test_a_read_begun_after_close_is_refused_typed(tmp_path) -> None:
    store = DiskStore(str(tmp_path / "disk"), 1 << 20)
    store.close()
    try:
        with store.read_txn():
            raise AssertionError("a read transaction on a closed store")
    except Unavailable:
        pass
