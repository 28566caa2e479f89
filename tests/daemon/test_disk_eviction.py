"""Disk eviction without a remote tier (``policy.disk_full = "evict"``, the default):
parks many times the disk's capacity all succeed, the disk stays bounded, the coldest
sequences go, pinned ones stay; ``"refuse"`` keeps today's RESOURCE_EXHAUSTED."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, NotFound, ResourceExhausted
from kvpark.daemon.server import Daemon

from ..conftest import wait_until

MiB = 1 << 20
DISK = 8 * MiB
# LMDB keeps freed pages for reuse, so its file outgrows the payload by its free list,
# branch pages and manifests: the margin the churn test holds it to.
MARGIN = DISK // 4 + MiB


def _on_disk(path: Path) -> int:
    """Bytes the data dir occupies (allocated blocks, not apparent sizes)."""
    return sum(os.stat(p).st_blocks * 512 for p in path.rglob("*") if p.is_file())


def _blob(i: int, n: int = 256 << 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_disk_churn_ten_times_capacity(daemon: Callable[..., Daemon], tmp_path: Path, transport: str) -> None:
    # 1. A 4 MiB host tier over an 8 MiB disk; 256 KiB sequences (above the one-round-trip size).
    d = daemon(**{"tiers.host.capacity": "4MiB", "tiers.disk.capacity": "8MiB"})
    n = (10 * DISK) // (256 << 10)  # 320 parks: ten times the disk
    with Client(d.address, transport=transport) as c:
        # 2. A sequence pinned once it sits on disk: it must survive every eviction.
        c.park("keep", [_blob(-1)])
        i = 0
        while c.info("keep").tier != "disk":
            c.park(f"s{i}", [_blob(i)])
            i += 1
            assert i < n, "keep never reached the disk"
        c.pin("keep")
        # 3. The churn: every park succeeds; the data dir stays bounded all along.
        peak = 0
        t0 = time.perf_counter()
        for j in range(i, n):
            c.park(f"s{j}", [_blob(j)])
            if j % 16 == 0:
                peak = max(peak, _on_disk(tmp_path / "disk"))
        rate = (n - i) / (time.perf_counter() - t0)
        peak = max(peak, _on_disk(tmp_path / "disk"))
        print(f"\n{transport}: {n - i} parks at 10x the disk capacity: {rate:.0f} parks/s; "
              f"data dir peak {peak / MiB:.1f} MiB for an {DISK // MiB} MiB disk")
        assert peak <= DISK + MARGIN, f"data dir grew to {peak} bytes"
        st = c.stat()
        assert st.tiers["disk"].used_bytes <= DISK
        assert st.tiers["disk"].evictions > 0
        # 4. The newest restore bit-exact; the oldest are gone; the pinned one is intact.
        for j in range(n - 4, n):
            assert torch.equal(c.restore(f"s{j}")[0], _blob(j))
        for j in range(4):
            with pytest.raises(NotFound):
                c.restore(f"s{j}")
        assert torch.equal(c.restore("keep")[0], _blob(-1))

    with d.engine.mover.quiet():
        d.engine.check_invariants()


def test_disk_evictions_in_metrics(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.capacity": "4MiB", "tiers.disk.capacity": "4MiB", "metrics.listen": "127.0.0.1:0"})
    with Client(d.address) as c:
        for j in range(40):
            c.park(f"s{j}", [_blob(j)])
        assert wait_until(lambda: c.stat().tiers["disk"].evictions > 0)
    import urllib.request

    body = urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=10).read().decode()
    line = next(ln for ln in body.splitlines() if ln.startswith('kvpark_evictions_total{tier="disk"}'))
    assert float(line.split()[-1]) > 0


def test_disk_full_refuse_keeps_resource_exhausted(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.capacity": "4MiB", "tiers.disk.capacity": "3MiB", "policy.disk_full": "refuse"})
    with Client(d.address) as c:
        assert c.stat().tiers["disk"].state == "ok"  # empty
        with pytest.raises(ResourceExhausted):
            for j in range(40):
                c.park(f"s{j}", [_blob(j, MiB)])
        st = c.stat().tiers["disk"]
        assert st.evictions == 0
        # Less than a slot free: what ``stat`` and the CLI show as the disk's state.
        assert st.capacity_bytes - st.used_bytes < MiB and st.state == "full"
        assert torch.equal(c.restore("s0")[0], _blob(0, MiB))  # nothing was dropped
    d.engine.check_invariants()


def test_write_through_evicts_too(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.capacity": "4MiB", "tiers.disk.capacity": "4MiB", "policy.write": "write_through"})
    with Client(d.address) as c:
        for j in range(48):
            c.park(f"s{j}", [_blob(j)])
        assert torch.equal(c.restore("s47")[0], _blob(47))
        assert c.stat().tiers["disk"].evictions > 0
    with d.engine.mover.quiet():
        d.engine.check_invariants()


def test_disk_churn_with_shared_blocks(daemon: Callable[..., Daemon]) -> None:
    # Sequences that start with a shared block each: evicting a sequence from disk
    # releases its block with it; a block a pinned sequence references stays.
    d = daemon(**{"tiers.host.capacity": "4MiB", "tiers.disk.capacity": "8MiB"})
    small = torch.arange(16, dtype=torch.int32)
    with Client(d.address) as c:
        c.park("keep", [small], refs=["kb"], new_blocks={"kb": [_blob(-1)]})
        i = 0
        while c.info("keep").tier != "disk" or c.info("kb").tier != "disk":
            c.park(f"s{i}", [small], refs=[f"b{i}"], new_blocks={f"b{i}": [_blob(i)]})
            i += 1
            assert i < 400, "keep never reached the disk"
        c.pin("keep")
        for j in range(i, i + 200):  # 50 MiB of blocks through an 8 MiB disk
            c.park(f"s{j}", [small], refs=[f"b{j}"], new_blocks={f"b{j}": [_blob(j)]})
        assert c.stat().tiers["disk"].evictions > 0
        gone = [not p for p in c.present(["s0", "b0"])]
        assert all(gone), "the oldest sequence and its block were evicted together"
        _, out = c.restore_many(["keep"])
        assert torch.equal(out[0], _blob(-1)) and torch.equal(out[1], small)
        last = i + 199
        _, out = c.restore_many([f"s{last}"])
        assert torch.equal(out[0], _blob(last))
    with d.engine.mover.quiet():
        d.engine.check_invariants()


def test_with_nothing_to_evict_to_eviction_says_it_made_no_room(daemon: Callable[..., Daemon]) -> None:
    """``policy.disk_full = "refuse"`` and no remote tier: the disk has nowhere to send
    its coldest, so ``evict_disk`` must answer False (it did not get there) and touch
    nothing; a True would tell its caller there is room that nobody made."""
    d = daemon(**{"tiers.host.capacity": "4MiB", "tiers.disk.capacity": "3MiB", "policy.disk_full": "refuse",
                  "policy.write": "write_through"})
    assert d.engine is not None and d.engine.remote is None
    with Client(d.address) as c:
        for j in range(2):
            c.park(f"s{j}", [_blob(j, MiB)])
        used = c.stat().tiers["disk"].used_bytes
        assert used == 2 * MiB
        mover = d.engine.mover
        assert not mover.evict_disk(2 * MiB)  # room for 2 MiB more: only by dropping one
        assert not mover.evict_disk(0, target=0)
        assert c.stat().tiers["disk"].used_bytes == used and c.stat().tiers["disk"].evictions == 0
        assert all(torch.equal(c.restore(f"s{j}")[0], _blob(j, MiB)) for j in range(2))
    d.engine.check_invariants()
