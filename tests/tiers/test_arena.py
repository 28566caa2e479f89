"""Slot allocator: exact accounting, granule-packed tails, contiguous runs, all-or-nothing."""

import random

import numpy as np

from kvpark.tiers.arena import SlotAllocator

MiB = 1 << 20


def test_full_slots_and_tail_are_charged_exactly() -> None:
    a = SlotAllocator(8 * MiB, MiB)
    x = a.alloc(2 * MiB + 5000)
    assert x is not None
    assert [n for _, n in x.extents] == [MiB, MiB, 5000]
    granule = MiB // 64
    assert x.charged == 2 * MiB + granule  # 5000 bytes round up to one 16 KiB granule
    assert a.used_bytes == x.charged
    a.free(x)
    assert a.used_bytes == 0


def test_small_sequences_share_a_slot() -> None:
    a = SlotAllocator(4 * MiB, MiB)
    small = [a.alloc(4096) for _ in range(64)]
    assert all(s is not None for s in small)
    slots = {s.tail[0] for s in small}  # type: ignore[index]
    assert len(slots) == 1  # 64 granules of one slot
    assert a.used_bytes == MiB
    offsets = sorted(s.extents[0][0] for s in small)  # type: ignore[union-attr]
    assert len(set(offsets)) == 64


def test_full_blocks_prefer_one_contiguous_run() -> None:
    a = SlotAllocator(16 * MiB, MiB)
    x = a.alloc(8 * MiB)
    assert x is not None and len(x.segments()) == 1


