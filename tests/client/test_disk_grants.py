"""Disk grants: a trusted_local client reads sequences that are on disk only straight from
the daemon's LMDB files (``client/disk_reads.py``, ``tiers/envs.py``).

Every test runs real daemons on real LMDB directories. What a grant must never do is
hand over other bytes than the version the daemon named: a version gone from disk
between the grant and the read (dropped, overwritten, evicted), a damaged record, or
files the client cannot open all end in the daemon's ordinary answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from kvpark.client import Client
from kvpark.client import disk_reads
from kvpark.proto.errors import DataLoss, NotFound
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.tiers import envs
from kvpark.tiers.disk import HEADER, block_key

from ..conftest import wait_until
from ..daemon.test_tenants import TOKENS, tenants

MiB = 1 << 20


def blob(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


class Reads:
    """Counts the grants a client read (and lets a test act between grant and read)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, before: Any = None) -> None:
        self.grants = 0
        self.misses = 0
        self.before = before
        real = disk_reads.read_into

        def read_into(path: str, parts: Any, flats: Any) -> None:
            self.grants += 1
            if self.before is not None:
                before, self.before = self.before, None  # once
                before(parts)
            try:
                real(path, parts, flats)
            except disk_reads.Miss:
                self.misses += 1
                raise

        monkeypatch.setattr(disk_reads, "read_into", read_into)


def on_disk_only(daemon: Any, seqs: dict[str, torch.Tensor], **cfg: Any) -> Any:
    """A daemon whose index holds ``seqs`` on disk only (parked, flushed, restarted)."""
    d = daemon(**cfg)
    with Client(d.address) as c:
        for sid, t in seqs.items():
            c.park(sid, [t])
        c.flush()
    d.stop(0.5)
    return daemon(**cfg)


def records_gone(path: str, part: pb.DiskPart) -> bool:
    with envs.reading(path) as (txn, db):
        return txn.get(block_key(part.seq_id, part.key_gen, 0), db=db) is None


def test_a_sequence_on_disk_only_is_read_from_the_files_and_not_promoted_first(daemon, monkeypatch) -> None:
    t = blob(3 * MiB + 5, 1)
    d = on_disk_only(daemon, {"a": t}, policy__promote_on_restore="false")
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        (out,) = c.restore("a")
        assert torch.equal(out, t)
        assert reads.grants == 1 and reads.misses == 0
        assert c.info("a").tier == "disk"  # the arena path would have staged it in host
        into = torch.zeros_like(t)
        c.restore("a", into=[into])
        assert torch.equal(into, t)
        assert c.stat().leases == 0


def test_without_direct_reads_the_arena_path_serves_it(daemon, monkeypatch) -> None:
    t = blob(2 * MiB, 2)
    d = on_disk_only(daemon, {"a": t}, tiers__disk__direct_reads="false")
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        assert not c.server.disk.path
        assert torch.equal(c.restore("a")[0], t)
        assert reads.grants == 0
        assert c.info("a").tier == "host"


def test_the_promotion_for_next_time_runs_after_the_grant(daemon, monkeypatch) -> None:
    t = blob(2 * MiB, 3)
    d = on_disk_only(daemon, {"a": t})  # policy.promote_on_restore = true (the default)
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        assert torch.equal(c.restore("a")[0], t)
        assert reads.grants == 1
        assert wait_until(lambda: c.info("a").tier == "host")
        assert torch.equal(c.restore("a")[0], t)  # from the arena now
        assert reads.grants == 1
    d.engine.check_invariants()


def test_many_sequences_and_their_shared_blocks_in_one_grant(daemon, monkeypatch) -> None:
    seqs = {f"s{i}": blob(MiB + 1000 * i, 10 + i) for i in range(4)}
    d = on_disk_only(daemon, seqs, policy__promote_on_restore="false")
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        info, outs = c.restore_many(list(seqs))
        assert [tuple(o.shape) for o in outs] == [tuple(t.shape) for t in seqs.values()]
        assert all(torch.equal(o, t) for o, t in zip(outs, seqs.values()))
        flat = torch.empty(sum(t.numel() for t in seqs.values()), dtype=torch.uint8)
        c.restore_many(list(seqs), into_flat=flat)
        assert torch.equal(flat, torch.cat(list(seqs.values())))
        assert reads.grants == 2 and reads.misses == 0


def test_a_mix_of_memory_and_disk_takes_the_arena_path(daemon, monkeypatch) -> None:
    a, b = blob(MiB, 4), blob(MiB, 5)
    d = on_disk_only(daemon, {"a": a}, policy__promote_on_restore="false")
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        c.park("b", [b])  # in host
        _, outs = c.restore_many(["a", "b"])
        assert torch.equal(outs[0], a) and torch.equal(outs[1], b)
        assert reads.grants == 0


