"""Regression tests: the maintenance side across its gaps (expiry, eviction, demotion,
drops, restart) acts on the version it chose, leaves exact accounting, and answers truly.

Each interleaving is pinned through the ``disk_factory`` seam: a ``DiskStore`` subclass
holds one call at a gate the test opens, or fails one call. Nothing in the product
sleeps; the tests wait on conditions with deadlines.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import lmdb
import pytest
import torch

from kvpark.client import Client, NotFound, Unavailable
from kvpark.daemon.server import Daemon
from kvpark.tiers import policy
from kvpark.tiers.disk import DiskStore, Manifest, ReadTxn, Write, block_key

from ..conftest import Proc, make_config, wait_until

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v % 251, dtype=torch.uint8)


class Gate:
    """One call of the disk store, picked by ``pick(kind, arg)``, waits at a gate the test opens."""

    def __init__(self) -> None:
        self.pick: Callable[[str, Any], bool] | None = None
        self.entered = threading.Event()
        self.gate = threading.Event()

    def arm(self, pick: Callable[[str, Any], bool]) -> None:
        self.entered.clear()
        self.gate.clear()
        self.pick = pick

    def hit(self, kind: str, arg: Any) -> None:
        if self.pick is not None and self.pick(kind, arg):
            self.pick = None
            self.entered.set()
            assert self.gate.wait(60), "the test never opened the gate"


GATE = Gate()


class GatedDisk(DiskStore):
    """``delete`` (with its manifest), ``read_txn`` and ``write_many`` (with the ids it
    writes) pass through ``GATE``."""

    def delete(self, m: Manifest, sync: bool = False) -> None:
        GATE.hit("delete", m.seq_id)
        super().delete(m, sync)

    @contextmanager
    def read_txn(self) -> Iterator[ReadTxn]:
        GATE.hit("read", None)
        with super().read_txn() as r:
            yield r

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        GATE.hit("write", [w.manifest.seq_id for w in writes])
        return super().write_many(writes, sync)


@pytest.fixture
def gate() -> Iterator[Gate]:
    GATE.arm(lambda kind, arg: False)
    GATE.pick = None
    yield GATE
    GATE.pick = None
    GATE.gate.set()  # never leave a daemon thread stuck past the test


def restored(c: Client, sid: str) -> list[torch.Tensor]:
    """``c.restore(sid)``, its read lease ended at the daemon when it returns: a shm
    restore's Release is not waited for (client/releases.py), and these tests look at
    the engine, not through the client, whose next call would send it first."""
    out = c.restore(sid)
    assert isinstance(out, list)
    c.stat()
    return out


# ---------------------------------------------------------------- expiry by identity (#5)

def test_ttl_expiry_never_drops_a_fresh_re_park_of_the_same_id(daemon: Callable[..., Daemon], gate: Gate) -> None:
    d = daemon(disk_factory=GatedDisk, **{"policy.write": "write_through"})
    with Client(d.address) as c:
        # Step: the expiry pass lists "a" and "b" together, and stops inside a's delete.
        gate.arm(lambda kind, arg: kind == "delete" and arg == "a")
        c.park("a", [full(1000, 1)], ttl_s=0.05)
        c.park("b", [full(1000, 2)], ttl_s=0.05)
        assert gate.entered.wait(30), "the expiry pass never dropped 'a'"
        # Step: in the gap, a client re-parks "b" for good (no TTL) and is acknowledged.
        c.park("b", [full(1000, 3)], overwrite=True)
        gate.gate.set()
        # Step: a later pass has run (the first one is over): "c" expires after it.
        c.park("c", [full(10, 4)], ttl_s=0.05)
        assert wait_until(lambda: not any(c.present(["a", "c"])), timeout=30)
        # The acknowledged re-park stands: the expiry dropped the version it chose, not the id.
        assert c.present(["b"]) == [True]
        assert torch.equal(restored(c, "b")[0], full(1000, 3))
        assert c.info("b").expires_at == 0.0
    d.engine.check_invariants()


# ---------------------------------------------------------------- demotion by identity (#5)

def test_background_demotion_never_demotes_a_version_parked_after_its_plan(daemon: Callable[..., Daemon],
                                                                          gate: Gate) -> None:
    d = daemon(disk_factory=GatedDisk, **{"policy.write": "write_back"})
    half = MiB // 2
    with Client(d.address) as c:
        # Step: 14 MiB of host in half-MiB sequences, x00 the coldest.
        for i in range(28):
            c.park(f"x{i:02d}", [full(half, i)])
        # Step: past the high mark: relief plans x00, x01, ... and stops inside x00's disk write.
        gate.arm(lambda kind, arg: kind == "write" and "x00" in arg)
        c.park("big", [full(MiB, 99)])
        assert gate.entered.wait(30), "background demotion never reached the disk"
        # Step: x01 (in the plan) is re-parked in the gap: the new version is the hottest.
        c.park("x01", [full(half, 101)], overwrite=True)
        gate.gate.set()
        assert wait_until(lambda: c.info("x02").tier == "disk", timeout=30)
        # The plan went on past x01 without touching its new version.
        assert c.info("x00").tier == "disk"
        assert c.info("x01").tier == "host"
        assert torch.equal(restored(c, "x01")[0], full(half, 101))
    d.engine.check_invariants()


# ---------------------------------------------------------------- disk eviction by identity (#5)

def test_disk_eviction_never_evicts_a_version_parked_after_it_was_chosen(daemon: Callable[..., Daemon],
                                                                        gate: Gate) -> None:
    d = daemon(disk_factory=GatedDisk, **{"policy.write": "write_through", "tiers.disk.capacity": "8MiB"})
    eng = d.engine
    with Client(d.address) as c:
        for sid in ("v1", "v2", "v3"):  # disk only, coldest first
            c.park(sid, [full(2 * MiB, 1)])
            assert eng.mover.demote(sid, "host")
        # Step: eviction down to 1000 bytes chooses all three, and stops inside v1's delete.
        gate.arm(lambda kind, arg: kind == "delete" and arg == "v1")
        t = threading.Thread(target=eng.mover.evict_disk, args=(0, 1000))
        t.start()
        assert gate.entered.wait(30)
        # Step: v2 is re-parked (write_through: on disk when acknowledged) in the gap.
        c.park("v2", [full(1000, 9)], overwrite=True)
        gate.gate.set()
        t.join(30)
        # The eviction went on to v3, not to the new version of v2 (1000 bytes: the
        # target), which was parked after the plan and keeps its disk copy.
        assert c.present(["v1", "v3"]) == [False, False]
        with eng.catalog.lock:
            v2 = eng.catalog.get("v2")
        assert v2.on_disk and eng.disk.holds(v2.manifest)
        assert torch.equal(restored(c, "v2")[0], full(1000, 9))
    eng.check_invariants()


# ---------------------------------------------------------------- composites after a crash (#9)

def test_a_composite_demoted_to_disk_survives_kill_9_with_its_shared_block(tmp_path: Path) -> None:
    p = Proc.start(tmp_path, "--set", "policy.write=write_back")
    try:
        with Client(p.address) as c:
            c.park("comp", [full(MiB, 8)], refs=["B"], new_blocks={"B": [full(MiB, 7)]})
            c.pin("B")
            # Step: fill host until "comp" (the coldest, not pinned) is demoted to disk.
            i = 0
            while c.info("comp").tier != "disk":
                c.park(f"fill{i}", [full(MiB, i)])
                i += 1
                assert i < 64, "comp was never demoted"
            assert c.info("B").tier == "host"
    finally:
        p.kill()
        p.popen.wait(30)
    # Step: restart on the same disk. Whatever is listed restores; nothing is a zombie.
    p2 = Proc.start(tmp_path, "--set", "policy.write=write_back")
    try:
        with Client(p2.address) as c:
            listed = {s.seq_id for s in c.list()}
            assert "comp" in listed and "B" in listed, listed
            out = restored(c, "comp")
            assert torch.equal(out[0], full(MiB, 7)) and torch.equal(out[1], full(MiB, 8))
    finally:
        p2.kill()
        p2.popen.wait(30)


def test_restart_retires_a_composite_whose_shared_block_is_gone(daemon: Callable[..., Daemon],
                                                                 tmp_path: Path) -> None:
    d0 = daemon()
    with Client(d0.address) as c:
        c.park("comp", [full(1000, 1)], refs=["B"], new_blocks={"B": [full(1000, 2)]})
        c.park("plain", [full(1000, 3)])
    d0.stop(0.5)  # flushes all three to disk
    # Step: make the disk as a crash left it before the fix: "comp" on disk, its block "B" not.
    cfg = make_config(tmp_path)
    store = DiskStore(cfg.tiers.disk.path, cfg.disk_capacity)
    try:
        manifests = {m.seq_id: m for m in store.load_manifests()[0]}
        assert set(manifests) == {"comp", "B", "plain"}
        store.delete(manifests["B"], sync=True)
    finally:
        store.close()
    # Step: the daemon starts: the composite is retired, its record deleted, the rest kept.
    d = daemon()
    with Client(d.address) as c:
        assert c.present(["comp", "plain"]) == [False, True]
        assert [s.seq_id for s in c.list()] == ["plain"]
        assert c.stat().tiers["disk"].used_bytes == 1000
        with pytest.raises(NotFound):
            c.restore("comp")
    d.engine.check_invariants()
    d.stop(0.5)
    store = DiskStore(cfg.tiers.disk.path, cfg.disk_capacity)
    try:
        assert [m.seq_id for m in store.load_manifests()[0]] == ["plain"]
    finally:
        store.close()


def test_restart_adopts_a_missing_shared_block_from_the_remote_tier(daemon: Callable[..., Daemon], tmp_path: Path,
                                                                    redis_server: Any) -> None:
    remote = {"tiers.remote.url": redis_server.url, "tiers.remote.namespace": f"h5maint{threading.get_ident()}",
              "tiers.remote.write": "write_through", "tiers.remote.timeout_s": 1.0}
    d0 = daemon(**remote)
    with Client(d0.address) as c:
        c.park("comp", [full(1000, 1)], refs=["B"], new_blocks={"B": [full(3000, 2)]})
        assert wait_until(lambda: (r := c.stat().remote) is not None and r.pending_writes == 0, timeout=30)
    d0.stop(0.5)
    # Step: the local disk lost B (it had moved to the remote tier); Redis still has it.
    cfg = make_config(tmp_path)
    store = DiskStore(cfg.tiers.disk.path, cfg.disk_capacity)
    try:
        store.delete(next(m for m in store.load_manifests()[0] if m.seq_id == "B"), sync=True)
    finally:
        store.close()
    # Step: the restart adopts B from Redis instead of retiring comp; comp restores whole.
    d = daemon(**remote)
    with Client(d.address) as c:
        out = restored(c, "comp")
        assert torch.equal(out[0], full(3000, 2)) and torch.equal(out[1], full(1000, 1))
    d.engine.check_invariants()


def test_restart_collects_block_records_no_manifest_owns(daemon: Callable[..., Daemon], tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    d0 = daemon(**{"policy.write": "write_through"})
    with Client(d0.address) as c:
        c.park("s", [full(1000, 1)])
    d0.stop(0.5)
    # Step: as a crash leaves it: a newer generation's manifest replaced the old one,
    # whose blocks were never deleted (their delete is a separate transaction).
    cfg = make_config(tmp_path)
    store = DiskStore(cfg.tiers.disk.path, cfg.disk_capacity)
    try:
        (old,) = store.load_manifests()[0]
        new = old.replace(gen=old.gen + 1)
        assert store.write(new, [memoryview(full(1000, 2).numpy())], sync=True)
    finally:
        store.close()

    def blocks_of() -> set[int]:
        env = lmdb.open(cfg.tiers.disk.path, max_dbs=4)
        try:
            with env.begin(db=env.open_db(b"blocks")) as txn:
                return {g for g in (old.gen, new.gen) if txn.get(block_key("s", g, 0)) is not None}
        finally:
            env.close()

    assert blocks_of() == {old.gen, new.gen}
    # Step: the daemon starts; its maintenance thread collects the orphaned records.
    d = daemon()
    assert wait_until(lambda: "no manifest owned" in caplog.text, timeout=30)
    with Client(d.address) as c:
        assert torch.equal(restored(c, "s")[0], full(1000, 2))
        assert c.stat().tiers["disk"].used_bytes == 1000
    d.engine.check_invariants()
    d.stop(0.5)
    assert blocks_of() == {new.gen}


# ---------------------------------------------------------------- a failed delete in a drop (#10a)

class FailsOneDelete(DiskStore):
    """The delete of ``comp`` fails once, as an unwritable disk fails it: the record
    stays, and the store's accounting lets go (as ``DiskStore.delete`` does)."""

    armed = False

    def delete(self, m: Manifest, sync: bool = False) -> None:
        if type(self).armed and m.seq_id == "comp":
            type(self).armed = False
            with self._acct:
                self._forget((m.seq_id, m.gen))
            raise Unavailable("injected: the disk tier cannot be written")
        super().delete(m, sync)


