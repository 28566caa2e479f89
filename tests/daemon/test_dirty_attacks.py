"""Attacks on write_back's dirty bounds (``daemon/dirty.py``, ``flush.write_back``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch

from kvpark.client import Client, NotFound
from kvpark.daemon.dirty import SLACK
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Write

from ..conftest import Proc, wait_until
from .disk_seams import GatedWrites
from .test_dirty_bounds import OFF, _sets, on_disk, val

KiB, MiB = 1 << 10, 1 << 20


def dirty_len(d: Daemon) -> int:
    """Entries in the dirty queue, stale ones included (what it costs in memory)."""
    with d.engine.catalog.lock:
        return len(d.engine.catalog.dirty._q)


def live_dirty(d: Daemon) -> int:
    with d.engine.catalog.lock:
        return sum(1 for s in d.engine.catalog.sequences() if s.res and not s.on_disk)


# ---------------------------------------------------------------- 1. the queue under churn


def test_dirty_queue_stays_bounded_under_churn_with_the_disk_at_its_low_mark(daemon: Callable[..., Daemon]) -> None:
    """Disk at its low mark (the steady state of a full cache): write_back never calls
    ``due``, so dropped/overwritten versions are never popped from the queue."""
    d = daemon(**{**OFF, "policy.max_dirty_s": 0.05, "tiers.disk.capacity": "8MiB", "tiers.host.capacity": "32MiB"})
    with Client(d.address) as c:
        for i in range(7):
            c.park(f"fill{i}", [val(i, MiB)])
        c.flush()  # 7 MiB on disk: above the low mark (6.4 MiB), below the high mark
        assert c.stat().tiers["disk"].used_bytes >= 7 * MiB
        for n in range(3000):  # one live key, overwritten again and again
            c.park("hot", [val(n, 1 * KiB)], overwrite=True)
    assert live_dirty(d) <= 1
    # At most twice the live entries plus the compaction slack (here: 3000 versions churned).
    assert dirty_len(d) <= 2 * live_dirty(d) + SLACK, \
        f"dirty queue holds {dirty_len(d)} entries for {live_dirty(d)} dirty sequence(s)"


# ---------------------------------------------------------------- 2. head-of-line blocking


def test_a_head_larger_than_the_room_does_not_block_smaller_sequences(daemon: Callable[..., Daemon]) -> None:
    """One old memory-only sequence bigger than the free disk room stops ``due`` at the
    queue head: nothing behind it is ever written back, though it fits easily."""
    d = daemon(**{**OFF, "policy.max_dirty_s": 0.2, "tiers.disk.capacity": "8MiB", "tiers.host.capacity": "32MiB"})
    with Client(d.address) as c:
        c.park("big", [val(0, 7 * MiB)])  # never fits in 6.4 MiB of room
        for i in range(10):
            c.park(f"small{i}", [val(1 + i, 16 * KiB)])
        wait_until(lambda: all(on_disk(d, f"small{i}") for i in range(10)), timeout=15)
        n = sum(on_disk(d, f"small{i}") for i in range(10))
        assert n == 10, f"{n}/10 small sequences written back; room {6.4 * MiB - c.stat().tiers['disk'].used_bytes:.0f}"


# ---------------------------------------------------------------- 3. memory-only again after a disk eviction


def test_a_sequence_that_lost_its_disk_copy_to_eviction_is_written_back_again(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{**OFF, "policy.max_dirty_s": 0.2, "tiers.disk.capacity": "8MiB", "tiers.host.capacity": "32MiB"})
    with Client(d.address) as c:
        ids = [f"f{i}" for i in range(12)]
        for i, k in enumerate(ids):
            c.park(k, [val(i, MiB)])
        assert wait_until(lambda: c.stat().tiers["disk"].used_bytes >= 6 * MiB, timeout=30)
        c.flush()  # the rest, evicting the coldest disk copies (memory copies stay)
        assert c.stat().tiers["disk"].evictions > 0
        evicted = [k for k in ids if not on_disk(d, k)]
        assert evicted
        for k in ids:
            if k not in evicted:
                c.drop(k)
        # The disk is nearly empty now; the evicted ones are long past max_dirty_s.
        wait_until(lambda: all(on_disk(d, k) for k in evicted), timeout=15)
        left = [k for k in evicted if not on_disk(d, k)]
        assert not left, f"memory-only with an empty disk, never written back: {left}"
    d.engine.check_invariants()


# ---------------------------------------------------------------- 4. check_invariants while write-back runs


def test_check_invariants_while_write_back_drains(daemon: Callable[..., Daemon]) -> None:
    """No client activity, only the maintenance thread writing back: ``quiet()`` holds
    off demotions, not write-back, so the check sees a batch mid-flight."""
    d = daemon(**{**OFF, "policy.max_dirty_s": 0.3, "tiers.host.capacity": "256MiB"})
    with Client(d.address) as c:
        for b in range(8):
            c.park_batch({f"b{b}-{i}": [val(i, 1 * KiB)] for i in range(1000)})
    errors = []
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and live_dirty(d):
        try:
            d.engine.check_invariants()
        except AssertionError as e:
            errors.append(str(e)[:300])
    assert not errors, errors[:3]


# ---------------------------------------------------------------- 5. drop / overwrite / TTL while a batch is written


@pytest.mark.parametrize("how", ["drop", "overwrite", "ttl"])
def test_a_version_dropped_while_written_back_never_comes_back(daemon: Callable[..., Daemon], tmp_path: Path,
                                                               how: str) -> None:
    GatedWrites.hold, GatedWrites.entered, GatedWrites.gate = "x", threading.Event(), threading.Event()
    over = {**OFF, "policy.max_dirty_s": 0.1}
    d = daemon(disk_factory=GatedWrites, **over)
    with Client(d.address) as c:
        c.park("x", [val(1)], ttl_s=1.0 if how == "ttl" else None)
        assert GatedWrites.entered.wait(10)
        if how == "drop":
            c.drop("x")
        elif how == "overwrite":
            c.park("x", [val(2)], overwrite=True)
        else:
            time.sleep(1.3)  # the maintenance thread is the one gated: expiry waits for it
        GatedWrites.gate.set()
        if how == "overwrite":
            assert wait_until(lambda: on_disk(d, "x"), timeout=10)
        time.sleep(1.0)
        if how == "ttl":
            assert wait_until(lambda: d.engine.catalog.find("x") is None, timeout=5)
    d.engine.check_invariants()
    used = d.engine.disk.used
    d.stop(2.0)
    d2 = daemon(**over)
    with Client(d2.address) as c:
        if how == "overwrite":
            assert torch.equal(c.restore("x")[0], val(2))
            assert used == 64 * KiB
        else:
            with pytest.raises(NotFound):
                c.restore("x")
            assert used == 0


# ---------------------------------------------------------------- 6. shared blocks and composites


def test_write_back_of_composites_and_blocks_under_churn(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{**OFF, "policy.max_dirty_s": 0.01, "tiers.host.capacity": "8MiB",
                  "tiers.disk.capacity": "16MiB"})
    stop = time.monotonic() + 5.0
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with Client(d.address) as c:
                n = 0
                while time.monotonic() < stop:
                    n += 1
                    b = f"blk{n % 5}"
                    try:
                        c.park(f"c{w}-{n % 7}", [val(n, 8 * KiB)], refs=[b],
                               new_blocks={b: [val(1000 + n % 5, 16 * KiB)]}, overwrite=True,
                               ttl_s=0.5 if n % 3 == 0 else None)
                    except Exception as e:  # noqa: BLE001 (full tiers are fine)
                        if "RESOURCE_EXHAUSTED" not in repr(e) and "FailedPrecondition" not in type(e).__name__:
                            raise
                    if n % 4 == 0:
                        c.drop(f"c{w}-{(n + 3) % 7}")
                    if n % 50 == 0:
                        c.flush()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    d.engine.check_invariants()  # quiet() waits for a write-back batch in flight
    with Client(d.address) as c:
        assert c.stat().tiers["disk"].used_bytes == d.engine.disk.used


# ---------------------------------------------------------------- 7. a non-KVParkError fault in a batch


class FailOnce(DiskStore):
    armed = True

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        if type(self).armed and any(w.manifest.seq_id.startswith("y") for w in writes):
            type(self).armed = False
            raise OSError(5, "Input/output error (injected)")
        return super().write_many(writes, sync=sync)


def test_a_batch_hit_by_an_unexpected_error_is_written_back_later(daemon: Callable[..., Daemon]) -> None:
    FailOnce.armed = True
    d = daemon(disk_factory=FailOnce, **{**OFF, "policy.max_dirty_s": 0.1})
    with Client(d.address) as c:
        for i in range(5):
            c.park(f"y{i}", [val(i)])
        # The maintenance pass runs every second or two: the failed batch is tried again.
        assert wait_until(lambda: not FailOnce.armed, timeout=15)
        ok = wait_until(lambda: all(on_disk(d, f"y{i}") for i in range(5)), timeout=15)
        got = [f"y{i}" for i in range(5) if on_disk(d, f"y{i}")]
        assert ok, f"only {got} written back after the one failed batch"
    d.engine.check_invariants()


# ---------------------------------------------------------------- 8. SIGKILL after write-back + drop


def test_sigkill_after_a_written_back_version_is_dropped(proc: Callable[..., Proc], tmp_path: Path) -> None:
    data = tmp_path / "data"
    flags = _sets({**OFF, "policy.max_dirty_s": 0.05})
    p = proc(*flags, data_dir=data)
    with Client(p.address) as c:
        for i in range(20):
            c.park(f"k{i}", [val(i, 4 * KiB)])
        assert wait_until(lambda: c.stat().tiers["disk"].sequences == 20, timeout=30)
        for i in range(10):
            c.drop(f"k{i}")
        for i in range(10, 20):
            c.park(f"k{i}", [val(100 + i, 4 * KiB)], overwrite=True)
    p.kill()
    q = proc(*flags, data_dir=data)
    with Client(q.address) as c:
        for i in range(10):
            with pytest.raises(NotFound):
                c.restore(f"k{i}")
        for i in range(10, 20):
            # an overwrite acknowledged but not yet written back may be lost (its old version
            # was deleted when the overwrite was acknowledged); the old version never comes back
            try:
                got = c.restore(f"k{i}")[0]
            except NotFound:
                continue
            assert torch.equal(got, val(100 + i, 4 * KiB))


# ---------------------------------------------------------------- 9. config edges


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_max_dirty_s_is_refused(value: str) -> None:
    from kvpark.daemon.config import ConfigError, load
    with pytest.raises(ConfigError):
        load(env={}, overrides={"policy.max_dirty_s": value})


# ---------------------------------------------------------------- 10. a pin while its write-back commits


class GatedAfter(DiskStore):
    """The first write transaction holding ``hold`` commits, then waits at ``gate``
    (before the mover sets ``on_disk``)."""
    hold = ""
    entered = threading.Event()
    gate = threading.Event()

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        cls = type(self)
        out = super().write_many(writes, sync=sync)
        if cls.hold and any(w.manifest.seq_id.startswith(cls.hold) for w in writes):
            cls.hold = ""
            cls.entered.set()
            assert cls.gate.wait(60)
        return out


def test_a_pin_while_written_back_survives_a_restart(daemon: Callable[..., Daemon]) -> None:
    GatedAfter.hold, GatedAfter.entered, GatedAfter.gate = "p", threading.Event(), threading.Event()
    over = {**OFF, "policy.max_dirty_s": 0.1}
    d = daemon(disk_factory=GatedAfter, **over)
    with Client(d.address) as c:
        c.park("p", [val(1)])
        assert GatedAfter.entered.wait(10)
        # The pin waits for the write in flight to land (it then updates the disk copy).
        pinned: list[bool] = []
        t = threading.Thread(target=lambda: pinned.append(c.pin("p").pinned))
        t.start()
        t.join(0.5)
        GatedAfter.gate.set()
        t.join(20)
        assert pinned == [True]
        assert wait_until(lambda: on_disk(d, "p"), timeout=10)
    d.stop(2.0)
    d2 = daemon(**over)
    with Client(d2.address) as c:
        assert c.info("p").pinned, "the pin acknowledged while p was written back is lost at restart"
