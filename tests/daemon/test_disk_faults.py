"""Disk faults: each gives a typed error, never wrong bytes, and the daemon keeps serving.

- A bit flipped in the LMDB file itself, and a record cut short: DATA_LOSS on the first
  read, on every read path (streamed inline, shm through a promotion, prefetch), and
  ``stat`` counts the sequence as damaged until it is dropped.
- LMDB's map full (a ``DiskStore`` whose map is set small: real LMDB, a real
  ``MDB_MAP_FULL``): RESOURCE_EXHAUSTED, nothing half-stored.
- The data directory read-only while running: as root, ``chmod`` stops nothing and a
  read-only bind mount leaves the daemon's open descriptors writable, so a fault layer
  under the disk store fails each write transaction as LMDB does on such a file system.
  Parks under write_through (and parks larger than the host tier, staged to disk under
  either policy), pins and drops are UNAVAILABLE; reads go on; once writable
  again everything works and the accounting holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import lmdb
import pytest
import torch

from kvpark.client import Client, DataLoss, ResourceExhausted, Unavailable
from kvpark.client.cli import main as cli_main
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, block_key

WT = {"policy.write": "write_through"}
KiB, MiB = 1 << 10, 1 << 20


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def check(d: Daemon) -> None:
    assert d.engine is not None
    d.engine.check_invariants()


def stat_text(address: str, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``kvpark stat`` prints."""
    capsys.readouterr()
    assert cli_main(["stat", "--address", address]) == 0
    return capsys.readouterr().out


def flip_a_bit_in_the_file(data_mdb: Path, needle: bytes, at: int) -> None:
    """Flip one bit of the stored payload, in the LMDB file itself (the daemon is stopped)."""
    raw = bytearray(data_mdb.read_bytes())
    i = raw.find(needle)
    assert i >= 0 and raw.find(needle, i + 1) < 0, "the payload is stored once, contiguously"
    raw[i + at] ^= 0x10
    data_mdb.write_bytes(bytes(raw))


def truncate_the_record(disk: Path, seq_id: str) -> None:
    env = lmdb.open(str(disk), max_dbs=4)
    blocks, manifests = env.open_db(b"blocks"), env.open_db(b"manifests")
    with env.begin(write=True) as txn:
        gen = json.loads(txn.get(seq_id.encode(), db=manifests))["gen"]
        key = block_key(seq_id, gen, 0)
        txn.put(key, txn.get(key, db=blocks)[:-1000], db=blocks)  # a record cut short
    env.close()


@pytest.mark.parametrize("fault", ["bit_flip", "truncated"])
@pytest.mark.parametrize("path", ["inline", "shm", "prefetch"])
def test_a_damaged_record_is_data_loss_on_the_first_read(daemon: Callable[..., Daemon], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         fault: str, path: str) -> None:
    victim, bystander = rand(300 * KiB, 1), rand(200 * KiB, 2)
    d = daemon(**WT)
    with Client(d.address) as c:
        c.park("victim", [victim])
        c.park("bystander", [bystander])
    d.stop()
    # Step: damage the victim's record while no daemon runs.
    if fault == "bit_flip":
        flip_a_bit_in_the_file(tmp_path / "disk" / "data.mdb", victim[:4096].numpy().tobytes(), at=123_457)
    else:
        truncate_the_record(tmp_path / "disk", "victim")

    d2 = daemon(**WT)
    with Client(d2.address, transport="inline" if path == "inline" else "auto") as c:
        assert c.stat().damaged == 0  # nothing read yet: start-up reads manifests only
        # Step: the first read, and every one after, is DATA_LOSS; never bytes.
        for _ in range(2):
            with pytest.raises(DataLoss):
                if path == "prefetch":
                    c.prefetch("victim", tier="host", wait=True)
                else:
                    c.restore("victim")
        assert c.stat().damaged == 1
        assert "DAMAGED: 1 sequence(s)" in stat_text(d2.address, capsys)
        assert torch.equal(c.restore("bystander")[0], bystander)
        check(d2)
        # Step: a new version replaces the damaged one; then a drop; the count follows.
        c.park("victim", [bystander], overwrite=True)
        assert c.stat().damaged == 0 and torch.equal(c.restore("victim")[0], bystander)
        c.drop("victim")
        assert "DAMAGED" not in stat_text(d2.address, capsys)
    check(d2)


