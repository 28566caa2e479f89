"""A delete of one id takes with it the refused manifests of that id only. A refused
write whose undo failed (``Deletes._reverts``) may still own its id's current manifest,
so a delete of another version of the same id unpublishes it before the caller answers
(``Deletes.delete``). A refused write of ANOTHER id is none of its business: its manifest
stands in LMDB until its queued undo (``retry``) puts back the version it replaced. Were
that manifest unpublished by a drop of an unrelated id, the undo would find no manifest
of the refused generation current and put nothing back: the version standing before the
refused write (acknowledged under write_through) would have no manifest in LMDB, and a
restart would lose it. Found by mutation testing (``sid == seq.seq_id`` made
``sid <= seq.seq_id`` in ``Deletes.delete``: a drop of "z" unpublished the refused
manifest of "m"). Ids sorting on both sides of "m" are dropped, so any ordering
comparison in place of ``==`` fails too.

A real engine with real LMDB in a temp dir. Its maintenance thread is not started: the
test runs the retry itself, so no maintenance pass runs the queued undo before the drops
(which would leave nothing in ``_reverts`` and hide the planted bug by chance). Faults
come from a ``DiskStore`` subclass: one fsync fails (the refusal), and one write
transaction deleting block records of "m" (the refusal's undo) fails and rolls back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import lmdb
import pytest

from kvpark.client import Client
from kvpark.daemon.engine import Engine
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import KVParkError
from kvpark.tiers.disk import DiskStore, Manifest

from ..conftest import make_config
from .disk_seams import crash_image, park_filled

N = 4096
WT = {"policy.write": "write_through"}


class Faults(DiskStore):
    """``fail_sync``: the next fsync fails (EIO). ``fail_undo``: the next write transaction
    deleting block records of "m" fails (EIO) and is rolled back. Each fires once."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.fail_sync = False
        self.fail_undo = False

    def sync(self) -> None:
        if self.fail_sync:
            self.fail_sync = False
            raise lmdb.Error("mdb_env_sync: Input/output error")
        super().sync()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        if self.fail_undo and m.seq_id == "m":
            self.fail_undo = False
            raise lmdb.Error("mdb_put: Input/output error")
        super()._delete_blocks(txn, m)

    def current(self, seq_id: str) -> int | None:
        """The generation of ``seq_id``'s manifest in LMDB now, if any."""
        m = self.scan().manifests.get(seq_id)
        return None if m is None else m.gen


def _refused_overwrite(eng: Engine) -> tuple[Faults, int, int]:
    """"m" v1 acknowledged (on disk); an overwrite (v2) committed, its fsync failed
    (refused) and its undo failed too: queued, v2's manifest current in LMDB. Returns
    the disk, v1's generation and the refused one."""
    disk = eng.disk
    assert isinstance(disk, Faults)
    park_filled(eng, "m", 1, N)
    seq = eng.catalog.find("m")
    assert seq is not None and seq.on_disk and disk.current("m") == seq.gen
    v1 = seq.gen
    disk.fail_sync = disk.fail_undo = True
    with pytest.raises(KVParkError):
        park_filled(eng, "m", 2, N, overwrite=True)  # refused; its undo failed and is queued
    assert not disk.fail_sync and not disk.fail_undo, "the refusal or its undo never ran"
    assert eng.deletes.pending == 1
    refused = disk.current("m")
    assert refused is not None and refused != v1, "the refused write's manifest is not the current one"
    return disk, v1, refused


def test_a_drop_of_another_id_leaves_a_refused_manifest_to_its_own_queued_undo(
        tmp_path: Path, daemon: Callable[..., Daemon]) -> None:
    """write_through. "m" v1 is acknowledged (on disk). An overwrite of "m" (v2) commits
    its transaction, its fsync fails (refused) and its undo fails too: queued, v2's
    manifest still current in LMDB. "a" and "z" (sorting before and after "m") are parked
    and dropped. Neither drop may touch "m"'s refused manifest: the retry of "m"'s undo
    then finds it current and puts v1's back, and after a crash "m" restores v1 and "a"
    and "z" are gone. (Were it unpublished, the undo would put nothing back: "m" indexed
    on disk with no manifest in LMDB, and gone at the next start.)"""
    eng = Engine(make_config(tmp_path, **WT), disk_factory=Faults)
    try:
        disk, v1, refused = _refused_overwrite(eng)

        after_drop: dict[str, int | None] = {}
        for other, v in (("a", 3), ("z", 4)):
            park_filled(eng, other, v, N)
            s = eng.catalog.find(other)
            assert s is not None and s.on_disk
            assert eng.drop(other)  # acknowledged
            after_drop[other] = disk.current("m")  # still the refused manifest: "m"'s undo owns it

        assert eng.deletes.retry() == 1 and eng.deletes.pending == 0  # "m"'s undo, the disk healthy
        after_undo = disk.current("m")
        try:
            eng.check_invariants()
            broken = ""
        except AssertionError as e:
            broken = str(e)
        image = crash_image(disk, str(tmp_path / "crash"))  # a SIGKILL now
    finally:
        eng.close(flush=False)

    d = daemon(**{"tiers.disk.path": image, **WT})
    with Client(d.address) as c:
        present = c.present(["a", "m", "z"])
        got = [int(t[0]) for t in c.restore("m")] if present[1] else None
    seen = (after_drop, after_undo, broken, present, got)
    assert seen == ({"a": refused, "z": refused}, v1, "", [False, True, False], [1]), (
        f"'m' v1 (generation {v1}, acknowledged under write_through) lost: the manifest of 'm' in LMDB "
        f"after each drop is {after_drop} (the refused one is {refused}); after the undo {after_undo}; "
        f"invariants: {broken!r}; after a crash present(a, m, z) = {present}, 'm' restores {got}")


