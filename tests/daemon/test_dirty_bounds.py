"""write_back's dirty bounds: memory-only data is written back in the background past
``policy.max_dirty_s``, ``max_dirty_bytes`` or ``max_dirty_sequences``, into free disk
space only, so a stop drains (and a crash loses) at most about that much."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError, NotFound
from kvpark.daemon.server import Daemon

from ..conftest import Proc, wait_until

KiB, MiB = 1 << 10, 1 << 20
OFF = {"policy.max_dirty_s": 0, "policy.max_dirty_bytes": 0, "policy.max_dirty_sequences": 0}


def val(i: int, n: int = 64 * KiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)


def on_disk(d: Daemon, seq_id: str) -> bool:
    with d.engine.catalog.lock:
        s = d.engine.catalog.find(seq_id)
        return s is not None and s.on_disk


def _sets(settings: dict) -> list[str]:
    return [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]


@pytest.mark.parametrize("bounded", [True, False], ids=["max_dirty_s", "no-bounds"])
def test_a_sequence_older_than_max_dirty_s_survives_sigkill(proc: Callable[..., Proc], tmp_path: Path,
                                                            bounded: bool) -> None:
    """The bound is what a crash may lose. Without bounds (the old behaviour) the same
    SIGKILL loses every memory-only park: the test sees the difference."""
    data = tmp_path / "data"
    flags = _sets({**OFF, "policy.max_dirty_s": 0.3} if bounded else OFF)
    p = proc(*flags, data_dir=data)
    with Client(p.address) as c:
        for i in range(12):
            c.park(f"s{i}", [val(i)])
        if bounded:
            assert wait_until(lambda: c.stat().tiers["disk"].sequences == 12, timeout=30)
        else:
            time.sleep(1.5)  # maintenance passes that must write nothing (an absence: no condition to wait on)
    p.kill()
    q = proc(*flags, data_dir=data)
    with Client(q.address) as c:
        for i in range(12):
            if bounded:
                assert torch.equal(c.restore(f"s{i}")[0], val(i))
            else:
                with pytest.raises(NotFound):
                    c.restore(f"s{i}")


def test_max_dirty_bytes_writes_back_the_oldest_and_keeps_the_newest_memory_only(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{**OFF, "policy.max_dirty_bytes": "1MiB"})
    with Client(d.address) as c:
        for i in range(8):
            c.park(f"s{i}", [val(i, 256 * KiB)])
        # 2 MiB memory-only against a 1 MiB bound: the oldest four go to disk, the newest four stay.
        assert wait_until(lambda: all(on_disk(d, f"s{i}") for i in range(4)), timeout=30)
        time.sleep(3.0)  # more passes (every second or two): they write nothing more
        assert not any(on_disk(d, f"s{i}") for i in range(4, 8))
        assert c.stat().tiers["disk"].sequences == 4
        for i in range(8):
            got = c.restore(f"s{i}")[0]
            assert torch.equal(got, val(i, 256 * KiB))
    d.engine.check_invariants()


def test_max_dirty_sequences_bounds_what_a_sigterm_drains(proc: Callable[..., Proc], tmp_path: Path) -> None:
    data = tmp_path / "data"
    flags = _sets({**OFF, "policy.max_dirty_sequences": 50})
    p = proc(*flags, data_dir=data)
    with Client(p.address) as c:
        c.park_batch({f"b{i}": [val(i, 1 * KiB)] for i in range(500)})
        assert wait_until(lambda: c.stat().tiers["disk"].sequences >= 450, timeout=60)
    assert p.terminate() == 0
    out = p.output()
    while not out.endswith("") or "flush:" not in out:  # the pump may still be reading
        line = p.lines.get(timeout=10)
        p.seen.append(line)
        out += line
        if line == "":
            break
    # The stop's flush wrote only what the bound left memory-only.
    flushed = list(re.finditer(r"flush: (\d+)/(\d+) memory-only", out))
    assert flushed and int(flushed[-1].group(2)) <= 50, flushed
    q = proc(*flags, data_dir=data)
    with Client(q.address) as c:
        got = c.restore_many([f"b{i}" for i in range(500)])[1]
        assert all(torch.equal(t, val(i, 1 * KiB)) for i, t in enumerate(got))


def test_write_back_fills_only_free_disk_space_and_never_evicts(daemon: Callable[..., Daemon]) -> None:
    # Disk 8 MiB, low mark 0.8: write-back fills at most 6.4 MiB. Six 1 MiB sequences go;
    # the next four find no room and stay memory-only, and nothing is evicted for them.
    d = daemon(**{**OFF, "policy.max_dirty_s": 0.2, "tiers.disk.capacity": "8MiB", "tiers.host.capacity": "32MiB"})
    with Client(d.address) as c:
        for i in range(6):
            c.park(f"old{i}", [val(i, MiB)])
        assert wait_until(lambda: all(on_disk(d, f"old{i}") for i in range(6)), timeout=30)
        for i in range(4):
            c.park(f"new{i}", [val(10 + i, MiB)])
        time.sleep(2.0)  # several passes past max_dirty_s
        st = c.stat()
        assert st.tiers["disk"].sequences == 6 and st.tiers["disk"].evictions == 0
        assert all(on_disk(d, f"old{i}") for i in range(6)) and not any(on_disk(d, f"new{i}") for i in range(4))
        # The stop's flush still writes them, evicting as it always has.
        assert c.flush() >= 1
    d.engine.check_invariants()


def test_write_back_racing_overwrites_and_drops_keeps_the_index_and_disk_agreeing(
        daemon: Callable[..., Daemon]) -> None:
    """Every write-back batch reads memory copies outside the index lock: versions
    overwritten or dropped meanwhile must not leave stray records or a stale on_disk."""
    d = daemon(**{**OFF, "policy.max_dirty_s": 0.01, "tiers.host.capacity": "32MiB"})
    stop = time.monotonic() + 6.0
    errors: list[BaseException] = []
    last: dict[str, int] = {}
    lock = threading.Lock()

    def worker(w: int) -> None:
        rng = torch.Generator().manual_seed(w)
        try:
            with Client(d.address, transport="shm" if w % 2 else "inline") as c:
                n = 0
                while time.monotonic() < stop:
                    k = f"k{int(torch.randint(0, 6, (1,), generator=rng))}"
                    n += 1
                    v = w * 100000 + n
                    if n % 5 == 0:
                        with lock:
                            c.drop(k)
                            last.pop(k, None)
                    else:
                        with lock:
                            c.park(k, [val(v, 32 * KiB)], overwrite=True)
                            last[k] = v
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    d.engine.check_invariants()  # quiet() waits for a write-back batch in flight
    with Client(d.address) as c:
        for k, v in last.items():
            assert torch.equal(c.restore(k)[0], val(v, 32 * KiB))


def test_the_bounds_are_checked_at_start() -> None:
    from kvpark.daemon.config import ConfigError, load
    with pytest.raises(ConfigError, match="max_dirty_s"):
        load(env={}, overrides={"policy.max_dirty_s": -1})
    with pytest.raises(ConfigError, match="max_dirty_sequences"):
        load(env={}, overrides={"policy.max_dirty_sequences": -5})
    with pytest.raises(ConfigError, match="max_dirty_bytes"):
        load(env={}, overrides={"policy.max_dirty_bytes": "-1MiB"})


def test_the_dirty_set_counts_exactly_and_its_queue_stays_compact() -> None:
    """The set's counts follow every way in and out; stale queue entries (sequences that
    left, some of which came back) never get picked twice and are compacted away."""
    from kvpark.daemon.dirty import SLACK, Dirty
    from kvpark.daemon.model import ParkSpec, Seq
    from kvpark.proto.layout import TensorMeta
    from kvpark.tiers.arena import Allocation

    def seq(i: int) -> Seq:
        spec = ParkSpec(f"s{i}", (TensorMeta("uint8", (100,), 100),), 100)
        return Seq(manifest=spec.manifest(i + 1, 1 << 20), res={"host": Allocation(1 << 20, (0,), None)})

    d = Dirty(max_s=10.0)
    seqs = [seq(i) for i in range(3000)]
    for s in seqs:
        d.track(s, 1.0)
    assert (d.sequences, d.bytes) == (3000, 300_000)
    for s in seqs[:2990]:  # written some other way, or dropped
        d.untrack(s)
    assert (d.sequences, d.bytes) == (10, 1000) and len(d._q) <= 2 * 10 + SLACK
    d.track(seqs[0], 5.0)  # back again (its disk copy evicted): one live entry, not two picks
    assert not d.due(6.0, 1 << 30, 100, 1 << 30)  # none is 10 s old yet
    got = d.due(12.0, 1 << 30, 100, 1 << 30)
    assert got == seqs[2990:] and d.sequences == 1  # the one that came back is 7 s old
    assert d.due(16.0, 1 << 30, 100, 1 << 30) == [seqs[0]] and (d.sequences, d.bytes) == (0, 0)


def test_a_write_back_batch_holds_at_most_its_count_and_bytes_and_skips_what_has_no_room() -> None:
    """``due`` takes the oldest past a bound, at most ``count`` sequences and ``nbytes`` in
    all (one larger than the budget still goes alone, first, so it is never stuck), and
    passes over one larger than the disk ``room`` left, taking younger ones that fit."""
    from kvpark.daemon.dirty import Dirty
    from kvpark.daemon.model import ParkSpec, Seq
    from kvpark.proto.layout import TensorMeta
    from kvpark.tiers.arena import Allocation

    def seq(i: int, n: int) -> Seq:
        spec = ParkSpec(f"s{i}", (TensorMeta("uint8", (n,), n),), n)
        return Seq(manifest=spec.manifest(i + 1, 1 << 20), res={"host": Allocation(1 << 20, (0,), None)})

    d = Dirty(max_s=1.0)
    seqs = [seq(i, 100) for i in range(6)]
    for s in seqs:
        d.track(s, 0.0)
    assert d.due(5.0, 1 << 30, 100, 250) == seqs[:2]  # 200 bytes; a third would make 300
    assert d.due(5.0, 1 << 30, 100, 300) == seqs[2:5]  # exactly the budget
    assert d.due(5.0, 1 << 30, 100, 50) == seqs[5:]  # larger than the budget, alone
    d = Dirty(max_s=1.0)
    seqs = [seq(0, 500), seq(1, 100), seq(2, 100), seq(3, 100)]
    for s in seqs:
        d.track(s, 0.0)
    assert d.due(5.0, 1 << 30, 2, 1 << 30) == seqs[:2]  # the count
    d = Dirty(max_s=1.0)
    for s in seqs:
        s.dirty_since = 0.0
        d.track(s, 0.0)
    assert d.due(5.0, 250, 100, 1 << 30) == seqs[1:3]  # 500 has no room; 100 + 100 fit 250
    assert d.sequences == 2 and d.due(5.0, 1 << 30, 100, 1 << 30) == [seqs[0], seqs[3]]
