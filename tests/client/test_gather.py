"""A CPU park's copies as one ``torch.cat`` per pool segment (``payload.gather``): every
byte lands where ``runs`` would put it, nothing outside the segments is written, and a
case it does not cover (a tensor off the CPU, flats that do not fill the segments)
copies nothing and says so, so the caller's per-run copies take over."""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest
import torch

from kvpark.client import Client, transport
from kvpark.client.payload import gather, runs
from kvpark.daemon.server import Daemon

KiB, MiB = 1 << 10, 1 << 20


def blob(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def by_runs(flats: list[torch.Tensor], pool: torch.Tensor, segs: list[tuple[int, int]]) -> None:
    for src, base, n in runs(flats, segs):
        pool[base : base + n].copy_(src)


def test_gather_puts_every_byte_where_runs_does_and_nothing_else() -> None:
    rng = random.Random(7)
    for case in range(200):
        lengths = [rng.choice([0, 1, 3, 64, 100, 257]) for _ in range(rng.randint(1, 9))]
        total = sum(lengths)
        # Cut the payload into segments at random points, scattered over a pool with gaps.
        cuts = sorted(rng.sample(range(1, total), min(rng.randint(0, 4), max(total - 1, 0)))) if total > 1 else []
        bounds = [0, *cuts, total]
        segs, at = [], 0
        for a, b in zip(bounds, bounds[1:]):
            at += rng.randint(0, 50)
            segs.append((at, b - a))
            at += b - a
        rng.shuffle(segs) if case % 3 == 0 else None  # segments need not ascend in the pool
        # Sources: separate tensors; views of one storage side by side (joined into one
        # part); views of one storage with gaps between them, in shuffled order.
        base = blob(case, 2 * total + 64)
        flats, pos = [], 0
        starts = list(range(len(lengths)))
        if case % 4 == 3:
            rng.shuffle(starts)
        where = [0] * len(lengths)
        for k in starts:
            where[k] = pos
            pos += lengths[k] + rng.randint(0, 2)
        for k, n in enumerate(lengths):
            if case % 4 == 1:
                flats.append(base[sum(lengths[:k]) : sum(lengths[:k]) + n])
            elif case % 4 == 3:
                flats.append(base[where[k] : where[k] + n])
            else:
                flats.append(blob(case * 31 + k, n))
        want = torch.full((at + 16,), 0xAB, dtype=torch.uint8)
        got = want.clone()
        by_runs(flats, want, segs)
        assert gather(flats, got, segs)
        assert torch.equal(got, want), f"case {case}: {lengths} into {segs}"


def test_neighbours_in_memory_are_joined_only_within_one_storage() -> None:
    mem = blob(3, 600)
    raw = memoryview(mem.numpy())
    # Two storages side by side in memory (each its own buffer), and two views of one.
    a, b = torch.frombuffer(raw[0:200], dtype=torch.uint8), torch.frombuffer(raw[200:400], dtype=torch.uint8)
    assert a.data_ptr() + 200 == b.data_ptr()
    c, d = mem[400:500], mem[500:600]
    pool = torch.zeros(700, dtype=torch.uint8)
    assert gather([a, b, c, d], pool, [(50, 600)])
    assert torch.equal(pool[50:650], mem) and not pool[:50].any() and not pool[650:].any()


def test_gather_copies_nothing_when_the_flats_do_not_fill_the_segments() -> None:
    flats = [blob(1, 100), blob(2, 50)]
    for segs in ([(0, 100), (200, 60)], [(0, 100), (200, 40)], [(0, 150), (300, 10)]):
        pool = torch.zeros(512, dtype=torch.uint8)
        assert not gather(flats, pool, segs)
        assert not pool.any(), f"{segs}: bytes were written"


def test_gather_leaves_tensors_off_the_cpu_to_the_per_run_copies() -> None:
    pool = torch.zeros(256, dtype=torch.uint8)
    off_cpu = torch.empty(64, dtype=torch.uint8, device="meta")
    assert not gather([blob(1, 64), off_cpu], pool, [(0, 128)])
    assert not gather([blob(1, 64)], torch.empty(256, dtype=torch.uint8, device="meta"), [(0, 64)])
    assert not pool.any()


def fragment(c: Client, sizes: list[int]) -> None:
    """Park sequences of ``sizes``, then drop every other one: the next park's
    reservation is cut into several runs of the arena."""
    for i, n in enumerate(sizes):
        c.park(f"frag{i}", [blob(900 + i, n)])
    for i in range(0, len(sizes), 2):
        c.drop(f"frag{i}")


def test_a_shm_park_through_gather_restores_byte_exact_across_scattered_slots(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon(tiers__host__capacity="8MiB", tiers__host__slot_size="64KiB")
    calls: list[tuple[int, bool]] = []
    real = transport.gather

    def watched(flats: Any, pool: Any, segs: Any) -> bool:
        done = real(flats, pool, segs)
        calls.append((len(segs), done))
        return done

    monkeypatch.setattr(transport, "gather", watched)
    with Client(d.address, transport="shm") as c:
        fragment(c, [192 * KiB] * 10)
        # Many tensors of odd sizes (some empty), some cut across the arena's runs.
        tensors = [blob(i, n) for i, n in enumerate([3000, 0, 70 * KiB, 1, 200 * KiB, 5, 300 * KiB, 64 * KiB] * 3)]
        tensors.append(torch.arange(3 * 5 * 7, dtype=torch.float32).reshape(3, 5, 7).transpose(0, 2))
        c.park("many", tensors)
        out = c.restore("many")
        assert len(out) == len(tensors)
        for i, (a, b) in enumerate(zip(tensors, out)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"tensor {i}"
        # The neighbours it was parked between are intact.
        for i in range(1, 10, 2):
            assert torch.equal(c.restore(f"frag{i}")[0], blob(900 + i, 192 * KiB)), f"frag{i}"
    scattered = [n for n, done in calls if done and n > 1]
    assert scattered, f"no park went through gather into several runs: {calls}"
    assert all(done for _, done in calls), calls