def test_a_drop_of_the_same_id_takes_its_refused_manifest_with_it(
        tmp_path: Path, daemon: Callable[..., Daemon]) -> None:
    """The other half of the scope: write_through, "m" v1 acknowledged; an overwrite (v2)
    refused with its undo queued, v2's manifest current in LMDB. A drop of "m" (v1, the
    version the index holds) is acknowledged: v2's refused manifest goes with it before
    the answer. Left there, the queued undo would find it current and put v1's back, and
    the dropped "m" would be restored after a crash (or v2's refused bytes, had the crash
    come first). Written for the mutant ``g != seq.gen`` -> ``g == seq.gen`` in
    ``Deletes.delete``; it does not kill it: the drop's ``settle`` unpublishes the
    refused manifest too (docs/testing.md)."""
    eng = Engine(make_config(tmp_path, **WT), disk_factory=Faults)
    try:
        disk, v1, refused = _refused_overwrite(eng)

        assert eng.drop("m")  # acknowledged
        after_drop = disk.current("m")
        eng.deletes.retry()  # the queued undo, the disk healthy
        after_undo = disk.current("m")
        image = crash_image(disk, str(tmp_path / "crash"))  # a SIGKILL now
    finally:
        eng.close(flush=False)

    d = daemon(**{"tiers.disk.path": image, **WT})
    with Client(d.address) as c:
        present = c.present(["m"])
    assert (after_drop, after_undo, present) == (None, None, [False]), (
        f"'m' dropped (acknowledged) came back: its manifest in LMDB after the drop is generation {after_drop} "
        f"(the refused one is {refused}, v1 {v1}); after the undo {after_undo}; after a crash present = {present}")


def test_a_disk_eviction_of_the_same_id_takes_its_refused_manifest_with_it(
        tmp_path: Path, daemon: Callable[..., Daemon]) -> None:
    """Where the scope of the same id is needed: write_through, no remote tier, "m" v1
    acknowledged; an overwrite (v2) refused with its undo queued, v2's manifest current
    in LMDB. The disk then evicts "m" (``disk_full = "evict"``): v1's records are
    deleted, and v2's refused manifest must go with them: left there until the undo runs,
    a crash in between shows "m" as v2, the write its client was told had failed. Both
    crash points are checked. Killed: ``g != seq.gen`` made ``g == seq.gen`` in
    ``Deletes.delete`` (found by mutation testing)."""
    from kvpark.daemon.disk_evict import disk_drop

    eng = Engine(make_config(tmp_path, **WT, **{"policy.disk_full": "evict"}), disk_factory=Faults)
    try:
        disk, v1, refused = _refused_overwrite(eng)

        assert disk_drop(eng.mover, "m"), "the eviction did not take the disk copy"
        after_evict = disk.current("m")
        early = crash_image(disk, str(tmp_path / "crash-early"))  # a SIGKILL before the undo
        eng.deletes.retry()  # the queued undo, the disk healthy
        after_undo = disk.current("m")
        image = crash_image(disk, str(tmp_path / "crash"))  # a SIGKILL now
    finally:
        eng.close(flush=False)

    present = []
    for path in (early, image):
        d = daemon(**{"tiers.disk.path": path, **WT})
        with Client(d.address) as c:
            present += c.present(["m"])
        d.stop()
    assert (after_evict, after_undo, present) == (None, None, [False, False]), (
        f"'m' evicted from disk: its manifest in LMDB after the eviction is generation {after_evict} (the refused "
        f"one is {refused}, v1 {v1}); after the undo {after_undo}; after a crash before and after the undo, "
        f"present = {present}")