def test_a_drop_between_the_grant_and_the_read_is_not_found(daemon, monkeypatch) -> None:
    t = blob(2 * MiB, 6)
    d = on_disk_only(daemon, {"a": t}, policy__promote_on_restore="false")
    path = d.engine.disk.path
    with Client(d.address, transport="shm") as c, Client(d.address) as other:
        def drop(parts: Any) -> None:
            other.drop("a")
            assert wait_until(lambda: records_gone(path, parts[0]))

        reads = Reads(monkeypatch, drop)
        with pytest.raises(NotFound):
            c.restore("a")
        assert reads.grants == 1 and reads.misses == 1
    d.engine.check_invariants()


def test_an_overwrite_between_the_grant_and_the_read_restores_the_new_version(daemon, monkeypatch) -> None:
    old, new = blob(2 * MiB, 7), blob(2 * MiB, 8)
    d = on_disk_only(daemon, {"a": old}, policy__promote_on_restore="false", policy__write="write_through")
    path = d.engine.disk.path
    with Client(d.address, transport="shm") as c, Client(d.address) as other:
        def overwrite(parts: Any) -> None:
            other.park("a", [new], overwrite=True)
            assert wait_until(lambda: records_gone(path, parts[0]))

        reads = Reads(monkeypatch, overwrite)
        (out,) = c.restore("a")
        assert torch.equal(out, new)
        assert reads.misses == 1


def test_a_record_that_fails_verification_is_the_daemons_data_loss(daemon, monkeypatch) -> None:
    t = blob(2 * MiB, 9)
    d = on_disk_only(daemon, {"a": t}, policy__promote_on_restore="false")
    reads = Reads(monkeypatch)
    store = d.engine.disk
    with Client(d.address, transport="shm") as c:
        info = c.info("a")
        assert info.tier == "disk"
        # Flip one payload byte of block 1 in place (the header's checksum no longer holds).
        seq = d.engine.catalog.find("a")
        key = block_key("a", seq.manifest.key_gen, 1)
        with store.env.begin(write=True) as txn:
            raw = bytearray(txn.get(key, db=store._blocks))
            raw[HEADER.size + 100] ^= 0xFF
            txn.put(key, bytes(raw), db=store._blocks)
        with pytest.raises(DataLoss):
            c.restore("a")
        assert reads.grants == 1 and reads.misses == 1
        assert c.stat().damaged == 1  # counted by the daemon's own read, not the client's
        c.park("b", [blob(MiB, 10)])  # the daemon stays up and serves
        assert torch.equal(c.restore("b")[0], blob(MiB, 10))


def test_files_this_process_cannot_open_end_grants_for_the_client(daemon, monkeypatch) -> None:
    t = blob(2 * MiB, 11)
    d = on_disk_only(daemon, {"a": t, "b": t}, policy__promote_on_restore="false")
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        shm = c._for({torch.device("cpu")})
        shm.disk_path = str(Path(d.engine.disk.path) / "missing")  # not an LMDB directory
        assert torch.equal(c.restore("a")[0], t)  # served by the arena path instead
        assert reads.grants == 1 and reads.misses == 1
        assert shm.disk_path == ""
        assert torch.equal(c.restore("b")[0], t)
        assert reads.grants == 1  # no more grants asked for


def test_no_grants_while_a_tenant_is_untrusted(daemon, monkeypatch) -> None:
    t = blob(2 * MiB, 12)
    d = daemon(**tenants())
    with Client(d.address, token=TOKENS["alice"], transport="shm") as a:
        a.park("a", [t])
        a.flush()
    d.stop(0.5)
    d = daemon(**tenants())
    reads = Reads(monkeypatch)
    with Client(d.address, token=TOKENS["alice"], transport="shm") as a, \
            Client(d.address, token=TOKENS["bob"]) as b:
        assert not a.server.disk.path and not b.server.disk.path
        assert torch.equal(a.restore("a")[0], t)
        assert reads.grants == 0


def test_trusted_tenants_read_their_own_grants_under_their_names(daemon, monkeypatch) -> None:
    t = blob(2 * MiB, 13)
    cfg = {k: v for k, v in tenants().items() if not k.startswith("tenants.bob")}
    cfg["policy.promote_on_restore"] = "false"
    d = daemon(**cfg)
    with Client(d.address, token=TOKENS["alice"], transport="shm") as a:
        a.park("x", [t])
        a.flush()
    d.stop(0.5)
    d = daemon(**cfg)
    reads = Reads(monkeypatch)
    with Client(d.address, token=TOKENS["alice"], transport="shm") as a, \
            Client(d.address, token=TOKENS["carol"], transport="shm") as c:
        assert a.server.disk.path
        assert torch.equal(a.restore("x")[0], t)
        assert reads.grants == 1
        with pytest.raises(NotFound):  # carol's "x" is another id
            c.restore("x")


