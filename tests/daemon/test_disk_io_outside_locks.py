"""Regression tests: disk I/O never runs under a lock that commits, drops or restores need.

Each bug is named by its test: a long demotion used to hold the disk lock that commits
and drops of disk-resident sequences waited for; a batch park fsynced once per block.
A slow disk is injected through the ``disk_factory`` seam; nothing in the product sleeps.
"""

import threading
from typing import Callable, Iterator, Sequence

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Write

from ..conftest import wait_until

MiB = 1 << 20


def blob(i: int, n: int = MiB) -> torch.Tensor:
    return torch.full((n,), i % 251, dtype=torch.uint8)


class GatedDisk(DiskStore):
    """Writes of sequences named ``slow*`` wait at a gate the test opens (a long demotion)."""

    entered = threading.Event()
    gate = threading.Event()

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        if any(w.manifest.seq_id.startswith("slow") for w in writes):
            type(self).entered.set()
            assert type(self).gate.wait(60), "the test never opened the gate"
        return super().write_many(writes, sync=sync)


class CountingDisk(DiskStore):
    """Counts fsyncs (every durability point goes through ``sync``)."""

    syncs = 0

    def sync(self) -> None:
        type(self).syncs += 1
        super().sync()


@pytest.fixture
def gated() -> Iterator[type[GatedDisk]]:
    GatedDisk.entered.clear()
    GatedDisk.gate.clear()
    yield GatedDisk
    GatedDisk.gate.set()  # never leave a demotion stuck past the test


def test_commit_and_drop_are_not_blocked_by_a_long_demotion(daemon: Callable[..., Daemon],
                                                            gated: type[GatedDisk]) -> None:
    d = daemon(disk_factory=gated)
    engine = d.engine
    assert engine is not None
    with Client(d.address, timeout=30) as c:
        # Step 1: two sequences with disk copies (a drop and an overwrite must delete them).
        c.park("old", [blob(1)])
        c.park("gone", [blob(2)])
        assert engine.flush() == 2
        # Step 2: pass the high watermark with sequences whose demotion blocks inside the disk write.
        for i in range(14):
            c.park(f"slow{i:02d}", [blob(10 + i)])
        assert gated.entered.wait(30), "background demotion never reached the disk"
        # Step 3: while that write is stuck, commits, drops and restores go through.
        c.park("old", [blob(3, 1000)], overwrite=True)  # deletes the old generation's disk copy
        assert c.drop("gone")  # deletes a disk copy
        c.park("fresh", [blob(4, 5000)])
        assert torch.equal(c.restore("fresh")[0], blob(4, 5000))
        assert torch.equal(c.restore("old")[0], blob(3, 1000))
        assert not gated.gate.is_set()  # all of the above finished with the demotion still inside its write
        gated.gate.set()
        # Step 4: the demotion finishes: the coldest sequence now lives on disk only.
        assert wait_until(lambda: c.info("slow00").tier == "disk", timeout=30)
        assert wait_until(lambda: c.stat().leases == 0)
        for i in range(14):
            assert torch.equal(c.restore(f"slow{i:02d}")[0], blob(10 + i)), i
        assert c.list()[0].seq_id == "fresh" and "gone" not in {s.seq_id for s in c.list()}
    engine.check_invariants()


def test_a_batch_park_fsyncs_once_under_write_through(daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=CountingDisk, **{"policy.write": "write_through"})
    engine = d.engine
    assert engine is not None
    with Client(d.address) as c:
        before = CountingDisk.syncs
        c.park_batch({f"b{i}": [blob(i, 3000 + i)] for i in range(8)})
        assert CountingDisk.syncs == before + 1
        assert c.stat().tiers["disk"].sequences == 8
        # A composite park creating its shared blocks is one transaction and one fsync too.
        before = CountingDisk.syncs
        c.park("comp", [blob(9, 100)], refs=["B1", "B2"], new_blocks={"B1": [blob(1, 500)], "B2": [blob(2, 600)]})
        assert CountingDisk.syncs == before + 1
        assert c.stat().tiers["disk"].sequences == 11
        assert torch.equal(c.restore("comp")[-1], blob(9, 100))  # its blocks come first
    engine.check_invariants()
