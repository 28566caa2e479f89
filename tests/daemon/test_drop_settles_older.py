"""A drop answers only once no older version of its id can come back: under write_back an
overwrite leaves the new version in memory and deletes the old one's disk copy; when
that delete fails (queued for the retry), the old manifest is still in LMDB. A drop of
the new version that answered then, and a SIGKILL before the retry, brought the old
version back: an acknowledged drop undone, with bytes the client had replaced. Found
while closing "absence before it is durable" (docs/protocol.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from .disk_seams import crash_image
from .test_evict_retry_race import MiB, Seam, full, seam  # noqa: F401 (the fixture)


def test_a_drop_after_an_overwrite_whose_old_delete_failed_never_brings_the_old_version_back(
        daemon: Callable[..., Daemon], seam: type[Seam], tmp_path: Path) -> None:
    d = daemon(disk_factory=seam, **{"policy.write": "write_back", "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 1)])
        assert c.flush() >= 1  # v1 on disk
        seam.fail = True  # deletes of x's block records fail from now on (the retry's too)
        c.park("x", [full(MiB, 2)], overwrite=True)  # v2 in memory; v1's disk delete fails: queued
        assert eng.deletes.pending >= 1
        assert c.drop("x") is True
        image = crash_image(eng.disk, str(tmp_path / "crash"))  # SIGKILL right after the answer
    seam.fail = False
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c2:
        after = c2.present(["x"])
        got = c2.restore("x") if after == [True] else None
    assert after == [False], f"drop(x) answered True; after a crash x is back, restoring {got and got[0][:4]}"
