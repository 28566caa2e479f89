"""Attack: a tenant holding more memory than its quota by parking or promoting through
paths the quota did not watch (issue F4). Quotas are charged on the tier where the
bytes land: an inline park's device->host fallback, restores and prefetches that
promote."""

from __future__ import annotations

import time
from typing import Any, Callable

import grpc
import pytest
import torch

from kvpark.client import Client, ResourceExhausted
from kvpark.daemon.server import Daemon
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import wait_until
from ..daemon.test_tenants import TOKENS, _raw, blob, tenants

MiB = 1 << 20
DEV = {"tiers.device.enabled": "true", "tiers.device.device": "cpu", "tiers.device.capacity": "8MiB"}
QUOTA = {"bob.quota": {"host": "2MiB"}}


def _host(c: Client) -> int:
    (row,) = c.stat().tenants
    return row.used["host"]


def test_an_inline_park_that_falls_back_to_host_is_charged_on_host(daemon: Callable[..., Daemon]) -> None:
    # carol: trusted_local, parking inline (an untrusted tenant never lands on the device:
    # see the private-tier tests below).
    d = daemon(**tenants(**{"carol.quota": {"host": "2MiB"}}), **DEV, **{"policy.restore_to": "device"})
    with Client(d.address, token=TOKENS["alice"], transport="inline") as a, \
            Client(d.address, token=TOKENS["carol"], transport="inline") as b:
        # The device is physically full of alice's pinned sequences: carol's inline parks,
        # bound for the device, land on host.
        for i in range(8):
            assert a.park(f"pin{i}", [blob(MiB, i)], pinned=True).tier == "device"
        for i in range(12):
            b.park(f"b{i}", [blob(MiB, 100 + i)])
            assert _host(b) <= 2 * MiB, f"after park {i}: {_host(b)} bytes of carol's on host"
        for i in range(12):
            assert torch.equal(b.restore(f"b{i}")[0], blob(MiB, 100 + i))
        for i in range(8):
            assert a.info(f"pin{i}").tier == "device"  # nothing of alice's moved for carol
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
            # bob is not trusted_local: asked for host, his copy is in the private tier
            assert b.prefetch(f"b{i}", tier="host", wait=True) == "private"
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


def _private(c: Client) -> int:
    """Bytes the private tier holds (the daemon's total: bob is its only untrusted tenant)."""
    return c.stat().tiers["private"].used_bytes


def test_an_untrusted_tenants_private_copies_are_charged_to_its_host_quota_on_every_path(
        daemon: Callable[..., Daemon]) -> None:
    # bob is not trusted_local: his copies live in the private tier (host memory no client
    # maps), charged to his host quota, whatever path put them there.
    d = daemon(**tenants(**QUOTA), **DEV)
    with Client(d.address, token=TOKENS["bob"]) as b:
        # Inline parks bound for the device (the park tier here) land in the private tier.
        for i in range(6):
            assert b.park(f"b{i}", [blob(MiB, i)]).tier == "private"
            assert _host(b) <= 2 * MiB and _private(b) <= 2 * MiB, f"after park {i}"
        assert b.stat().tiers["device"].used_bytes == 0
        # A park larger than the private tier goes through windows of it, to disk only.
        b.park("huge", [blob(6 * MiB, 9)])
        assert _host(b) <= 2 * MiB and _private(b) <= 2 * MiB
        (row,) = b.stat().tenants
        assert row.used["disk"] == 12 * MiB
        # Restores promote from disk into the private tier, within the quota once read.
        for _ in range(2):
            for i in range(6):
                assert torch.equal(b.restore(f"b{i}")[0], blob(MiB, i))
                assert _host(b) <= 2 * MiB and _private(b) <= 2 * MiB, f"after restoring b{i}"
        assert torch.equal(b.restore("huge")[0], blob(6 * MiB, 9))
        # A prefetch asked for the device promotes into the private tier, making room there.
        for i in range(6):
            assert b.prefetch(f"b{i}", tier="device", wait=True) == "private"
            assert _host(b) <= 2 * MiB and _private(b) <= 2 * MiB, f"after prefetching b{i}"
        assert b.stat().tiers["device"].used_bytes == 0
    # The operator's /metrics has the private tier with the others.
    assert d.metrics is not None
    assert 'kvpark_tier_capacity_bytes{tier="private"} 4.194304e+06' in d.metrics.render().decode()
    assert d.engine is not None
    d.engine.check_invariants()


def test_pinned_sequences_restored_from_disk_do_not_outstay_the_quota(daemon: Callable[..., Daemon]) -> None:
    # bob pins sequences that the quota had sent to disk, then restores them: each
    # restore promotes a pinned copy into the private tier, which no demotion may take
    # ("never below the tier it is in"). Unchecked, bob holds the whole private tier (4
    # MiB) on a 1 MiB host quota, and dave, another tenant that is not trusted_local,
    # can park nothing at all.
    d = daemon(**tenants(**{"bob.quota": {"host": "1MiB"}, "carol.trusted_local": False}))
    with Client(d.address, token=TOKENS["bob"]) as b, Client(d.address, token=TOKENS["carol"]) as dave:
        seqs = {f"p{i}": blob(MiB, i) for i in range(4)}
        for sid, t in seqs.items():
            b.park(sid, [t])
        for sid in seqs:
            b.pin(sid)
        for _ in range(2):
            for sid, t in seqs.items():
                assert torch.equal(b.restore(sid)[0], t)
                assert _host(b) <= MiB, f"after restoring {sid}: {_host(b)} bytes of bob's in memory"
        assert all(b.info(sid).pinned for sid in seqs)  # still pinned: only their memory copies left
        assert dave.park("x", [blob(MiB, 9)]).tier == "private"
        assert torch.equal(dave.restore("x")[0], blob(MiB, 9))
    assert d.engine is not None
    d.engine.check_invariants()


