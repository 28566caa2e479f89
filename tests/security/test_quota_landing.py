"""Attack: a tenant holding more memory than its quota by parking or promoting through
paths the quota did not watch (issue F4). Quotas are charged on the tier where the
bytes land: an inline park's device->host fallback, restores and prefetches that
promote."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvpark.client import Client, ResourceExhausted
from kvpark.daemon.server import Daemon

from ..daemon.test_tenants import TOKENS, blob, tenants

MiB = 1 << 20
DEV = {"tiers.device.enabled": "true", "tiers.device.device": "cpu", "tiers.device.capacity": "8MiB"}
QUOTA = {"bob.quota": {"host": "2MiB"}}


def _host(c: Client) -> int:
    (row,) = c.stat().tenants
    return row.used["host"]


def test_an_inline_park_that_falls_back_to_host_is_charged_on_host(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants(**QUOTA), **DEV)
    with Client(d.address, token=TOKENS["alice"], transport="inline") as a, \
            Client(d.address, token=TOKENS["bob"]) as b:
        # The device is physically full of alice's pinned sequences: bob's inline parks,
        # bound for the device, land on host.
        for i in range(8):
            assert a.park(f"pin{i}", [blob(MiB, i)], pinned=True).tier == "device"
        for i in range(12):
            b.park(f"b{i}", [blob(MiB, 100 + i)])
            assert _host(b) <= 2 * MiB, f"after park {i}: {_host(b)} bytes of bob's on host"
        for i in range(12):
            assert torch.equal(b.restore(f"b{i}")[0], blob(MiB, 100 + i))
        for i in range(8):
            assert a.info(f"pin{i}").tier == "device"  # nothing of alice's moved for bob
    assert d.engine is not None
    d.engine.check_invariants()


def test_restores_that_promote_leave_the_tenant_within_its_host_quota(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants(**QUOTA))
    with Client(d.address, token=TOKENS["bob"]) as b:
        for i in range(6):
            b.park(f"b{i}", [blob(MiB, i)])
        assert _host(b) <= 2 * MiB
        for _ in range(2):
            for i in range(6):
                assert torch.equal(b.restore(f"b{i}")[0], blob(MiB, i))
                assert _host(b) <= 2 * MiB, f"after restoring b{i}: {_host(b)} bytes of bob's on host"
    assert d.engine is not None
    d.engine.check_invariants()


def test_prefetches_make_room_within_the_quota_or_are_refused(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants(**QUOTA))
    with Client(d.address, token=TOKENS["bob"]) as b:
        for i in range(6):
            b.park(f"b{i}", [blob(MiB, i)])
        for i in range(6):
            assert b.prefetch(f"b{i}", tier="host", wait=True) == "host"
            assert _host(b) <= 2 * MiB, f"after prefetching b{i}: {_host(b)} bytes of bob's on host"
        # Its host quota held by pinned sequences, nothing of its own can make room.
        b.park("p0", [blob(MiB, 10)], pinned=True)
        b.park("p1", [blob(MiB, 11)], pinned=True)
        with pytest.raises(ResourceExhausted) as e:
            b.prefetch("b0", tier="host", wait=True)
        assert "bob" in str(e.value) and "host quota" in str(e.value)
        assert _host(b) <= 2 * MiB
        assert torch.equal(b.restore("b0")[0], blob(MiB, 0))  # served all the same, from disk
        assert _host(b) <= 2 * MiB
