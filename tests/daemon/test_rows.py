"""The columnar index: parked sequences nobody uses are kept as rows of typed columns
(``daemon/rows.py``), made ``Seq`` records again on lookup, and frozen back only when
nothing but the index holds them."""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon import maintenance, reads
from kvpark.daemon.catalog import Catalog
from kvpark.daemon.engine import Engine
from kvpark.daemon.model import Seq
from kvpark.daemon.rows import Rows
from kvpark.daemon.server import Daemon
from kvpark.proto.layout import TensorMeta
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import Manifest

from ..conftest import make_config, wait_until
from ..redis_servers import RedisServer

SLOT = 64 * 1024


def _manifest(sid: str = "a", gen: int = 7 << 24 | 5, expires: float | None = None, nbytes: int = 3000) -> Manifest:
    t = (TensorMeta(dtype="int8", shape=(nbytes,), nbytes=nbytes),)
    return Manifest(sid, gen, t, nbytes, 1 << 20, 0x1234, priority=2, created_at=1000.25, last_access=1001.5,
                    expires_at=expires, attrs={"m": "x"})


def _same(a: Seq, b: Seq) -> None:
    assert a.manifest == b.manifest
    assert dict(a.res) == dict(b.res)
    assert (a.on_disk, a.on_remote, a.dropped, a.moving) == (b.on_disk, b.on_remote, b.dropped, b.moving)
    assert (a.access_count, a.promotions, a.dirty_since) == (b.access_count, b.promotions, b.dirty_since)


def test_a_frozen_sequence_thaws_equal_to_what_was_frozen() -> None:
    rows = Rows({"host": SLOT, "device": SLOT})
    tail = Allocation(SLOT, (), (3, 5, 2, 3000))
    big = Allocation(SLOT, (4, 5, 9), (6, 0, 1, 17))
    cases = [
        Seq(_manifest("tail"), {"host": tail}),
        Seq(_manifest("big", nbytes=3 * SLOT + 17), {"device": big}, on_disk=True),
        Seq(_manifest("disk"), on_disk=True, on_remote=True),
        Seq(_manifest("remote"), on_remote=True),
    ]
    cases[0].access_count, cases[0].promotions = 12, 3
    for seq in cases:
        row = rows.freeze(seq)
        assert row is not None
        # Read in place, without a thaw: what the eviction order and the stats look at.
        assert rows.gen(row) == seq.gen and rows.form(row) is seq.manifest.form
        for t in ("host", "device", "private", "disk"):
            assert rows.has(row, t) == (seq.on_disk if t == "disk" else t in seq.res)
        asked = "".join(list(seq.seq_id))  # a lookup's own copy of the id
        back = rows.thaw(row, asked)
        _same(back, seq)
        assert back is not seq
        assert back.seq_id is seq.seq_id  # the id kept is the index's string, not the lookup's
    assert len(rows) == 0
    # Rows are reused once freed.
    r1 = rows.freeze(cases[2])
    assert r1 is not None and len(rows) == 1
    rows.thaw(r1, "disk")
    assert rows.freeze(cases[2]) == r1


def test_what_a_row_cannot_hold_stays_a_seq() -> None:
    rows = Rows({"host": SLOT, "device": SLOT})
    tail = Allocation(SLOT, (), (3, 5, 2, 3000))

    def fresh() -> Seq:
        return Seq(_manifest(), {"host": tail}, on_disk=True)

    refused = []
    s = fresh(); s.dropped = True; refused.append(s)  # noqa: E702
    s = fresh(); s.moving = 1; refused.append(s)  # noqa: E702
    s = fresh(); s.add_reader("host"); refused.append(s)  # noqa: E702
    s = fresh(); s.dirty_since = 5.0; refused.append(s)  # noqa: E702
    s = fresh(); s.access_count = 1 << 32; refused.append(s)  # noqa: E702
    refused.append(Seq(_manifest(expires=2000.5), on_disk=True))  # a TTL: expiry's set holds it anyway
    s = Seq(_manifest(), {"host": tail, "device": Allocation(SLOT, (), (0, 0, 1, 10))})
    refused.append(s)  # two memory copies
    refused.append(Seq(_manifest(), {"host": Allocation(4096, (), (0, 0, 1, 10))}))  # another slot size
    s = fresh()
    s.move_lock.acquire()
    refused.append(s)
    for s in refused:
        assert rows.freeze(s) is None, s
    assert len(rows) == 0
    s.move_lock.release()
    assert rows.freeze(s) is not None  # a move lock made once, and free again, is no obstacle