def test_prefetches_that_do_not_wait_leave_the_tenant_within_its_quota(daemon: Callable[..., Daemon]) -> None:
    # Each prefetch makes room within the quota, then promotes in the background. On a
    # slow disk, prefetches that do not wait, one after another, each find the room the
    # earlier ones have not filled yet: unchecked, they all land (3 MiB on a 1 MiB quota).
    d = daemon(**tenants(**{"bob.quota": {"host": "1MiB"}}))
    eng = d.engine
    assert eng is not None
    promote = eng.mover.promote

    def slow(*args: Any, **kw: Any) -> bool:
        time.sleep(0.3)  # a disk read that takes its time
        return promote(*args, **kw)

    eng.mover.promote = slow  # type: ignore[method-assign]
    with Client(d.address, token=TOKENS["bob"]) as b:
        seqs = {f"p{i}": blob(MiB, i) for i in range(4)}
        for sid, t in seqs.items():
            b.park(sid, [t])
        for sid in seqs:
            assert b.prefetch(sid, tier="host") in ("disk", "private")
        assert wait_until(lambda: not eng.mover.prefetches._futures and _host(b) <= MiB, 10), \
            f"{_host(b)} bytes of bob's in memory after his prefetches landed"
        for sid, t in seqs.items():
            assert torch.equal(b.restore(sid)[0], t)
    eng.check_invariants()


def test_read_leases_that_expire_unreleased_leave_the_tenant_within_its_quota(daemon: Callable[..., Daemon]) -> None:
    # A restore's promoted copy may be over the quota while it is read; the Release that
    # ends the read settles it. A reader that never releases (a data-channel Acquire it
    # never collects) leaves its lease to expire: unchecked, each such Acquire kept a
    # promoted copy for good (3 MiB on a 1 MiB quota, in a private tier other tenants share).
    d = daemon(**tenants(**{"bob.quota": {"host": "1MiB"}}), **{"server.data_channel": True, "leases.ttl_s": 1.0})
    with Client(d.address, token=TOKENS["bob"]) as b, grpc.insecure_channel(d.address) as ch:
        seqs = {f"p{i}": blob(MiB, i) for i in range(4)}
        for sid, t in seqs.items():
            b.park(sid, [t])
        acquire = _raw(ch, "Acquire", "unary_unary")
        for sid in seqs:
            raw = acquire(pb.AcquireRequest(seq_id=sid, data_channel=True).SerializeToString(),
                          metadata=[("authorization", f"Bearer {TOKENS['bob']}")], timeout=10)
            assert pb.AcquireResponse.FromString(raw).token  # a lease, and bytes never collected
        assert wait_until(lambda: b.stat().leases == 0 and _host(b) <= MiB, 10), \
            f"{_host(b)} bytes of bob's in memory after his read leases expired"
        for sid, t in seqs.items():
            assert torch.equal(b.restore(sid)[0], t)
    assert d.engine is not None
    d.engine.check_invariants()


def test_a_restore_of_several_ids_that_fails_part_way_leaves_the_tenant_within_its_quota(
        daemon: Callable[..., Daemon]) -> None:
    # A restore of several ids promotes them one after another; one that fails (here a
    # corrupt block on disk, DATA_LOSS) ends the call with no lease, so no Release comes to
    # settle the copies promoted before it: they stayed in memory over the quota for good.
    from kvpark.client import DataLoss
    from kvpark.tiers.disk import HEADER

    d = daemon(**tenants(**{"bob.quota": {"host": "1MiB"}}))
    e = d.engine
    assert e is not None
    with Client(d.address, token=TOKENS["bob"], transport="inline") as b:
        seqs = {f"p{i}": blob(MiB, i) for i in range(4)}
        for sid, t in seqs.items():
            b.park(sid, [t])
        b.flush()
        for s in e.catalog.sequences():  # all on disk only, so the restore promotes each
            if s.tier == "private":
                e.mover.demote(s.seq_id, "private")
        assert _host(b) == 0
        db = e.disk.env.open_db(b"blocks")
        with e.disk.env.begin(write=True) as txn:
            key = next(k for k, _ in txn.cursor(db=db) if b"p3\x00" in k)
            raw = bytearray(txn.get(key, db=db))
            raw[HEADER.size + 10] ^= 0x01
            txn.put(key, bytes(raw), db=db)
        with pytest.raises(DataLoss):
            b.restore_many(["p0", "p1", "p2", "p3"])
        assert _host(b) <= MiB, f"{_host(b)} bytes of bob's in memory after a restore that failed part way"
    e.check_invariants()
