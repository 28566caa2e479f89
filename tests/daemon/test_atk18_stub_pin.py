"""Fresh-eyes attack 18 on remote-only stubs (3ab52da): a pin of a version only Redis holds.

The stub is the version's manifest as the eviction saw it (``RemoteTier.stub``); at start
it is what the index holds of the version (``load_stubs`` -> ``catalog.adopt``). A pin (or
an unpin) acknowledged after the eviction changes only the in-memory manifest:
``Engine.pin`` writes the manifest to disk only ``if on_disk``, and nothing rewrites the
stub. So a restart, even a clean stop, indexes the version with the pin it had before the
acknowledged pin. docs/protocol.md (pin): a pin held in memory only "would be lost at a
crash. Not acknowledged, not applied." Here it is acknowledged, and lost at any restart.
"""

from __future__ import annotations

from typing import Callable

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from .test_remote_only_stubs import _evict_x_to_redis, _over, _stubs


def test_a_pin_of_a_remote_only_version_survives_a_restart(daemon: Callable[..., Daemon], redis_server) -> None:
    over = _over(redis_server.url)
    d = daemon(**over)
    with Client(d.address, transport="inline") as c:
        _evict_x_to_redis(c)
        info = c.pin("x")
        assert info.pinned and info.tier == "remote"
    assert "x" in _stubs(d)
    d.stop(0.5)  # a clean stop
    d2 = daemon(**over)
    assert d2.engine is not None
    with d2.engine.catalog.lock:
        seq = d2.engine.catalog.find("x")
        assert seq is not None and seq.on_remote and not seq.on_disk  # indexed again from the stub
        pinned = seq.pinned
    assert pinned, "pin(x) was acknowledged (pinned=True), yet the restart indexed x from its stub unpinned"
