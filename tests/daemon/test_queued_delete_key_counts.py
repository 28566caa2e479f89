"""``Deletes`` counts the queued deletes of each (id, generation) (``_queued_n``). Two
can be queued under one key through real paths: a version dropped here only (its copy
in Redis stays) whose disk delete failed, and the same version adopted again from Redis
(its twin: the same generation) whose own disk eviction delete failed too. A fetch of
the twin back onto the disk takes the twin's entry over (``take_own``); the retired
version's entry stays queued, and its key must keep counting. Else ``settle`` (a drop's
answer of absence) unpublishes the retired version's manifest, marks it gone, and loses
the mark at once (its key counts as neither queued nor busy): it unpublishes again and
again, never answering. Found by mutation testing (``+ 1`` made ``// 1`` in
``Deletes._enqueue``). An unstarted engine: the test runs the passes itself (a retry
counts the queue afresh and would hide the bug by chance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpark.daemon import reads
from kvpark.daemon.disk_evict import disk_to_remote
from kvpark.daemon.engine import Engine
from kvpark.proto.errors import Unavailable

from ..conftest import make_config, wait_until
from .disk_seams import FailingDeletes, park_filled

MiB = 1 << 20



def test_a_takeover_by_the_twin_leaves_the_retired_versions_queued_delete_counted(
        tmp_path: Path, redis_server: Any) -> None:
    cfg = make_config(tmp_path, **{
        "policy.write": "write_through", "policy.promote_on_restore": "false",
        "tiers.remote.url": redis_server.url, "tiers.remote.namespace": "keycount",
        "tiers.remote.write": "write_through", "tiers.remote.timeout_s": 1.0})
    eng = Engine(cfg, disk_factory=FailingDeletes)
    disk = eng.disk
    assert isinstance(disk, FailingDeletes) and eng.remote is not None
    try:
        eng.remote.probe()
        park_filled(eng, "x", 1, MiB)
        s1 = eng.catalog.find("x")
        assert s1 is not None and s1.on_disk
        assert wait_until(lambda: eng.remote.stat(0).pending_writes == 0 and s1.on_remote, timeout=30)
        g = s1.gen

        # x dropped here only (Redis keeps it); its disk delete fails: queued (x, g).
        disk.fail_deletes = {g}
        try:
            eng.drop("x", everywhere=False)
        except Unavailable:
            pass
        assert eng.deletes.pending == 1

        # Adopted again from Redis: the twin, the same generation; fetched onto the disk.
        reads.adopt(eng, ["x"])
        s2 = eng.catalog.find("x")
        assert s2 is not None and s2 is not s1 and s2.gen == g and s2.on_remote
        disk.fail_deletes = set()
        eng.mover.fetch_remote(s2)
        assert s2.on_disk

        # The twin's disk copy is evicted (Redis keeps it); its delete fails: a second
        # queued delete under the same (x, g).
        disk.fail_deletes = {g}
        assert disk_to_remote(eng.mover, s2)
        assert not s2.on_disk and eng.deletes.pending == 2

        # Fetched back: the twin's own entry is taken over (and lands); s1's stays queued.
        disk.fail_deletes = set()
        eng.mover.fetch_remote(s2)
        assert s2.on_disk and eng.deletes.pending == 1

        # The drop deletes the twin's copy, and its settle unpublishes s1's manifest once.
        disk.unpublished.clear()
        disk.unpublish_budget = 1
        try:
            answer: object = eng.drop("x", everywhere=False)
        except Unavailable as e:
            answer = e
        assert answer is True, (
            f"drop(x) answered {answer!r}: its settle unpublished generations {disk.unpublished} "
            f"(once is enough: the manifest is known gone while s1's delete stays queued)")
        assert disk.unpublished == [g]
        disk.unpublish_budget = None
        assert eng.catalog.find("x") is None  # dropped here only: Redis still has x
        eng.deletes.retry()
        assert eng.deletes.pending == 0
        eng.check_invariants()
    finally:
        eng.close(flush=False)
