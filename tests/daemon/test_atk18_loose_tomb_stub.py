"""Fresh-eyes attack 18 on remote-only stubs (3ab52da): the delete-landed path of a
version whose tombstone is in memory only (loose).

An overwrite of a remote-only x v1 whose tombstone write fails is acknowledged anyway
(``forget``: "an overwrite, visible already, is"); v1's stub stays, its tombstone is loose,
and ``settle`` answers UNAVAILABLE for x until v1's Redis delete lands. When it lands,
``_delete_later`` clears the loose mark first, then tries to remove the stub; if that
removal fails there is no durable tombstone to repair it at the next start
(``load_stubs`` removes only stubs of tombstoned versions) and nothing retries it in this
run. A drop of x (v2) then answers True, and after a crash the restart indexes v1 again
from its stub: ``present(x)`` True after an acknowledged drop (under write_through, where a
crash after an answered drop never brings a retired version back).
"""

from __future__ import annotations

from typing import Callable

import lmdb
import pytest

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.tiers.stubs import Stubs
from kvpark.tiers.tombs import Tombs

from ..conftest import wait_until
from .disk_seams import crash_image
from .test_remote_only_stubs import _evict_x_to_redis, _gen, _over, _stubs
from .test_remote_tier import blob


def test_an_acknowledged_drop_never_leaves_a_stub_of_the_replaced_version(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    over = _over(redis_server.url, **{"policy.write": "write_through"})
    d = daemon(**over)
    eng = d.engine
    assert eng is not None and eng.remote is not None
    original_add, original_remove = Tombs.add, Stubs.remove
    removals: list[int] = []

    def failing_add(self: Tombs, manifests) -> None:
        if any(m.seq_id == "x" for m in manifests):
            raise lmdb.Error("injected: EIO")
        original_add(self, manifests)

    def remove_fails_once(self: Stubs, m) -> None:
        if m.seq_id == "x" and not removals:
            removals.append(m.gen)
            raise lmdb.Error("injected: EIO (transient)")
        original_remove(self, m)

    with Client(d.address, transport="inline") as c:
        _evict_x_to_redis(c)
        v1 = _gen(d, "x")
        monkeypatch.setattr(Tombs, "add", failing_add)
        monkeypatch.setattr(Stubs, "remove", remove_fails_once)
        c.park("x", [blob(2)], overwrite=True)  # acknowledged; v1's tombstone is in memory only
        monkeypatch.setattr(Tombs, "add", original_add)
        # v1's Redis delete lands (the stub's removal after it fails once).
        assert wait_until(lambda: not eng.remote.loose(["x"]), timeout=30)
        assert wait_until(lambda: removals, timeout=30)
        assert c.drop("x") is True
        assert c.present(["x"]) == [False]
        image = crash_image(eng.disk, str(tmp_path / "crash"))
        left = _stubs(d).get("x")
    d.stop(0.5)
    monkeypatch.undo()
    d2 = daemon(**{**over, "tiers.disk.path": image})
    with Client(d2.address) as c:
        after = c.present(["x"])
    assert after == [False], (
        f"drop(x) answered True, the stub of x's replaced version {v1} stayed (stub on disk: {left}), and after "
        f"the crash present(x) = {after}")