def test_a_client_in_another_process_reads_through_its_own_environment(proc, tmp_path, monkeypatch) -> None:
    t = blob(3 * MiB, 14)
    p = proc("--set", "policy.promote_on_restore=false")
    with Client(p.address) as c:
        c.park("a", [t])
        c.flush()
    assert p.terminate() == 0
    p = proc("--set", "policy.promote_on_restore=false")
    reads = Reads(monkeypatch)
    try:
        with Client(p.address, transport="shm") as c:
            assert torch.equal(c.restore("a")[0], t)
            assert reads.grants == 1 and reads.misses == 0
            # A daemon restart under the client: its reader environment stays valid.
            assert p.terminate() == 0
            p = proc("--set", "policy.promote_on_restore=false")
            c2 = Client(p.address, transport="shm")
            with c2:
                assert torch.equal(c2.restore("a")[0], t)
                assert reads.grants == 2 and reads.misses == 0
    finally:
        p.terminate()


def test_a_reader_environment_gives_way_to_a_store_opened_in_the_same_process(daemon, tmp_path, monkeypatch) -> None:
    """A client that opened the files first (its daemon in another process, now gone), then
    a daemon started in this process on the same directory: one environment per process."""
    t = blob(2 * MiB, 15)
    d = on_disk_only(daemon, {"a": t}, policy__promote_on_restore="false")
    path = d.engine.disk.path
    d.stop(0.5)
    with envs.reading(path) as (txn, db):  # this process's own reader environment now
        assert txn.stat(db)["entries"] > 0
    d = daemon(policy__promote_on_restore="false")  # lmdb refuses a second open: it must have been closed
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        assert torch.equal(c.restore("a")[0], t)
        assert reads.grants == 1 and reads.misses == 0


def one_record(path: str, value: bytes) -> None:
    """An LMDB environment at ``path`` whose blocks database holds ``k`` = ``value``."""
    env = lmdb.open(path, max_dbs=6)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        txn.put(b"k", value, db=db)
    env.close()


def test_refresh_reopens_a_reader_on_a_replaced_data_file(tmp_path) -> None:
    path = str(tmp_path / "env")
    one_record(path, b"old")
    with envs.reading(path) as (txn, db):
        assert bytes(txn.get(b"k", db=db)) == b"old"
    assert not envs.refresh(path)
    # The directory replaced (a restore from backup, a compaction's copy renamed in).
    fresh = str(tmp_path / "env2")
    one_record(fresh, b"new")
    (Path(path) / "data.mdb").unlink()
    (Path(fresh) / "data.mdb").rename(Path(path) / "data.mdb")
    assert envs.refresh(path)
    with envs.reading(path) as (txn, db):
        assert bytes(txn.get(b"k", db=db)) == b"new"


def test_a_reader_killed_inside_its_transaction_gives_its_slot_back(daemon, tmp_path) -> None:
    """A client SIGKILLed mid read leaves a reader slot in lock.mdb, pinning a snapshot the
    writer may not reuse; the daemon's reader check frees it."""
    import signal
    import subprocess
    import sys

    d = on_disk_only(daemon, {"a": blob(MiB, 16)})
    path = d.engine.disk.path
    ready = tmp_path / "ready"
    code = (f"import lmdb, pathlib, time\n"
            f"e = lmdb.open({path!r}, readonly=True, lock=True, create=False, max_dbs=6, max_readers=1024)\n"
            f"t = e.begin()\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            f"time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert wait_until(ready.exists, timeout=60)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        assert d.engine.disk.reader_check() == 1
        assert d.engine.disk.reader_check() == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_a_sequence_larger_than_the_host_tier_is_read_whole_without_windows(daemon, monkeypatch) -> None:
    """Over the arena a sequence three times the host tier moves through windows of
    slots, each asked for with a round trip; a grant reads it in one transaction."""
    ts = [blob(10 * MiB + 7, 17), blob(14 * MiB, 18)]
    d = daemon(**{"tiers.host.capacity": "8MiB", "tiers.disk.capacity": "256MiB"})
    with Client(d.address, transport="shm") as c:
        assert c.park("big", ts).tier == "disk"
    reads = Reads(monkeypatch)
    with Client(d.address, transport="shm") as c:
        r = c.restore("big", layerwise=True)
        i, first = next(r)
        assert i == 0 and torch.equal(first, ts[0])
        assert d.engine.tiers["host"].alloc.used_bytes == 0 and c.stat().leases == 0  # no window, no lease
        assert [torch.equal(t, want) for (_, t), want in zip(r, ts[1:])] == [True]
        assert reads.grants == 1 and reads.misses == 0
        assert c.info("big").tier == "disk"  # too large for host: not promoted either
