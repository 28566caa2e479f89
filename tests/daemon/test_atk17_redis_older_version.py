"""Fresh-eyes attack 17 on "absence is durable when it is answered" (4f5a4df..66b748e):
a version of an id that only the remote tier holds, under a newer local version.

docs/protocol.md: a drop answering ``True`` for its own drop is given only once nothing
of any version of the id can come back, "from LMDB or (with a remote tier) by adoption
from Redis"; a drop with ``everywhere`` deletes the remote copy too. ``Engine.drop``
looks the id up in Redis (``reads.adopt``) only when the index lacks it, and tombstones
only the versions it unindexes (``retire_remote``). A park of an id the index lacks does
not look in Redis either (only its refs are adopted): after a restart, an id the disk
had evicted to Redis (x v1) is not in the index, so an overwrite of x publishes v2 over
nothing, and v1 stays in Redis untombstoned. A drop of x then unindexes v2 only and
answers True; ``present(x)`` answers True straight after (Redis holds v1, no tombstone
of it), and a restore of x serves v1's bytes: a dropped id is back with its old data,
no crash needed. Fixed by remote-only stubs (``tiers/stubs.py``): the restart indexes v1
again, so the overwrite retires and tombstones it."""

from __future__ import annotations

import time
from typing import Callable

import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import NotFound

from .test_remote_tier import _new_ns, _remote, blob


def test_a_drop_of_an_overwritten_id_never_leaves_its_older_redis_version_restorable(
        daemon: Callable[..., Daemon], redis_server) -> None:
    over = {"tiers.disk.capacity": "24MiB", **_remote(redis_server.url, _new_ns(), write="on_evict")}
    d = daemon(**over)
    with Client(d.address, transport="inline") as c:
        c.park("x", [blob(1)])
        for i in range(48):  # x is the coldest: host -> disk -> Redis
            c.park(f"f{i:02d}", [blob(100 + i)])
        deadline = time.monotonic() + 30
        while c.info("x").tier != "remote" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.info("x").tier == "remote", "x never left the disk for Redis"
    d.stop(0.5)
    d2 = daemon(**over)  # the same disk and namespace: x is known only from Redis now
    with Client(d2.address, transport="inline") as c:
        assert c.present(["x"]) == [True]
        c.park("x", [blob(2)], overwrite=True)
        assert torch.equal(c.restore("x")[0], blob(2))
        assert c.drop("x") is True
        after = c.present(["x"])
        try:
            got: object = c.restore("x")[0]
            back = "v1 (the old bytes)" if torch.equal(got, blob(1)) else "other bytes"  # type: ignore[arg-type]
        except NotFound:
            back = "NOT_FOUND"
    assert after == [False] and back == "NOT_FOUND", (
        f"drop(x) answered True, then present(x)={after} and restore(x) -> {back}: the version of x the "
        "disk had evicted to Redis was neither adopted nor tombstoned by the overwrite or the drop")