def test_a_failed_delete_in_a_drop_leaves_no_orphaned_block_and_is_retried(daemon: Callable[..., Daemon],
                                                                          tmp_path: Path) -> None:
    d = daemon(disk_factory=FailsOneDelete, **{"policy.write": "write_through"})
    with Client(d.address) as c:
        c.park("comp", [full(1000, 1)], refs=["B"], new_blocks={"B": [full(3000, 2)]})
        FailsOneDelete.armed = True
        with pytest.raises(Unavailable):
            c.drop("comp")
        # The drop unpublished both; B's disk copy was deleted regardless, and the
        # accounting holds what the index holds.
        assert c.present(["comp", "B"]) == [False, False]
        assert c.stat().tiers["disk"].used_bytes == 0
        d.engine.check_invariants()
        # The maintenance pass deletes the record the failed delete left.
        assert wait_until(lambda: d.engine.mover.deletes.pending == 0, timeout=30)
    d.stop(0.5)
    d2 = daemon()
    with Client(d2.address) as c:
        assert c.list() == []


# ---------------------------------------------------------------- drops racing reads (#11)

@pytest.mark.parametrize("how", ["restore", "restore_many", "prefetch"])
def test_a_promotion_racing_a_drop_is_not_found_not_data_loss(daemon: Callable[..., Daemon], gate: Gate,
                                                              how: str) -> None:
    # Disk grants off: the promotion is the path under test (a grant reads the records
    # without one; tests/client/test_disk_grants.py races drops against grants).
    d = daemon(disk_factory=GatedDisk, **{"policy.write": "write_through", "tiers.disk.direct_reads": "false"})
    with Client(d.address) as c:
        c.park("s", [full(2 * MiB, 5)])
        assert d.engine.mover.demote("s", "host")
        assert c.info("s").tier == "disk"
        # Step: the restore promotes from disk, and stops before its read transaction.
        gate.arm(lambda kind, arg: kind == "read")
        errors: list[BaseException] = []

        def read() -> None:
            with Client(d.address) as c2:
                try:
                    if how == "restore":
                        c2.restore("s")
                    elif how == "restore_many":
                        c2.restore_many(["s"])
                    else:
                        c2.prefetch("s", tier="host", wait=True, timeout=60)
                except BaseException as e:  # surfaced below
                    errors.append(e)

        t = threading.Thread(target=read)
        t.start()
        assert gate.entered.wait(30)
        # Step: the sequence is dropped in the gap; then the read goes on.
        assert c.drop("s")
        gate.gate.set()
        t.join(60)
        assert len(errors) == 1 and isinstance(errors[0], NotFound), errors
    d.engine.check_invariants()