class SmallMap(DiskStore):
    """Real LMDB with a map of a few MiB: a large write hits ``MDB_MAP_FULL`` before our
    own capacity check would refuse it."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.env.set_mapsize(4 * MiB)


@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_lmdb_map_full_is_resource_exhausted(daemon: Callable[..., Daemon], write: str) -> None:
    d = daemon(disk_factory=SmallMap, **{"policy.write": write})
    small = rand(256 * KiB, 3)
    with Client(d.address) as c:
        c.park("small", [small])
        if write == "write_through":
            # Step: a park whose write-through cannot fit the map fails, and stores nothing.
            with pytest.raises(ResourceExhausted, match="LMDB map"):
                c.park("big", [rand(6 * MiB, 4)])
            assert not c.present(["big"])[0]
        else:
            # Step: parked in memory; the flush that cannot write it says so and keeps it.
            c.park("big", [rand(6 * MiB, 4)])
            c.flush()
            assert c.info("big").tier == "host"
            assert torch.equal(c.restore("big")[0], rand(6 * MiB, 4))
        assert torch.equal(c.restore("small")[0], small)
        c.park("after", [small])
        check(d)


class ReadOnlyFs(DiskStore):
    """Fails every write transaction the way LMDB does on a read-only file system (the
    pages cannot be written at commit), while ``readonly`` is set; reads are untouched."""

    readonly = False

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.env = _Env(self.env, self)


class _Env:
    def __init__(self, env: lmdb.Environment, store: ReadOnlyFs) -> None:
        self._env, self._store = env, store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, *args: Any, write: bool = False, **kw: Any) -> Any:
        txn = self._env.begin(*args, write=write, **kw)
        return _FailingTxn(txn) if write and self._store.readonly else txn


class _FailingTxn:
    def __init__(self, txn: lmdb.Transaction) -> None:
        self._txn = txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def __enter__(self) -> "_FailingTxn":
        return self

    def __exit__(self, *exc: object) -> None:
        self._txn.abort()  # nothing of it reaches the file
        if exc[0] is None:
            raise lmdb.Error("mdb_txn_commit: Read-only file system")


@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_a_read_only_data_directory_while_running(daemon: Callable[..., Daemon], write: str) -> None:
    d = daemon(disk_factory=ReadOnlyFs, **{"policy.write": write, "tiers.host.capacity": "4MiB"})
    assert d.engine is not None and isinstance(d.engine.disk, ReadOnlyFs)
    store = d.engine.disk
    a, b = rand(100 * KiB, 5), rand(100 * KiB, 6)
    with Client(d.address) as c:
        c.park("a", [a])
        c.flush()
        # Step: the file system turns read-only under the running daemon.
        store.readonly = True
        if write == "write_through":
            with pytest.raises(Unavailable, match="cannot be written"):
                c.park("b", [b])
            assert not c.present(["b"])[0]
        else:
            c.park("b", [b])  # memory takes it; the disk copy waits
            assert c.flush() == 0
            # More than the host tier holds: demotions cannot write, so the park is refused.
            with pytest.raises((ResourceExhausted, Unavailable)):
                for i in range(6):
                    c.park(f"fill{i}", [rand(1 * MiB, 10 + i)])
        # A sequence larger than the host tier is always staged straight to disk.
        with pytest.raises(Unavailable, match="cannot be written"):
            c.park("huge", [rand(10 * MiB, 99)])
        assert not c.present(["huge"])[0]
        with pytest.raises(Unavailable):
            c.pin("a")
        assert torch.equal(c.restore("a")[0], a)  # reads go on
        with pytest.raises(Unavailable):
            c.drop("a")  # not acknowledged: the record may come back at the next start
        check(d)
        # Step: writable again: everything works and the accounting holds.
        store.readonly = False
        c.park("b", [b], overwrite=True)
        c.flush()
        assert torch.equal(c.restore("b")[0], b)
        c.drop("b")
        check(d)
