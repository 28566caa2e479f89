"""Fresh-eyes attack 16 on "absence is durable when it is answered" (4f5a4df..f240d0f):
a park naming a shared block that only the remote tier holds.

docs/protocol.md counts NOT_FOUND "from a park naming a shared block that is not parked"
among the answers of absence, given only once nothing of that id can come back. With a
remote tier, a shared block left without users here (its last user dropped) loses its
local copy but keeps its Redis copy (other daemons' sequences may use it): the daemon
answers ``present(b)`` True, ``info(b)`` adopts it, a restart finds it. Yet a park that
names b as a ref is refused NOT_FOUND ("referenced shared block 'b' is not parked"):
``Engine.commit`` settles the refs on NotFound (``absent``) but never looks them up in
Redis (``reads.adopt``), as restore, info, pin, prefetch and drop do on a local miss.
The client is told b is gone while the same daemon says, before and after, that b is
parked (and a second park naming b succeeds once anything else has adopted it)."""

from __future__ import annotations

from typing import Callable

import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import KVParkError, NotFound

from ..conftest import wait_until
from .disk_seams import crash_image
from .test_remote_tier import _new_ns, _remote


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_a_park_naming_a_shared_block_held_in_redis_is_not_refused_not_found_while_present_says_it_is_parked(
        daemon: Callable[..., Daemon], redis_server, tmp_path) -> None:
    over = {"policy.write": "write_through", "policy.flush_on_shutdown": "false",
            **_remote(redis_server.url, _new_ns(), write="write_through")}
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(4096, 1)], refs=["b"], new_blocks={"b": [full(4096, 2)]})
        assert wait_until(lambda: eng.catalog.find("b").on_remote, timeout=30), "b never reached Redis"
        assert c.drop("x") is True  # b has no user here now: its local copy goes, its Redis copy stays
        before = c.present(["b"])
        try:
            park: object = c.park("y", [full(4096, 3)], refs=["b"], timeout=30)
        except KVParkError as e:
            park = e
        after = c.present(["b"])
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    d2 = daemon(**{**over, "tiers.disk.path": image})
    with Client(d2.address) as c2:
        restarted = c2.present(["b"])
    assert not (isinstance(park, NotFound) and (before == [True] or after == [True] or restarted == [True])), (
        f"park of y naming shared block b answered {park!r}; the same daemon answers present(b)={before} before "
        f"it and {after} after it, and a restart on its disk present(b)={restarted}: b, held in Redis, is "
        "adopted by every other local miss but never by a park's refs")
