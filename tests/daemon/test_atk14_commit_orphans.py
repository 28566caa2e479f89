"""Fresh-eyes attack on 4f5a4df (absence answered only once durable): an overwrite that
leaves a shared block without users retires the block at its publish
(``Catalog.publish_commit`` / ``take_orphans``) but does not ``Deletes.claim`` it, and
``commit.py`` deletes ``gone + orphans`` with ``delete_all(..., claimed=False)`` (so does
``window.py`` for windowed parks). Until the block's own delete begins, an answer of
absence for the block waits for nothing: ``present`` says False while the block's
manifest is still in LMDB, and a SIGKILL right then brings it back."""

from __future__ import annotations

import threading
from typing import Callable

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from .disk_seams import crash_image
from .test_atk14_unsettled_notfound import HeldDelete, _present_after_crash, _reset, _settled_or_answered, full


def test_present_of_a_shared_block_an_overwrite_just_orphaned_waits_for_its_delete(
        daemon: Callable[..., Daemon], tmp_path) -> None:
    """write_through. "x" references shared block "b" (its only user). An overwrite of x
    without refs publishes and retires x's old version and b; its ``delete_all`` deletes
    x's old version first (held here at its disk delete), b's not begun. Another client
    asks ``present(["b"])``: [False] at once. SIGKILL right then: b is parked again."""
    _reset()
    d = daemon(disk_factory=HeldDelete, **{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    out: dict = {}
    try:
        with Client(d.address) as c, Client(d.address) as c2:
            c.park("x", [full(4096, 1)], refs=["b"], new_blocks={"b": [full(4096, 2)]})
            assert c.present(["x", "b"]) == [True, True]
            HeldDelete.suffix = "x"  # the overwrite's delete of x's old version waits
            t = threading.Thread(target=lambda: c.park("x", [full(4096, 3)], overwrite=True, timeout=60))
            t.start()
            assert HeldDelete.entered.wait(30), "the overwrite never reached the delete of x's old version"

            def ask() -> None:
                try:
                    out["answer"] = c2.present(["b"], timeout=60)
                except BaseException as e:  # noqa: BLE001
                    out["answer"] = e
                out["image"] = crash_image(eng.disk, str(tmp_path / "crash"))

            a = threading.Thread(target=ask)
            a.start()
            _settled_or_answered(out)
            HeldDelete.gate.set()
            a.join(60)
            t.join(60)
    finally:
        HeldDelete.gate.set()
        _reset()
    d.stop(0.5)
    after = _present_after_crash(daemon, out["image"], "b")
    assert out["answer"] == [False], out["answer"]
    assert after == [False], (
        f"present(b) answered {out['answer']!r} while the overwrite that orphaned b was still deleting; after a "
        f"SIGKILL right then present(b)={after}: b came back")
