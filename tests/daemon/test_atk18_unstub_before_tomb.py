"""Fresh-eyes attack 18 on remote-only stubs (3ab52da): ``finish_drop`` removes the stub
before (without) the tombstone.

docs/protocol.md: the stub "goes when its version leaves the index for good: with the
tombstone (after the tombstone is on disk ...)". ``RemoteTier.forget`` keeps that order
(``_unstub`` only once ``Tombs.add`` succeeded), but ``maintenance.finish_drop`` then
calls ``engine.remote.unstub`` on every retired version unconditionally ("covers
local-only drops"), so a drop whose tombstone write failed (answered UNAVAILABLE, not
acknowledged) has removed the stub anyway. If its Redis delete has not landed when the
daemon dies, the restart finds neither stub nor tombstone: the version is in Redis,
unindexed, and the gap the stubs were made to close (test_atk17_redis_older_version)
is open again: an overwrite publishes over nothing, a drop of the new version answers
True, and ``present``/restore find the old version, with the bytes the client replaced.
"""

from __future__ import annotations

from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import NotFound, Unavailable
from kvpark.tiers.tombs import Tombs

from .disk_seams import crash_image
from .test_remote_only_stubs import _evict_x_to_redis, _over, _stubs
from .test_remote_tier import blob


def test_a_drop_whose_tombstone_failed_keeps_the_stub_so_the_old_version_is_never_adopted_back(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    over = _over(redis_server.url)
    d = daemon(**over)
    eng = d.engine
    assert eng is not None and eng.remote is not None
    original_add = Tombs.add

    def failing_add(self: Tombs, manifests) -> None:
        if any(m.seq_id == "x" for m in manifests):
            raise lmdb.Error("injected: EIO")
        original_add(self, manifests)

    def never(self, m) -> None:
        raise Unavailable("test: Redis is away; this delete never lands")

    with Client(d.address, transport="inline") as c:
        _evict_x_to_redis(c)
        monkeypatch.setattr(Tombs, "add", failing_add)
        monkeypatch.setattr(type(eng.remote.store), "delete", never)
        with pytest.raises(Unavailable):
            c.drop("x")  # not acknowledged: its tombstone is in memory only
        image = crash_image(eng.disk, str(tmp_path / "crash"))  # the SIGKILL, x's delete never landed
        stub_left = "x" in _stubs(d)
    d.stop(0.5)
    monkeypatch.undo()
    d2 = daemon(**{**over, "tiers.disk.path": image})
    with Client(d2.address, transport="inline") as c:
        c.park("x", [blob(2)], overwrite=True)
        assert torch.equal(c.restore("x")[0], blob(2))
        assert c.drop("x") is True
        after = c.present(["x"])
        try:
            got: object = c.restore("x")[0]
            back = "v1 (the replaced bytes)" if torch.equal(got, blob(1)) else "other bytes"  # type: ignore[arg-type]
        except NotFound:
            back = "NOT_FOUND"
    assert after == [False] and back == "NOT_FOUND", (
        f"stub kept after the failed drop: {stub_left}. After the crash, overwrite and drop(x) -> True, "
        f"present(x)={after} and restore(x) -> {back}")
