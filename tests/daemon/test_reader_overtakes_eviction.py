"""With no disk fault at all, a disk eviction to Redis that a restore's read lease
overtakes (granted from the disk copy between the eviction's last check and its delete)
queues the live sequence's own records for a later delete (``Deletes._later(m, seq)``).
A restore that fetches the sequence from Redis onto the disk then takes that queued
delete over and succeeds; a fix that counted the queued entry as a delete under way
answered UNAVAILABLE until the lease ended and a maintenance pass ran. Found by a
fresh-eyes attack."""

from __future__ import annotations

from typing import Callable

import torch

from kvpark.daemon.disk_evict import disk_to_remote
from kvpark.daemon.server import Daemon

from .test_remote_tier import _new_ns, _remote

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_a_restore_overtaking_an_eviction_to_redis_leaves_the_sequence_restorable(
        daemon: Callable[..., Daemon], redis_server) -> None:  # type: ignore[no-untyped-def]
    """promote_on_restore off (restores stream from disk). x's only copy is on disk; the
    eviction copies it to Redis and checks it is unread; a restore then leases x's disk
    copy (pinned here just before the eviction's delete, through the real read path); the
    delete sees the reader and leaves x's records for later, queued with x's own Seq. A
    second restore of x (x now remote-only) must fetch it onto the disk: UNAVAILABLE,
    with no fault anywhere."""
    from kvpark.client import Client

    over = {"policy.promote_on_restore": "false", **_remote(redis_server.url, _new_ns(), write="on_evict")}
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
        c.flush()
        assert eng.mover.demote("x", "host")  # its only copy on disk

        leases = []
        real_delete = eng.deletes.delete

        def delete(seq):  # type: ignore[no-untyped-def]
            if seq.seq_id == "x" and not leases:
                # A restore's read lease lands here: after the eviction's last check.
                leases.append(eng.acquire("x", stream=True))
            return real_delete(seq)

        eng.deletes.delete = delete  # type: ignore[method-assign]
        try:
            assert disk_to_remote(eng.mover, "x")
        finally:
            eng.deletes.delete = real_delete  # type: ignore[method-assign]
        assert leases and leases[0].parts[0].tier == "disk"
        assert c.info("x").tier == "remote"
        try:
            h = eng.acquire("x", stream=True)  # a second restore: x must come from Redis
            got = "served"
            eng.release(h.lease.lease_id) if h.lease is not None else None
        except Exception as e:  # noqa: BLE001
            got = repr(e)
        eng.release(leases[0].lease.lease_id)
    assert got == "served", f"a restore of x (no fault anywhere): {got}"
