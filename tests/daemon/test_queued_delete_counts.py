"""``Deletes`` counts, per id, the queued deletes of its versions (``_ids_queued``), and
``settle`` (run before any answer of absence: a drop, ``present`` False, NOT_FOUND) looks
only at ids that count shows. A writer that takes over its own sequence's queued delete
(``take_own``: a flush writing again a disk copy whose eviction delete failed) takes one
off that count. The id must keep counting while another version's delete is still
queued, or the next answer of absence skips that delete's manifest: it does not try to
delete it, and answers even when deleting it would fail. Found by mutation testing
(``+ 1`` made ``- 1`` in ``Deletes._enqueue``: two queued deletes of "x", the writer takes
one, and "x" no longer counted at all).

A real engine with real LMDB in a temp dir. Its maintenance thread is not started: the
test runs the passes itself (flushes, the retry), so no retry re-queues everything
between the takeover and the drop (a retry counts the queue afresh, and would hide the
planted bug by chance). Faults come from ``disk_seams.FailingDeletes``: deletes of chosen
generations of "x" fail as a disk error would (inside the transaction), and so do
unpublishes of a chosen generation of "x".
"""

from __future__ import annotations

from pathlib import Path

from kvpark.daemon.disk_evict import disk_drop
from kvpark.daemon.engine import Engine
from kvpark.proto.errors import Unavailable

from ..conftest import make_config
from .disk_seams import FailingDeletes, crash_image, park_filled

MiB = 1 << 20
OVER = {"policy.write": "write_back", "policy.flush_on_shutdown": "false"}


def test_a_takeover_of_one_queued_delete_leaves_the_ids_other_queued_delete_to_the_drops_settle(
        tmp_path: Path) -> None:
    """write_back. v1 of x is flushed; an overwrite by v2 retires it and v1's delete fails
    (queued). v2 is flushed, then evicted from disk (still in memory) and that delete
    fails too (queued, v2's own): two queued deletes of x. A flush writes v2's disk copy
    again, taking v2's queued delete over; v1's stays queued. A drop of x must then try to
    delete v1's manifest before it answers, and, that unpublish failing, answer
    UNAVAILABLE, not that x is gone. Once the disk works the drop is answered, and x
    stays gone, after a crash too."""
    eng = Engine(make_config(tmp_path, **OVER), disk_factory=FailingDeletes)
    disk = eng.disk
    assert isinstance(disk, FailingDeletes)
    try:
        park_filled(eng, "x", 1, MiB)
        assert eng.flush() == 1
        v1 = eng.catalog.find("x")
        assert v1 is not None and v1.on_disk

        disk.fail_deletes = {v1.gen}  # v1's delete fails from now on (the retry's too)
        park_filled(eng, "x", 2, MiB, overwrite=True)  # v2 in memory; v1 retired, its delete queued
        v2 = eng.catalog.find("x")
        assert v2 is not None and v2 is not v1 and v2.gen != v1.gen
        assert eng.deletes.pending == 1
        assert eng.flush() == 1 and v2.on_disk

        disk.fail_deletes = {v1.gen, v2.gen}
        assert disk_drop(eng.mover, "x")  # v2 leaves the disk (kept in memory); its delete fails
        assert not v2.on_disk and v2.res and eng.deletes.pending == 2  # two queued deletes of x

        disk.fail_deletes = {v1.gen}
        assert eng.flush() == 1 and v2.on_disk  # the flush took v2's queued delete over
        assert eng.deletes.pending == 1  # v1's is still queued

        disk.fail_unpublish = {v1.gen}
        disk.unpublished.clear()
        try:
            answer: object = eng.drop("x")
        except Unavailable as e:
            answer = e
        assert isinstance(answer, Unavailable), (
            f"drop(x) answered {answer!r} with v1's delete still queued, without deleting v1's manifest "
            f"first (unpublishes of x tried: generations {disk.unpublished}; v1 is {v1.gen})")
        assert v1.gen in disk.unpublished

        disk.fail_unpublish = set()
        disk.fail_deletes = set()
        assert eng.drop("x") is False  # asked again: dropped already, absence durable now
        assert eng.present(["x"]) == [False]
        assert eng.deletes.retry() >= 1 and eng.deletes.pending == 0
        eng.check_invariants()
        image = crash_image(disk, str(tmp_path / "crash"))  # a SIGKILL now
    finally:
        eng.close(flush=False)
    cfg = make_config(tmp_path, **{**OVER, "tiers.disk.path": image})
    eng2 = Engine(cfg)
    try:
        assert eng2.present(["x"]) == [False]
        assert "x" not in eng2.disk.scan().manifests
    finally:
        eng2.close(flush=False)
