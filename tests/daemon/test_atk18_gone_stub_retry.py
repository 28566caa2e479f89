"""Fresh-eyes attack 18 on remote-only stubs (3ab52da): a version found gone from Redis
whose stub could not be removed.

``remote_guard`` retires the version from the index, tries to remove its stub, and when
that fails answers ``UNAVAILABLE`` ("ask again"). Nothing retries that removal: the
version was never tombstoned, so the delete-landed path (``_delete_later``) never runs
for it, and ``settle`` knows nothing of stubs. The client asks again as told: the id is no
longer in the index and Redis holds nothing, so the answer is NOT_FOUND (and ``present``
answers False), while the stub is still on disk. A crash (or a plain restart) then
indexes the version again from the stub: ``present`` answers True for an id whose absence
was answered. docs/protocol.md: absence answered must be durable.
"""

from __future__ import annotations

from typing import Callable

import lmdb
import pytest

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import NotFound, Unavailable
from kvpark.tiers.stubs import Stubs

from .disk_seams import crash_image
from .test_remote_only_stubs import _evict_x_to_redis, _over, _stubs


def _restore(c: Client, sid: str) -> object:
    try:
        return c.restore(sid)[0]
    except NotFound:
        return "NOT_FOUND"
    except Unavailable:
        return "UNAVAILABLE"


def test_absence_answered_after_a_failed_stub_removal_survives_a_crash(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    over = _over(redis_server.url)
    d = daemon(**over)
    eng = d.engine
    assert eng is not None and eng.remote is not None
    original = Stubs.remove
    failures = []

    def remove_fails_once(self: Stubs, m) -> None:
        if m.seq_id == "x" and not failures:
            failures.append(m.gen)
            raise lmdb.Error("injected: EIO (transient)")
        original(self, m)

    with Client(d.address, transport="inline") as c:
        _evict_x_to_redis(c)
        with eng.catalog.lock:
            m = eng.catalog.find("x").manifest
        eng.remote.store.delete(m)  # Redis loses x behind the daemon's back (TTL, maxmemory, ...)
        monkeypatch.setattr(Stubs, "remove", remove_fails_once)
        first = _restore(c, "x")  # the stub's removal fails once: UNAVAILABLE, "ask again"
        second = _restore(c, "x")  # asked again: every LMDB write works now
        absent = c.present(["x"])
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    left = "x" in _stubs(d)
    d.stop(0.5)
    monkeypatch.undo()
    d2 = daemon(**{**over, "tiers.disk.path": image})
    with Client(d2.address) as c:
        after = c.present(["x"])
    assert first == "UNAVAILABLE" and failures
    assert second == "NOT_FOUND" and absent == [False]
    assert after == [False] and not left, (
        f"restore(x) answered NOT_FOUND and present(x) False, yet x's stub stayed on disk (left={left}) and "
        f"after the crash present(x) = {after}: the absence answered was not durable")
