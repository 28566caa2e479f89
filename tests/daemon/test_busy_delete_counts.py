"""``Deletes`` counts the deletes under way of each (id, generation) per id
(``_ids_busy``): ``settle`` waits while an id has one whose manifest may still be in
LMDB. Two can be under way under one key through real paths: an answer of absence
(``settle``) unpublishing the manifest a failed delete left queued, and the maintenance
``retry`` taking the same queued entry and deleting it meanwhile. When the settle's
unpublish fails, the retry's delete is still under way with the manifest in LMDB: a
second answer of absence must wait for it (``Unavailable`` here, its wait cut short),
never answer that the id is gone (a crash would bring it back). Found by mutation
testing (``+ 1`` made ``% 1`` in ``Deletes._busy_add``: the first delete to finish
dropped the key). An unstarted engine: the test runs the passes itself."""

from __future__ import annotations

import threading
from pathlib import Path

import lmdb
import pytest

from kvpark.daemon import deletes as deletes_mod
from kvpark.daemon.engine import Engine
from kvpark.proto.errors import Unavailable
from kvpark.tiers.disk import DiskStore, Manifest

from ..conftest import make_config, wait_until
from .disk_seams import park_filled, waiting_in

MiB = 1 << 20


class Gates(DiskStore):
    """Deletes of "x" fail while ``fail_deletes``; unpublishes of "x" fail while
    ``fail_unpublish``. ``hold_unpublish`` / ``hold_delete``: the next one of "x" waits at
    its gate (``*_entered`` set) before any transaction, then goes on as configured."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.fail_deletes = False
        self.fail_unpublish = False
        self.hold_unpublish = False
        self.hold_delete = False
        self.unpublish_entered = threading.Event()
        self.unpublish_gate = threading.Event()
        self.delete_entered = threading.Event()
        self.delete_gate = threading.Event()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        if m.seq_id == "x" and self.fail_deletes:
            raise lmdb.Error("injected: EIO")
        super()._delete_blocks(txn, m)

    def delete(self, m: Manifest, sync: bool = False) -> None:
        if m.seq_id == "x" and self.hold_delete:
            self.hold_delete = False
            self.delete_entered.set()
            assert self.delete_gate.wait(60), "the test never opened the gate"
        super().delete(m, sync=sync)

    def unpublish(self, m: Manifest, sync: bool = False) -> None:
        if m.seq_id == "x":
            if self.hold_unpublish:
                self.hold_unpublish = False
                self.unpublish_entered.set()
                assert self.unpublish_gate.wait(60), "the test never opened the gate"
            if self.fail_unpublish:
                raise self._write_error(lmdb.Error("injected: EIO"))
        super().unpublish(m, sync=sync)

    def committed(self) -> dict[str, int]:
        """Every manifest LMDB holds now (committed transactions), by id."""
        with self.env.begin() as txn:
            db = self.env.open_db(b"manifests", txn=txn, create=False)
            return {bytes(k).decode(): Manifest.decode(v).gen for k, v in txn.cursor(db=db)}



def test_absence_waits_for_a_retry_under_way_after_a_failed_settle_of_the_same_generation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(tmp_path, **{"policy.write": "write_through"})
    eng = Engine(cfg, disk_factory=Gates)
    disk = eng.disk
    assert isinstance(disk, Gates)
    threads: list[threading.Thread] = []
    try:
        park_filled(eng, "x", 1, MiB)
        s1 = eng.catalog.find("x")
        assert s1 is not None and s1.on_disk
        g = s1.gen

        # x dropped; its disk delete fails, and so does the drop's settle: the delete of
        # (x, g) is queued, its manifest still in LMDB.
        disk.fail_deletes = True
        disk.fail_unpublish = True
        with pytest.raises(Unavailable):
            eng.drop("x")
        assert eng.deletes.pending == 1 and disk.committed().get("x") == g
        disk.fail_deletes = False

        # A question of absence: its settle unpublishes (x, g), held, then fails.
        disk.hold_unpublish = True
        out_a: list[object] = []

        def ask_a() -> None:
            try:
                out_a.append(eng.present(["x"]))
            except Exception as e:  # noqa: BLE001
                out_a.append(e)

        threads.append(threading.Thread(target=ask_a, daemon=True))
        threads[-1].start()
        assert disk.unpublish_entered.wait(30)

        # The maintenance retry takes the same queued entry: its delete of (x, g), held.
        disk.hold_delete = True
        out_r: list[object] = []
        threads.append(threading.Thread(target=lambda: out_r.append(eng.deletes.retry()), daemon=True))
        threads[-1].start()
        assert disk.delete_entered.wait(30)

        # The settle's unpublish fails: not durable, it says so.
        disk.unpublish_gate.set()
        threads[0].join(30)
        assert len(out_a) == 1 and isinstance(out_a[0], Unavailable), out_a
        disk.fail_unpublish = False

        # The retry's delete of (x, g) is still under way, the manifest in LMDB: another
        # question of absence waits for it (cut short here), never answers "gone".
        assert disk.committed().get("x") == g
        monkeypatch.setattr(deletes_mod, "SETTLE_WAIT_S", 0.5)
        try:
            answer: object = eng.present(["x"])
        except Unavailable as e:
            answer = e
        assert isinstance(answer, Unavailable), (
            f"present(x) answered {answer!r} while a delete of (x, {g}) was under way and its manifest "
            f"still in LMDB ({disk.committed()}): a crash now would bring x back")

        # Once the retry's delete lands, absence is the answer at once.
        monkeypatch.setattr(deletes_mod, "SETTLE_WAIT_S", 30.0)
        out_b: list[object] = []
        threads.append(threading.Thread(target=lambda: out_b.append(eng.present(["x"])), daemon=True))
        threads[-1].start()
        assert wait_until(lambda: waiting_in("settle", "deletes.py") or bool(out_b), timeout=30)
        disk.delete_gate.set()
        threads[1].join(30)
        threads[2].join(30)
        assert out_r == [1] and out_b == [[False]]
        assert "x" not in disk.committed()
        assert eng.deletes.pending == 0
        eng.check_invariants()
    finally:
        disk.unpublish_gate.set()
        disk.delete_gate.set()
        for t in threads:
            t.join(30)
        eng.close(flush=False)
