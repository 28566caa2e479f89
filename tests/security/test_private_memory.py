"""Attack (issue 23, F3): a trusted_local tenant reads and rewrites an untrusted tenant's
KV through the memory it may map. The host arena (its path comes in ``Hello``) and the
device pool (its IPC handle) are mapped by every trusted_local tenant, so an untrusted
tenant's bytes must never be in either: not after an inline park (a gRPC stream, a
small park, the data channel), not after a demotion to disk and a promotion back, not in
the windows of a park larger than its memory tier. The trusted tenant scans everything
it maps for the untrusted tenant's bytes, then overwrites all of it; the untrusted
tenant's restores still return exactly its own bytes.

The device pool here is the CPU stand-in, which no client can map; what a trusted
tenant would see through the IPC handle of a real pool is exactly its contents, so the
test reads those contents in the daemon.
"""

from __future__ import annotations

import mmap
import os
import secrets
from typing import Callable, Iterator

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.model import NS_SEP, ParkSpec
from kvpark.daemon.server import Daemon
from kvpark.proto.layout import TensorMeta

from ..daemon.test_tenants import TOKENS, tenants

MiB = 1 << 20
DEV = {"tiers.device.enabled": "true", "tiers.device.device": "cpu", "tiers.device.capacity": "8MiB"}


@pytest.fixture
def mark() -> Iterator[bytes]:
    """What bob's bytes are made of: a marker of this test's own (memory the allocator
    hands out again may still hold an earlier test's), found by a scan in any piece."""
    yield b"<bob's F3 secret " + secrets.token_hex(8).encode() + b">"


