"""The flush writes memory-only sequences in batches: one transaction per batch, and what
fits still goes when the disk cannot take a whole batch."""

from typing import Callable, Sequence

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Write


class TxnCounter(DiskStore):
    """Counts write transactions (``write_many`` calls) and the sequences in each."""

    batches: list[int] = []

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        type(self).batches.append(len(writes))
        return super().write_many(writes, sync=sync)


def block(i: int) -> list[torch.Tensor]:
    return [torch.full((1024,), i % 100, dtype=torch.int8)]


def test_a_flush_of_many_blocks_takes_few_transactions(daemon: Callable[..., Daemon]) -> None:
    TxnCounter.batches = []
    d = daemon(disk_factory=TxnCounter, **{"tiers.host.slot_size": "64KiB"})
    with Client(d.address) as c:
        c.park_batch({f"b{i}": block(i) for i in range(1500)})  # one commit, all in memory (write_back)
        assert TxnCounter.batches == []
        assert c.flush() == 1500
        # 1. Batches of at most 1024 sequences: two transactions, not 1500.
        assert TxnCounter.batches == [1024, 476]
        assert all(s.tier == "host" for s in c.list()[:5])  # memory copies are kept
    eng = d.engine
    assert eng is not None
    eng.check_invariants()
    with eng.catalog.lock:
        assert all(s.on_disk for s in eng.catalog.sequences())
    with Client(d.address) as c:
        assert c.flush() == 0  # nothing memory-only is left


def test_what_fits_is_still_flushed_when_a_batch_does_not(daemon: Callable[..., Daemon]) -> None:
    # 2. A disk of 40 KiB that refuses to evict: the 100 KiB batch is refused whole, then
    #    written one sequence at a time until the disk is full.
    d = daemon(**{"tiers.host.slot_size": "64KiB", "tiers.disk.capacity": "40KiB", "policy.disk_full": "refuse"})
    with Client(d.address) as c:
        c.park_batch({f"b{i}": block(i) for i in range(100)})
        assert c.flush() == 40
    eng = d.engine
    assert eng is not None
    eng.check_invariants()
    assert eng.disk.used == 40 * 1024


def test_a_flush_batch_holds_at_most_batch_bytes(daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush's write transaction carries at most ``BATCH_BYTES`` (3 KiB here, three 1 KiB
    sequences), so one transaction never grows with what is memory-only."""
    from kvpark.daemon import flush

    monkeypatch.setattr(flush, "BATCH_BYTES", 3 * 1024)
    TxnCounter.batches = []
    d = daemon(disk_factory=TxnCounter, **{"tiers.host.slot_size": "64KiB"})
    with Client(d.address) as c:
        c.park_batch({f"b{i}": block(i) for i in range(10)})
        assert c.flush() == 10
        assert TxnCounter.batches == [3, 3, 3, 1]
