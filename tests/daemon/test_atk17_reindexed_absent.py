"""Fresh-eyes attack 17 on "absence is durable when it is answered" (4f5a4df..66b748e):
``Engine.absent`` settles only the ids the index lacks *when it looks*, after the
``NotFound`` was raised, not the ids that were absent when the answer was decided.

Under ``write_back``, x v1 is on disk. Drop A retires x and is held in its disk delete
(a slow disk). A restore of x finds nothing and raises ``NotFound``; before ``absent``
looks, a create of x (v2, memory only: under ``write_back`` a create does not wait for
anything of the id) publishes. ``absent`` then sees x indexed, settles nothing, and the
restore answers NOT_FOUND at once while v1's manifest is still in LMDB. A SIGKILL right
after that answer: the restart indexes v1 again, after an answer that x was gone (v2,
never on disk, is lost as write_back allows; v1 must not come back). The test holds the
restore at the point where it has decided on NOT_FOUND (``reads.replaced`` returned
False) while the create lands: a thread preempted there."""

from __future__ import annotations

import threading
from typing import Callable

import pytest

from kvpark.client import Client
from kvpark.daemon import reads
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import NotFound

from .test_absence_before_durable import HeldUnpublish, answer_then_crash, held, settle_or_answer  # noqa: F401
from .test_evict_retry_race import Seam, full

MiB = 1 << 20


def test_a_restore_answered_not_found_while_a_create_of_the_id_lands_never_sees_the_dropped_version_back(
        daemon: Callable[..., Daemon], held: type[HeldUnpublish], tmp_path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    over = {"policy.write": "write_back", "policy.flush_on_shutdown": "false", "policy.max_dirty_s": 3600}
    d = daemon(disk_factory=held, **over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c, Client(d.address) as c2, Client(d.address) as c3:
        c.park("x", [full(MiB, 1)])
        assert c.flush() >= 1  # x v1 on disk
        assert eng.catalog.find("x").on_disk
        Seam.del_hold = True
        a = threading.Thread(target=lambda: c.drop("x", timeout=30))
        a.start()
        assert Seam.del_entered.wait(30), "drop A never reached its disk delete"

        original = reads.replaced
        created: dict = {}

        def preempted(engine, tops):  # the restore has decided: NOT_FOUND. A create lands now.
            r = original(engine, tops)
            if not r and not created:
                created["info"] = c3.park("x", [full(MiB, 2)], timeout=30)
            return r

        monkeypatch.setattr(reads, "replaced", preempted)
        b, out = answer_then_crash(eng, lambda: c2.restore("x", timeout=30), str(tmp_path / "crash"))
        settle_or_answer(b)  # a fixed daemon waits for drop A's delete: released below
        answered_early = not b.is_alive()
        Seam.del_gate.set()
        b.join(60)
        a.join(30)
    assert created, "the create never ran"
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": out["image"], "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c4:
        after = c4.present(["x"])
        back = c4.restore("x")[0] if after == [True] else None
    v1 = back is not None and bool((back == 1).all())
    assert not (isinstance(out["answer"], NotFound) and after == [True]), (
        f"restore(x) answered {out['answer']!r} ({'at once, during' if answered_early else 'after'} drop A's "
        f"delete); a crash right after it brings x back ({'v1, the dropped bytes' if v1 else 'present'})")