def secret(mark: bytes, n: int, salt: int) -> torch.Tensor:
    """``n`` bytes of bob's: the marker, then one byte of ``salt``, over and over."""
    unit = mark + bytes([salt])
    return torch.frombuffer(bytearray((unit * (n // len(unit) + 1))[:n]), dtype=torch.uint8)


class Arena:
    """What a trusted_local tenant maps: the arena file by the path Hello gives it."""

    def __init__(self, c: Client) -> None:
        path, size = c.server.arena.path, c.server.arena.size
        assert path and size, "a trusted_local tenant is offered the arena"
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def holds(self, what: bytes) -> bool:
        return self.mm.find(what) >= 0

    def scribble(self) -> None:
        """Overwrite all of it with garbage."""
        junk = bytes(range(256)) * (len(self.mm) // 256) + bytes(len(self.mm) % 256)
        self.mm[:] = junk

    def close(self) -> None:
        self.mm.close()


def _device_holds(d: Daemon, what: bytes) -> bool:
    """Whether the device pool (all of which a trusted tenant maps by its IPC handle) holds ``what``."""
    assert d.engine is not None
    return bytes(d.engine.tiers["device"].pool.numpy()).find(what) >= 0


def _looks_and_scribbles(d: Daemon, arena: Arena, mark: bytes) -> None:
    assert not arena.holds(mark), "an untrusted tenant's bytes are in the arena a trusted tenant maps"
    assert not _device_holds(d, mark), "an untrusted tenant's bytes are in the device pool"
    arena.scribble()


@pytest.mark.parametrize("data_channel", [False, True], ids=["grpc", "data-channel"])
def test_a_trusted_tenant_can_neither_read_nor_alter_an_untrusted_tenants_inline_parks(
        daemon: Callable[..., Daemon], mark: bytes, data_channel: bool) -> None:
    d = daemon(**tenants(), **DEV, **{"server.data_channel": data_channel})
    with Client(d.address, token=TOKENS["alice"], transport="shm") as a, \
            Client(d.address, token=TOKENS["bob"]) as b:
        assert b.transport == "inline"
        arena = Arena(a)
        try:
            # A ParkSmall, and a stream (or the data channel).
            small, big = secret(mark, 64 << 10, 1), secret(mark, 3 * MiB, 2)
            b.park("small", [small])
            b.park("big", [big])
            # A prefix block of bob's, under the name of one alice parked first: a block
            # of his own (never deduplicated against hers), kept where his bytes are.
            theirs, block, tail = torch.zeros(MiB, dtype=torch.uint8), secret(mark, 2 * MiB, 4), secret(mark, 100, 5)
            a.park("chat", [torch.ones(10, dtype=torch.uint8)], refs=["blk"], new_blocks={"blk": [theirs]})
            b.park("chat", [tail], refs=["blk"], new_blocks={"blk": [block]})
            # Restores promote, and a prefetch to the device asks for the device pool itself.
            assert torch.equal(b.restore("big")[0], big)
            b.prefetch("big", tier="device", wait=True)
            b.prefetch("small", tier="host", wait=True)
            _looks_and_scribbles(d, arena, mark)
            assert torch.equal(b.restore("small")[0], small)
            assert torch.equal(b.restore("big")[0], big)
            _, out = b.restore_many(["chat"])
            assert torch.equal(out[0].flatten(), block) and torch.equal(out[1].flatten(), tail)
            _looks_and_scribbles(d, arena, mark)
        finally:
            arena.close()
    assert d.engine is not None
    d.engine.check_invariants()


def test_an_untrusted_tenants_bytes_stay_out_of_shared_memory_through_disk_and_back(
        daemon: Callable[..., Daemon], mark: bytes) -> None:
    # A host quota of 2 MiB: bob's older sequences go down to disk as he parks.
    d = daemon(**tenants(**{"bob.quota": {"host": "2MiB"}}), **DEV)
    with Client(d.address, token=TOKENS["alice"], transport="shm") as a, \
            Client(d.address, token=TOKENS["bob"]) as b:
        arena = Arena(a)
        try:
            seqs = {f"s{i}": secret(mark, MiB, 10 + i) for i in range(4)}
            for sid, t in seqs.items():
                b.park(sid, [t])
            assert b.info("s0").tier == "disk"
            _looks_and_scribbles(d, arena, mark)
            # Promoted back into memory by the restore, then read again from there.
            assert torch.equal(b.restore("s0")[0], seqs["s0"])
            assert b.info("s0").tier != "disk"
            _looks_and_scribbles(d, arena, mark)
            for sid, t in seqs.items():
                assert torch.equal(b.restore(sid)[0], t), sid
            _looks_and_scribbles(d, arena, mark)
        finally:
            arena.close()
    assert d.engine is not None
    d.engine.check_invariants()


def test_a_windowed_park_of_an_untrusted_tenant_never_passes_through_shared_memory(
        daemon: Callable[..., Daemon], mark: bytes) -> None:
    # Larger than bob's memory tier (a quarter of the 16 MiB host tier by default), not
    # larger than the host arena: it goes to disk through windows of bob's own tier.
    d = daemon(**tenants(**{"bob.quota": {"host": "1MiB"}}), **DEV)
    with Client(d.address, token=TOKENS["alice"], transport="shm") as a, \
            Client(d.address, token=TOKENS["bob"]) as b:
        arena = Arena(a)
        try:
            huge = secret(mark, 6 * MiB, 3)
            b.park("huge", [huge])
            (row,) = b.stat().tenants
            assert row.used["host"] == 0 and row.used["disk"] == 6 * MiB
            _looks_and_scribbles(d, arena, mark)
            assert torch.equal(b.restore("huge")[0], huge)
            _looks_and_scribbles(d, arena, mark)
        finally:
            arena.close()
    assert d.engine is not None
    d.engine.check_invariants()


def test_check_invariants_catches_a_reservation_of_an_untrusted_tenant_in_shared_memory(
        daemon: Callable[..., Daemon]) -> None:
    # The engine's own check of F3: an open reservation or window holds a sequence's bytes
    # as much as a copy does, so one in a tier its owner may not be in is caught too.
    d = daemon(**tenants())
    eng = d.engine
    assert eng is not None
    own = eng.reserve(ParkSpec("bob" + NS_SEP + "r", (TensorMeta("uint8", (4096,), 4096),), 4096), inline=True)
    assert own.tier == "private"
    eng.check_invariants()  # its own reservation, where it belongs
    with eng.catalog.lock:  # a bug's reservation: bob's bytes bound for the arena
        a = eng.tiers["host"].alloc.alloc(4096)
        assert a is not None
        bad = eng.leases.issue_write(ParkSpec("bob" + NS_SEP + "x", (TensorMeta("uint8", (4096,), 4096),), 4096),
                                     "host", [a])
    with pytest.raises(AssertionError, match="a lease's slots in the host tier"):
        eng.check_invariants()
    eng.release(bad.lease_id)
    eng.release(own.lease_id)
    eng.check_invariants()