def test_segments_merge_only_adjacent_extents_and_keep_every_byte_in_place() -> None:
    """A fragmented arena: the slots an allocation takes are not one run. ``segments()``
    (what a client writes and reads through) merges each run of adjacent extents and
    nothing else, in payload order, covering exactly the extents' bytes."""
    a = SlotAllocator(16 * MiB, MiB)
    ones = [a.alloc(MiB) for _ in range(10)]  # slots 0..9
    big = a.alloc(6 * MiB)  # slots 10..15
    assert big is not None and big.segments() == [(10 * MiB, 6 * MiB)]
    for i in (1, 4, 5):
        a.free(ones[i])  # type: ignore[arg-type]
    x = a.alloc(3 * MiB + 5000)  # no free run of 3: slots 1, 4, 5, and a tail in a fresh slot...
    assert x is None  # ...which there is not
    x = a.alloc(3 * MiB)
    assert x is not None and [o // MiB for o, _ in x.extents] == [1, 4, 5]
    assert x.segments() == [(1 * MiB, MiB), (4 * MiB, 2 * MiB)]
    a.free(big)
    y = a.alloc(4 * MiB + 5000)  # the longest runs first (10..15), then in slot order, the tail after
    assert y is not None
    segs = y.segments()
    assert sum(n for _, n in segs) == sum(n for _, n in y.extents) == 4 * MiB + 5000
    # Each segment starts where an extent starts, and runs over consecutive extents.
    ext = list(y.extents)
    i = 0
    for off, n in segs:
        assert ext[i][0] == off
        end = off
        while i < len(ext) and ext[i][0] == end and end < off + n:
            end += ext[i][1]
            i += 1
        assert end == off + n
    assert i == len(ext)


def test_all_or_nothing_when_full() -> None:
    a = SlotAllocator(4 * MiB, MiB)
    x = a.alloc(3 * MiB)
    assert x is not None
    assert a.alloc(2 * MiB) is None
    assert a.used_bytes == 3 * MiB
    assert a.alloc(MiB) is not None
    assert a.alloc(1) is None
    assert a.used_bytes == 4 * MiB


def test_zero_bytes_allocates_nothing() -> None:
    a = SlotAllocator(MiB, MiB)
    x = a.alloc(0)
    assert x is not None and x.extents == () and a.used_bytes == 0


def test_random_churn_never_overlaps_and_accounting_is_exact() -> None:
    rng = random.Random(7)
    a = SlotAllocator(32 * MiB, MiB)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            x = a.alloc(rng.choice([0, 100, 5000, MiB, MiB + 1, 3 * MiB + 77, 40000]))
            if x is not None:
                live.append(x)
        spans = sorted((o, o + n) for x in live for o, n in x.extents)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert all(e <= a.capacity for _, e in spans)
        assert a.used_bytes == sum(x.charged for x in live)
    for x in live:
        a.free(x)
    assert a.used_bytes == 0 and a.alloc(32 * MiB) is not None


def test_a_granule_freed_in_a_full_slot_is_reused_before_a_new_slot() -> None:
    # Tails are placed by scanning only the partial slots with a free granule; a slot
    # that filled up and then had a granule freed must be found again.
    a = SlotAllocator(64 * MiB, MiB)
    granule = MiB // 64
    tails = [a.alloc(granule) for _ in range(64 * 8)]  # eight full slots of one-granule tails
    assert all(t is not None for t in tails)
    hole = tails[64 * 3 + 17]
    assert hole is not None
    a.free(hole)
    again = a.alloc(granule)
    assert again is not None and again.extents == hole.extents and again.tail == hole.tail
    assert a.used_bytes == 8 * MiB
    # An allocation's compact form gives back what it was made of.
    x = a.alloc(3 * MiB + 5 * granule + 7)
    assert x is not None
    assert x.nbytes == 3 * MiB + 5 * granule + 7 and x.charged == 3 * MiB + 6 * granule
    assert [n for _, n in x.extents] == [MiB, MiB, MiB, 5 * granule + 7] and len(x.full_slots) == 3
    a.free(x)
    assert a.used_bytes == 8 * MiB


def test_remove_stale_deletes_only_arena_files_no_live_daemon_holds(tmp_path) -> None:
    """A daemon that died leaves its arena file; the next start removes it. A live
    daemon's arena (its flock held) and files that are not arenas stay."""
    from kvpark.tiers.shm import SharedArena, remove_stale

    live = SharedArena.create(str(tmp_path), 1 << 20, prefault=False)
    try:
        stale = tmp_path / "kvpark-999999-0123abcd.arena"
        stale.write_bytes(b"\0" * 4096)
        other = tmp_path / "notes.txt"
        other.write_text("not an arena")
        removed = remove_stale(str(tmp_path))
        assert removed == [stale.name]
        assert not stale.exists() and other.exists() and live.path and (tmp_path / live.path).exists()
    finally:
        live.close(unlink=True)


def _scan_take(free: "np.ndarray", n: int) -> list[int]:
    """The allocator's slot choice as it was made by scanning the whole free map: the
    reference the kept runs must agree with, slot for slot."""
    padded = np.concatenate(([False], free, [False]))
    edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    lengths = ends - starts
    fit = np.flatnonzero(lengths >= n)
    if fit.size:
        i = fit[np.argmin(lengths[fit])]
        return list(range(int(starts[i]), int(starts[i]) + n))
    chosen: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        take = min(int(lengths[i]), n - len(chosen))
        chosen.extend(range(int(starts[i]), int(starts[i]) + take))
        if len(chosen) == n:
            break
    return sorted(chosen)


def test_kept_free_runs_choose_exactly_what_a_scan_of_the_free_map_would() -> None:
    """The free runs are kept as slots come and go (a lookup per allocation, not a scan):
    through random churn of mixed sizes, every allocation takes the very slots a scan
    of the free map would have, and the runs are always the maximal runs of free slots."""
    for seed in range(6):
        rng = random.Random(seed)
        slots = rng.choice([17, 64, 200])
        a = SlotAllocator(slots * MiB, MiB)
        live = []
        for _ in range(1500):
            if live and rng.random() < 0.5:
                a.free(live.pop(rng.randrange(len(live))))
            else:
                n = rng.choice([0, 1, 1, 2, 3, 5, 8, 13]) * MiB + rng.choice([0, 0, 777, MiB // 2])
                want_full = _scan_take(a._free.copy(), n // MiB) if a.fits(n) else None
                x = a.alloc(n)
                assert (x is None) == (want_full is None)
                if x is not None:
                    assert list(x.full_slots) == want_full, (seed, n)
                    live.append(x)
            runs = sorted(a._run_at.items())
            free = np.zeros(slots, dtype=bool)
            for s, length in runs:
                free[s : s + length] = True
            assert np.array_equal(free, a._free), seed
            assert all(s1 + l1 < s2 for (s1, l1), (s2, _) in zip(runs, runs[1:])), "runs not maximal"
            assert a._lens == sorted(a._by_len) and all(a._by_len[k] == sorted(a._by_len[k]) for k in a._lens)
        for x in live:
            a.free(x)
        assert a._run_at == {0: slots} and a.used_bytes == 0
