"""Fresh-eyes attack 17 on "absence is durable when it is answered" (4f5a4df..66b748e):
a pin of an id that only the remote tier holds.

docs/protocol.md counts ``NOT_FOUND`` from pin among the answers of absence, given only
once nothing of any version of the id can come back, "by adoption from Redis" too.
Restore, info, prefetch, drop and (since attack 16) a park's refs adopt an id the index
lacks from Redis first (``reads.adopt``); ``Engine.pin`` does not: it answers
``NOT_FOUND`` ("no parked sequence") for an id Redis holds, untombstoned, that the same
daemon answers ``present`` True for before and after, that ``info`` then adopts, and that
the pin, asked again after that, pins. A shared block whose last user was dropped here
is such an id (its Redis copy stays: other daemons' sequences may use it)."""

from __future__ import annotations

from typing import Callable

import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import KVParkError, NotFound

from ..conftest import wait_until
from .test_remote_tier import _new_ns, _remote


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_a_pin_of_a_block_held_in_redis_is_not_answered_not_found_while_present_says_it_is_parked(
        daemon: Callable[..., Daemon], redis_server) -> None:
    over = {"policy.write": "write_through", **_remote(redis_server.url, _new_ns(), write="write_through")}
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(4096, 1)], refs=["b"], new_blocks={"b": [full(4096, 2)]})
        assert wait_until(lambda: eng.catalog.find("b").on_remote, timeout=30), "b never reached Redis"
        assert c.drop("x") is True  # b has no user here now: its local copy goes, its Redis copy stays
        before = c.present(["b"])
        try:
            pin: object = c.pin("b", True)
        except KVParkError as e:
            pin = e
        after = c.present(["b"])
        info = c.info("b")  # adopts b
    assert not (isinstance(pin, NotFound) and (before == [True] or after == [True])), (
        f"pin(b) answered {pin!r} while the same daemon answers present(b)={before} before it and {after} "
        f"after it, and info(b) finds it ({info.seq_id!r}, tier {info.tier}): pin never adopts from Redis")
