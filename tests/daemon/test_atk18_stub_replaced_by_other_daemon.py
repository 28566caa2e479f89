"""Fresh-eyes attack 18 on remote-only stubs (3ab52da): a stub of a version another daemon
sharing the namespace has replaced in Redis.

Daemon A evicts x (v1) to Redis and writes its stub. Daemon B (same namespace) parks x
(vB); its write_through copy replaces v1 in Redis (one manifest per id). A restarts: the
stub indexes v1 again, which Redis no longer serves. Before stubs a restart forgot v1 and a
lookup of x adopted vB. Now ``present(x)`` answers True (the index), a restore of x reads v1,
finds it replaced (``RemoteStore.read_blocks_into`` raises NotFound), ``remote_guard``
retires v1 and the restore answers NOT_FOUND; straight after, with no drop anywhere,
``present(x)`` answers True again and a restore serves vB. An answer of absence that does
not hold (docs/protocol.md: NOT_FOUND from restore is an answer of absence, durable).
(The same happens in one run when A's own index holds v1 remote-only; the stub carries it
over a restart, where a fresh lookup used to find vB.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import NotFound

from ..conftest import wait_until
from .test_remote_only_stubs import _evict_x_to_redis, _stubs
from .test_remote_tier import _new_ns, _own_dirs, _remote, blob


def _synced(c: Client) -> bool:
    r = c.stat().remote
    return r is not None and r.pending_writes == 0


def test_a_stub_of_a_version_another_daemon_replaced_never_answers_not_found_for_a_present_id(
        daemon: Callable[..., Daemon], redis_server, tmp_path: Path) -> None:
    ns = _new_ns()
    over_a = {"tiers.disk.capacity": "24MiB", "policy.flush_on_shutdown": "false",
              **_remote(redis_server.url, ns, write="on_evict")}
    a = daemon(**over_a)
    with Client(a.address, transport="inline") as ca:
        _evict_x_to_redis(ca)
    assert "x" in _stubs(a)
    a.stop(0.5)
    b = daemon(**_own_dirs(tmp_path, "b"), **_remote(redis_server.url, ns, write="write_through"))
    with Client(b.address, transport="inline") as cb:
        cb.park("x", [blob(7)], overwrite=True)  # B's index lacks x: a new version, copied to Redis
        assert wait_until(lambda: _synced(cb), timeout=30)
    a2 = daemon(**over_a)
    with Client(a2.address, transport="inline") as ca:
        before = ca.present(["x"])
        try:
            got: object = ca.restore("x")[0]
            first = "vB" if torch.equal(got, blob(7)) else "v1" if torch.equal(got, blob(1)) else "other"  # type: ignore[arg-type]
        except NotFound:
            first = "NOT_FOUND"
        after = ca.present(["x"])
    assert before == [True]
    assert first == "vB" or (first == "NOT_FOUND" and after == [False]), (
        f"present(x)={before}, then restore(x) -> {first}, then present(x)={after}: "
        "NOT_FOUND answered for an id Redis holds (another daemon's version)")
