"""The same through a fetch from Redis onto disk (``fetch_remote_locked``): a drop
acknowledged while the fetch has taken over x's queued (failed) disk-eviction delete
deletes the old manifest before it answers; a crash never brings the dropped x back.
Found by a fresh-eyes attack."""

from __future__ import annotations

import threading
from typing import Callable

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from .disk_seams import crash_image
from .test_evict_retry_race import Seam, full, seam  # noqa: F401 (fixture)

MiB = 1 << 20


def test_drop_during_taken_over_fetch_leaves_old_manifest(
        daemon: Callable[..., Daemon], seam: type[Seam], redis_server, tmp_path) -> None:  # noqa: F811
    from kvpark.daemon.disk_evict import disk_to_remote

    from .test_remote_tier import _new_ns, _remote

    over = {"policy.promote_on_restore": "false", "policy.flush_on_shutdown": "false",
            **_remote(redis_server.url, _new_ns(), write="on_evict")}
    d = daemon(disk_factory=seam, **over)
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
        c.flush()
        assert eng.mover.demote("x", "host")  # its only copy on disk
        seam.fail = True  # deletes of x's records fail from now on (writes work)
        disk_to_remote(eng.mover, "x")  # copied to Redis; the disk delete failed: queued
        assert eng.deletes.pending >= 1 and c.info("x").tier == "remote"
        seq = eng.catalog.find("x")
        assert seq is not None
        seam.w_hold = True
        errs: list[BaseException] = []

        def fetch() -> None:
            try:
                eng.mover.fetch_remote(seq)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        t = threading.Thread(target=fetch)
        t.start()
        assert seam.w_entered.wait(30)  # the fetch took x's queued delete over, its write held
        dropped = c.drop("x", timeout=20)
        seam.w_gate.set()
        t.join(30)
        present_now = c.present(["x"])
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    seam.fail = False
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c2:
        after = c2.present(["x"])
    assert dropped and present_now == [False] and after == [False], (
        f"drop(x)={dropped} (acknowledged), fetch errors={errs}, present before crash={present_now}; "
        f"after a crash present(x)={after}: the dropped sequence came back")