# ---------------------------------------------------------------- a granted disk read is protected (#12)

def test_a_granted_disk_only_restore_survives_disk_eviction_until_read(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"policy.write": "write_through", "policy.promote_on_restore": "false"})
    eng = d.engine
    with Client(d.address) as c:
        c.park("s", [full(2 * MiB, 6)])
        assert eng.mover.demote("s", "host")
    # Step: a restore is granted from disk (the data channel reads it later).
    h = eng.acquire("s")
    assert h.parts[0].tier == "disk" and h.lease_id
    # Step: disk eviction runs before the read: the granted copy is not its victim.
    eng.mover.evict_disk(0, 0)
    got = b"".join(bytes(v) for _, views in eng.iter_chunks(h, MiB) for v in views)
    assert got == bytes(full(2 * MiB, 6).numpy())
    assert eng.release(h.lease_id)
    # Once read and released, it may go.
    assert eng.mover.evict_disk(0, 0)
    with Client(d.address) as c:
        assert c.present(["s"]) == [False]
    eng.check_invariants()


# ---------------------------------------------------------------- eviction order, kept incrementally (#13)

def test_demotion_follows_the_lru_order_as_reads_touch_sequences(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    eng = d.engine
    with Client(d.address) as c:
        for sid in ("a", "b", "c", "d"):
            c.park(sid, [full(3 * MiB, 1)])
        restored(c, "a")
        restored(c, "c")
        with eng.catalog.lock:
            plan = [s.seq_id for s in eng.catalog.demotion_plan("host")]
            metas = eng.catalog.evictable("host")
        assert plan == ["b", "d", "a", "c"] == policy.demotion_order("lru", metas)
        # Step: a park that needs room demotes the coldest first: b, then d.
        c.park("e", [full(6 * MiB, 2)])
        tiers = {s.seq_id: s.tier for s in c.list()}
        assert tiers["b"] == "disk" and tiers["a"] == tiers["c"] == "host", tiers
    eng.check_invariants()


@pytest.mark.parametrize("name", ["lru", "lfu", "s3fifo", "arc"])
def test_the_kept_eviction_order_is_the_policys_order(daemon: Callable[..., Daemon], name: str) -> None:
    d = daemon(**{"policy.eviction": name})
    eng = d.engine
    with Client(d.address) as c:
        for i in range(8):
            c.park(f"s{i}", [full(MiB, i)], priority=1 if i == 3 else 0)
        for i in (5, 1, 5, 6, 1, 5, 0):  # reads change recency and frequency
            restored(c, f"s{i}")
        with eng.catalog.lock:
            kept = [s.seq_id for s in eng.catalog.demotion_plan("host")]
            metas = eng.catalog.evictable("host")
            few = [s.seq_id for s in eng.catalog.demotion_plan("host", None, 2 * MiB)]
        assert len(metas) == 8
        assert kept == policy.demotion_order(name, metas)
        assert few == policy.plan_demotion(name, metas, 2 * MiB, 2 * MiB, 0) == kept[:2]
    eng.check_invariants()


def test_disk_eviction_takes_the_coldest_disk_copies_first(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"policy.write": "write_through", "tiers.disk.capacity": "8MiB"})
    eng = d.engine
    with Client(d.address) as c:
        for sid in ("a", "b", "c"):
            c.park(sid, [full(2 * MiB, 1)])
            assert eng.mover.demote(sid, "host")
        restored(c, "a")  # a is read (and promoted): b is now the coldest disk copy
        c.park("d", [full(3 * MiB, 2)])  # needs 1 MiB more than the disk has free
        assert c.present(["a", "b", "c", "d"]) == [True, False, True, True]
    eng.check_invariants()


def test_busy_counts_moves_in_flight_without_making_move_locks(daemon: Callable[..., Daemon], gate: Gate) -> None:
    d = daemon(disk_factory=GatedDisk, **{"policy.write": "write_through"})
    eng = d.engine
    with Client(d.address) as c:
        for i in range(20):
            c.park(f"s{i}", [full(1000, i)])
        assert eng.mover.demote("s0", "host")
        with eng.catalog.lock:
            assert not eng.catalog.busy()
            # Asking made no move lock: most sequences never move, and never need one.
            assert sum(s._move_lock is not None for s in eng.catalog.sequences()) <= 1
        # Step: a promotion of s0 from disk holds at its read: a move is in flight.
        gate.arm(lambda kind, arg: kind == "read")
        t = threading.Thread(target=lambda: eng.prefetch("s0", "host", wait=True, timeout=60))
        t.start()
        assert gate.entered.wait(30)
        with eng.catalog.lock:
            s0 = eng.catalog.get("s0")
            assert eng.catalog.busy() and not eng.catalog.busy(exclude=s0)
        gate.gate.set()
        t.join(60)
        assert wait_until(lambda: not eng.catalog.busy(), timeout=30)
        assert c.info("s0").tier == "host"
    eng.check_invariants()
