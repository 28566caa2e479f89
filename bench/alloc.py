"""Slot allocation cost, side by side: the kept free runs against a scan of the free map.

The host arena's allocator used to find a run of free slots by scanning the whole free
map (numpy) on every allocation; it now keeps the free runs as slots come and go. Both
run here in one process on one fragmented arena per size (every other 2 MiB block
freed), and the figures are the mean cost of one allocation of 2 MiB plus its free.

    .venv/bin/python bench/alloc.py [--reps 3000]
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from kvpark.tiers.arena import SlotAllocator

MiB = 1 << 20


class ScanAllocator(SlotAllocator):
    """The same allocator choosing slots by a scan of the free map (the old way)."""

    def _release_range(self, a: int, b: int) -> None:
        pass

    def _take_slots(self, n: int) -> list[int]:
        if n == 0:
            return []
        padded = np.concatenate(([False], self._free, [False]))
        edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
        starts, ends = edges[0::2], edges[1::2]
        lengths = ends - starts
        fit = np.flatnonzero(lengths >= n)
        if fit.size:
            i = fit[np.argmin(lengths[fit])]
            chosen = list(range(int(starts[i]), int(starts[i]) + n))
        else:
            chosen = []
            for i in np.argsort(-lengths, kind="stable"):
                take = min(int(lengths[i]), n - len(chosen))
                chosen.extend(range(int(starts[i]), int(starts[i]) + take))
                if len(chosen) == n:
                    break
            chosen.sort()
        self._free[chosen] = False
        self._nfree -= n
        return chosen


def per_call_us(cls: type, slots: int, reps: int) -> float:
    a = cls(slots * MiB, MiB)
    blocks = [a.alloc(2 * MiB) for _ in range(slots // 4)]
    for x in blocks[::2]:
        a.free(x)

    def one() -> None:
        a.free(a.alloc(2 * MiB))

    return min(timeit.repeat(one, number=reps, repeat=3)) / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3000)
    args = ap.parse_args()
    print(f"{'slots (1 MiB)':>14}{'scan µs':>10}{'runs µs':>10}{'runs/scan':>11}")
    for slots in (1024, 5120, 65536):
        scan = per_call_us(ScanAllocator, slots, args.reps)
        kept = per_call_us(SlotAllocator, slots, args.reps)
        print(f"{slots:>14}{scan:>10.1f}{kept:>10.1f}{kept / scan:>10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