def blk(i: int, n: int = 3000) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int16).to(torch.int8) + i


def _rows(eng: Engine) -> int:
    with eng.catalog.lock:
        assert eng.catalog.rows is not None
        return len(eng.catalog.rows)


def _freeze_all(eng: Engine, expect: int) -> None:
    """Wait for the maintenance thread's passes to make ``expect`` rows (a write-back
    queue lets go of the records it wrote in its next pass), pushing with passes of our own."""
    def settled() -> bool:
        maintenance.freeze_idle(eng)
        return _rows(eng) == expect
    assert wait_until(settled, timeout=20), f"{_rows(eng)} rows, not {expect}"


def _clean_blocks(daemon: Callable[..., Daemon], n: int) -> tuple[Daemon, Engine]:
    """A daemon with blocks ``b0``..``b{n-1}`` parked and written to disk (clean: each
    may become a row)."""
    d = daemon(**{"tiers.host.slot_size": "64KiB"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park_batch({f"b{i}": [blk(i)] for i in range(n)})
        c.flush()
    return d, eng


def test_parked_blocks_become_rows_and_restore_exactly(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.slot_size": "64KiB"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park_batch({f"b{i}": [blk(i)] for i in range(300)})
        maintenance.freeze_idle(eng)
        assert _rows(eng) == 0  # memory-only under write_back: a dirty clock keeps the Seq
        c.flush()  # clean now: the write-back's untrack queues each id for the freeze pass
        _freeze_all(eng, 300)
        stats = c.stat().tiers  # read from the rows in place
        assert stats["host"].sequences == 300 and stats["disk"].sequences == 300
        for i in (0, 17, 299):
            assert torch.equal(c.restore(f"b{i}")[0], blk(i))
        assert _rows(eng) == 297  # looked up: a Seq again, until the next pass
        eng.check_invariants()  # thaws everything, and checks the eviction order
        _freeze_all(eng, 300)
        assert c.stat().tiers == stats
        assert sorted(s.seq_id for s in c.list()) == sorted(f"b{i}" for i in range(300))


def test_a_held_seq_is_never_frozen_so_identity_checks_hold(daemon: Callable[..., Daemon]) -> None:
    """The rule every lock gap relies on: a ``Seq`` anyone holds stays the one record of
    its version. A holder (here: this test, between two lock holds) keeps it from the
    freeze pass; ``current`` stays true, and the next lookup returns the same object."""
    d, eng = _clean_blocks(daemon, 20)
    cat = eng.catalog
    with Client(d.address) as c:
        with cat.lock:
            held = cat.get("b3")
        _freeze_all(eng, 19)
        with cat.lock:
            assert cat.current(held) and cat.find("b3") is held
        del held
        gc.collect()
        _freeze_all(eng, 20)
        # A re-park of a frozen id: the row's version is retired, the new one published.
        c.park("b5", [blk(55)], overwrite=True)
        c.flush()
        _freeze_all(eng, 20)
        assert torch.equal(c.restore("b5")[0], blk(55))
        eng.check_invariants()


def test_eviction_picks_frozen_victims_in_order(daemon: Callable[..., Daemon]) -> None:
    """The eviction order keeps ids, not records: victims that are rows are read in place
    to check their entry, thawed to be moved, and the coldest go first."""
    d = daemon(**{"tiers.host.slot_size": "64KiB", "tiers.host.capacity": "2MiB"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        for i in range(24):  # 24 × 64 KiB granules of 3000 B: well inside 2 MiB
            c.park(f"s{i}", [blk(i, 40_000)])
        c.flush()
        _freeze_all(eng, 24)
        for i in range(24, 60):  # past the high mark: the oldest demote to disk
            c.park(f"s{i}", [blk(i, 40_000)])
        c.flush()
        tiers = {s.seq_id: s.tier for s in c.list()}
        assert tiers["s0"] == "disk" and tiers["s59"] == "host"
        first_host = min(i for i in range(60) if tiers[f"s{i}"] == "host")
        assert all(tiers[f"s{i}"] == "disk" for i in range(first_host))
        for i in range(60):
            assert torch.equal(c.restore(f"s{i}")[0], blk(i, 40_000))
        eng.check_invariants()


def test_a_restart_rebuilds_the_index_as_rows(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, **{"tiers.host.slot_size": "64KiB"})
    d = Daemon(cfg).start()
    try:
        with Client(d.address) as c:
            c.park_batch({f"b{i}": [blk(i)] for i in range(100)})
            c.park("ttl", [blk(1)], ttl_s=3600)
    finally:
        d.stop(0.5)
    d = Daemon(cfg).start()
    try:
        eng2 = d.engine
        assert eng2 is not None
        assert _rows(eng2) == 100  # the TTL block stays a Seq: expiry's set holds it
        with Client(d.address) as c:
            assert torch.equal(c.restore("b42")[0], blk(42))
            assert torch.equal(c.restore("ttl")[0], blk(1))
        eng2.check_invariants()
    finally:
        d.stop(0.5)


def test_lookups_racing_the_freeze_pass_keep_one_record_per_version(daemon: Callable[..., Daemon]) -> None:
    """Threads look ids up, hold the record across a lock gap and check it is still
    current while the freeze pass runs flat out: a record someone holds is never turned
    into a row (which would make the next lookup a different object)."""
    _, eng = _clean_blocks(daemon, 200)
    cat = eng.catalog
    lookers_done = threading.Event()
    errors: list[str] = []
    frozen = [0]

    def freezer() -> None:
        while not lookers_done.is_set():
            before = _rows(eng)
            maintenance.freeze_idle(eng)
            frozen[0] += max(0, _rows(eng) - before)

    def looker(k: int) -> None:
        for n in range(1500):
            sid = f"b{(n * 7 + k) % 200}"
            with cat.lock:
                held = cat.get(sid)
            time.sleep(0)  # not a wait: lets the freezer run inside the gap
            with cat.lock:
                if not cat.current(held) or cat.find(sid) is not held:
                    errors.append(sid)

    lookers = [threading.Thread(target=looker, args=(k,)) for k in range(3)]
    freezing = threading.Thread(target=freezer)
    for t in [freezing, *lookers]:
        t.start()
    for t in lookers:
        t.join(120)
    lookers_done.set()
    freezing.join(30)
    assert not any(t.is_alive() for t in [freezing, *lookers])
    assert not errors, errors[:5]
    assert frozen[0] > 0  # the freeze pass did run among the lookups
    eng.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo", "arc"])
def test_every_policy_keeps_its_order_with_rows(tmp_path: Path, policy: str) -> None:
    """Key-ordered policies keep ids in their heaps and index rows; ``arc`` orders member
    sets of records, so its index keeps no rows at all."""
    cfg = make_config(tmp_path, **{"tiers.host.slot_size": "64KiB", "tiers.host.capacity": "2MiB",
                                   "policy.eviction": policy})
    d = Daemon(cfg).start()
    try:
        eng = d.engine
        assert eng is not None
        with Client(d.address) as c:
            for i in range(60):
                c.park(f"s{i}", [blk(i, 40_000)])
                if i % 10 == 9:
                    c.flush()
                    maintenance.freeze_idle(eng)
            for i in range(60):
                assert torch.equal(c.restore(f"s{i}")[0], blk(i, 40_000))
        with eng.catalog.lock:
            assert (eng.catalog.rows is None) == (policy == "arc")
        eng.check_invariants()
    finally:
        d.stop(0.5)


def test_an_empty_catalog_has_nothing_to_freeze() -> None:
    cat = Catalog({}, "lru")
    with cat.lock:
        assert cat.freeze_idle(10) == 0
        assert cat.rows is not None and len(cat.rows) == 0


def test_memory_only_rows_are_flushed_at_stop_without_a_thaw_of_the_rest(tmp_path: Path) -> None:
    """Without dirty bounds a memory-only block has no dirty clock and becomes a row like
    any other: the flush (and the stop's flush) must find it among the rows, read in
    place, and write it; the blocks already on disk stay rows."""
    cfg = make_config(tmp_path, **{"tiers.host.slot_size": "64KiB", "policy.max_dirty_s": 0,
                                   "policy.max_dirty_bytes": 0, "policy.max_dirty_sequences": 0})
    d = Daemon(cfg).start()
    try:
        eng = d.engine
        assert eng is not None
        with Client(d.address) as c:
            c.park_batch({f"old{i}": [blk(i)] for i in range(50)})
            assert c.flush() == 50
            c.park_batch({f"new{i}": [blk(i + 1)] for i in range(70)})
            _freeze_all(eng, 120)
            with eng.catalog.lock:
                todo = eng.catalog.memory_only()
                assert sorted(s.seq_id for s in todo) == sorted(f"new{i}" for i in range(70))
                del todo
            assert _rows(eng) == 50  # only the memory-only ones were thawed
    finally:
        d.stop(5.0)  # the stop's flush writes the 70
    d = Daemon(cfg).start()
    try:
        with Client(d.address) as c:
            for i in (0, 69):
                assert torch.equal(c.restore(f"new{i}")[0], blk(i + 1))
            assert torch.equal(c.restore("old3")[0], blk(3))
        assert d.engine is not None
        d.engine.check_invariants()
    finally:
        d.stop(0.5)


def test_a_freeze_pass_looks_at_each_held_record_once(daemon: Callable[..., Daemon]) -> None:
    """Records that cannot be frozen yet go back to the end of the queue: a pass must not
    come round to them again (with 2,000 held it looked at 262,144 ids per pass, every
    pass, and an idle daemon burned half a core)."""
    _, eng = _clean_blocks(daemon, 2100)
    cat = eng.catalog
    _freeze_all(eng, 2100)
    with cat.lock:
        held = [cat.get(f"b{i}") for i in range(2000)]  # 2,000 records someone holds
    assert maintenance.freeze_idle(eng) == 2000  # each looked at once, none frozen
    assert maintenance.freeze_idle(eng) == 2000  # and again next pass: still held
    assert _rows(eng) == 100
    del held
    gc.collect()
    _freeze_all(eng, 2100)
    assert maintenance.freeze_idle(eng) == 0  # nothing left to look at


def test_listing_and_planning_read_rows_without_making_them_records(daemon: Callable[..., Daemon]) -> None:
    """``list``, a prefix's in-memory check and a demotion plan over a tier of pinned rows
    read the rows in place: no row becomes a ``Seq`` (and no freeze pass has to undo it
    on every call)."""
    d = daemon(**{"tiers.host.slot_size": "64KiB", "tiers.host.capacity": "2MiB"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        for i in range(20):
            c.park(f"p{i}", [blk(i, 40_000)], pinned=True)
        c.flush()
        _freeze_all(eng, 20)
        listed = c.list()
        assert sorted(s.seq_id for s in listed) == sorted(f"p{i}" for i in range(20))
        assert all(s.pinned and s.tier == "host" for s in listed)
        # A connector's lookup asks whether a whole prefix is in memory on every step.
        assert eng.in_memory([f"p{i}" for i in range(20)])
        assert not eng.in_memory(["p0", "nothing"])
        assert _rows(eng) == 20
        with eng.catalog.lock:
            assert eng.catalog.demotion_plan("host") == []  # pinned: never demoted below its tier
        assert _rows(eng) == 20
        c.pin("p3", pinned=False)
        with eng.catalog.lock:
            plan = eng.catalog.demotion_plan("host")
            assert [s.seq_id for s in plan] == ["p3"]  # the one eligible row is made a record
            assert eng.catalog.current(plan[0])
            del plan
        eng.check_invariants()


def test_a_disk_only_row_is_not_in_memory(daemon: Callable[..., Daemon]) -> None:
    d, eng = _clean_blocks(daemon, 30)
    with Client(d.address) as c:
        assert eng.mover.demote("b7", "host")  # its disk copy stays: disk only now
        _freeze_all(eng, 30)
        assert {s.seq_id: s.tier for s in c.list()}["b7"] == "disk"
        assert eng.in_memory(["b6", "b8"])
        assert not eng.in_memory(["b6", "b7"])
        assert _rows(eng) == 30  # read in place, nothing thawed
        assert torch.equal(c.restore("b7")[0], blk(7))


def test_lookups_with_a_remote_tier_read_rows_in_place(daemon: Callable[..., Daemon],
                                                        redis_server: RedisServer) -> None:
    """With a remote tier a read first asks which of its ids are missing here, to adopt
    them from Redis (``reads.adopt``): a presence check, which must not make the rows it
    finds ``Seq``s again (a restore of a prefix stops at its first miss)."""
    d = daemon(**{"tiers.host.slot_size": "64KiB", "tiers.remote.url": redis_server.url,
                  "tiers.remote.namespace": f"rows{os.getpid()}", "tiers.remote.write": "write_through"})
    eng = d.engine
    assert eng is not None and eng.remote is not None
    with Client(d.address) as c:
        c.park_batch({f"b{i}": [blk(i)] for i in range(40)})
        c.flush()
        _freeze_all(eng, 40)
        assert c.lookup([f"b{i}" for i in range(40)] + ["elsewhere"]) == 40
        reads.adopt(eng, [f"b{i}" for i in range(40)] + ["elsewhere"])
        assert _rows(eng) == 40
        assert torch.equal(c.restore("b9")[0], blk(9))
