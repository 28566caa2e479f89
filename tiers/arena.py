"""Fixed-size slot allocation over one flat byte range (the host arena; later the device pool).

The range is cut into ``slot_size`` slots. A payload of ``n`` bytes becomes
``n // slot_size`` full blocks plus one tail block. Full blocks take whole slots,
preferring one contiguous run so a client copies a large tensor in one go. The tail is
rounded up to a *granule* (``slot_size / 64``) and packed with other tails inside
shared slots, so a 4 KiB sequence costs 16 KiB (with 1 MiB slots), not a whole slot.

Primitives:
- ``SlotAllocator(capacity, slot_size)``.
- ``alloc(nbytes) -> Allocation | None``: all-or-nothing; ``None`` when it does not fit.
- ``free(allocation)``.
- ``used_bytes``, ``capacity``, ``free_bytes``, ``fits(nbytes)``.
- ``Allocation.extents``: one ``(offset, length)`` per block, in payload order;
  ``Allocation.segments()`` merges adjacent extents for clients. An allocation is
  stored as its full slots plus its tail packed into one int (the index holds one per
  parked block, a million of them at scale); ``extents`` is derived from that.

Tails are placed by first fit over the partial slots that still have a free granule
(kept apart from the full ones), so placing one does not scan every partial slot. Full
blocks take the smallest run of free slots that holds them (the lowest of those); the
maximal free runs are kept as slots come and go (by start, by end, and by length), so
finding one is a lookup, not a scan of the free map: 6-8 µs per allocation from 1k to
64k slots, where the scan cost 19-177 µs (``bench/alloc.py``).

Pure bookkeeping: no memory is touched here, so it is unit-tested without I/O.
Not thread-safe; the engine calls it under its lock.
"""

from __future__ import annotations

import bisect

import numpy as np

GRANULES_PER_SLOT = 64
_FULL = (1 << GRANULES_PER_SLOT) - 1


class Allocation:
    """Where a payload lives. ``extents[i]`` is block ``i``: ``(arena_offset, length)``.

    Immutable. Stored compactly (a million small parked blocks each hold one): the full
    slots, and the tail packed into one int; ``extents`` is derived on demand (and kept
    only for payloads of more than one block, which are few and read block by block).
    """

    __slots__ = ("slot_size", "full_slots", "_tail", "_ext")

    def __init__(self, slot_size: int, full_slots: tuple[int, ...], tail: tuple[int, int, int, int] | None) -> None:
        self.slot_size = slot_size
        self.full_slots = full_slots
        # (slot, first granule, granule count, length) -> one int; 0: no tail (a tail is never empty).
        self._tail = 0 if tail is None else (((tail[0] << 6 | tail[1]) << 6 | (tail[2] - 1)) * slot_size + tail[3])
        self._ext: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def packed(cls, slot_size: int, full_slots: tuple[int, ...], packed_tail: int) -> "Allocation":
        """An allocation from its stored form (``full_slots`` and ``packed_tail``, as
        an index that keeps allocations in columns holds them)."""
        a = object.__new__(cls)
        a.slot_size, a.full_slots, a._tail, a._ext = slot_size, full_slots, packed_tail, None
        return a

    @property
    def packed_tail(self) -> int:
        """The tail packed into one int (0: none): with ``slot_size`` and ``full_slots``,
        everything an allocation is (``Allocation.packed``)."""
        return self._tail

    def _unpack(self) -> tuple[int, int, int, int]:
        rest, length = divmod(self._tail, self.slot_size)
        return rest >> 12, (rest >> 6) & 63, (rest & 63) + 1, length

    @property
    def tail(self) -> tuple[int, int, int] | None:
        """(slot, first granule, granule count) of the packed tail, or None."""
        return self._unpack()[:3] if self._tail else None

    @property
    def charged(self) -> int:
        """Bytes of capacity this allocation holds."""
        n = len(self.full_slots) * self.slot_size
        return n + self._unpack()[2] * (self.slot_size // GRANULES_PER_SLOT) if self._tail else n

    @property
    def nbytes(self) -> int:
        n = len(self.full_slots) * self.slot_size
        return n + self._tail % self.slot_size if self._tail else n

    @property
    def extents(self) -> tuple[tuple[int, int], ...]:
        if self._ext is not None:
            return self._ext
        ss = self.slot_size
        ext = tuple((s * ss, ss) for s in self.full_slots)
        if self._tail:
            slot, g, _k, length = self._unpack()
            ext += ((slot * ss + g * (ss // GRANULES_PER_SLOT), length),)
        if self.full_slots:
            self._ext = ext
        return ext

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Allocation) and self.slot_size == other.slot_size
                and self.full_slots == other.full_slots and self._tail == other._tail)

    def __hash__(self) -> int:
        return hash((self.slot_size, self.full_slots, self._tail))

    def __repr__(self) -> str:
        return f"Allocation(extents={self.extents}, charged={self.charged})"

    def segments(self) -> list[tuple[int, int]]:
        out: list[list[int]] = []
        for off, n in self.extents:
            if out and out[-1][0] + out[-1][1] == off:
                out[-1][1] += n
            else:
                out.append([off, n])
        return [(o, n) for o, n in out]


class SlotAllocator:
    def __init__(self, capacity: int, slot_size: int) -> None:
        if slot_size % GRANULES_PER_SLOT:
            raise ValueError("slot_size must be a multiple of 64")
        self.slot_size = slot_size
        self.granule = slot_size // GRANULES_PER_SLOT
        self.nslots = capacity // slot_size
        self.capacity = self.nslots * slot_size
        self._free = np.ones(self.nslots, dtype=bool)  # the truth, for the double-free checks
        self._nfree = self.nslots
        # The maximal runs of free slots, kept as slots come and go, so taking a run is a
        # lookup, not a scan of the whole free map (which cost 0.4 ms per allocation at
        # 64k slots): start -> length, end -> start (to merge a freed run with its
        # neighbours), and the starts of each length, sorted, with the lengths sorted.
        self._run_at: dict[int, int] = {}
        self._run_end: dict[int, int] = {}
        self._by_len: dict[int, list[int]] = {}
        self._lens: list[int] = []
        if self.nslots:
            self._add_run(0, self.nslots)
        self._partial: dict[int, int] = {}  # slot -> bitmask of used granules
        # The partial slots that still have a free granule, in the order they last gained
        # one: a tail is placed by scanning these, not every partial slot (with a million
        # small blocks nearly all are full, and a scan of them all made each park O(n)).
        self._open: dict[int, None] = {}
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def _split(self, nbytes: int) -> tuple[int, int]:
        return nbytes // self.slot_size, nbytes % self.slot_size

    def fits(self, nbytes: int) -> bool:
        nfull, tail = self._split(nbytes)
        if tail == 0:
            return nfull <= self._nfree
        k = -(-tail // self.granule)
        if self._find_tail_slot(k) is not None:
            return nfull <= self._nfree
        return nfull + 1 <= self._nfree

    def _find_tail_slot(self, k: int) -> tuple[int, int] | None:
        want = (1 << k) - 1
        for slot in self._open:
            mask = self._partial[slot]
            for g in range(GRANULES_PER_SLOT - k + 1):
                if not (mask >> g) & want:
                    return slot, g
        return None

    def _add_run(self, start: int, length: int) -> None:
        self._run_at[start] = length
        self._run_end[start + length] = start
        starts = self._by_len.get(length)
        if starts is None:
            self._by_len[length] = [start]
            bisect.insort(self._lens, length)
        else:
            bisect.insort(starts, start)

    def _remove_run(self, start: int) -> int:
        length = self._run_at.pop(start)
        del self._run_end[start + length]
        starts = self._by_len[length]
        del starts[bisect.bisect_left(starts, start)]
        if not starts:
            del self._by_len[length]
            del self._lens[bisect.bisect_left(self._lens, length)]
        return length

    def _release_range(self, a: int, b: int) -> None:
        """Slots ``[a, b)`` are free again: one run, merged with the free runs beside it."""
        if a in self._run_end:
            a = self._run_end[a]
            self._remove_run(a)
        if b in self._run_at:
            b += self._remove_run(b)
        self._add_run(a, b - a)

    def _take_from(self, start: int, n: int) -> None:
        """The first ``n`` slots of the free run at ``start``."""
        length = self._remove_run(start)
        if length > n:
            self._add_run(start + n, length - n)

    def _take_slots(self, n: int) -> list[int]:
        """Take ``n`` free slots, preferring the smallest single run that holds them all
        (the lowest such); else the longest runs first (then the lowest), in slot order."""
        if n == 0:
            return []
        i = bisect.bisect_left(self._lens, n)
        if i < len(self._lens):
            start = self._by_len[self._lens[i]][0]
            self._take_from(start, n)
            chosen = list(range(start, start + n))
        else:
            chosen = []
            for start, length in sorted(self._run_at.items(), key=lambda r: (-r[1], r[0])):
                take = min(length, n - len(chosen))
                self._take_from(start, take)
                chosen.extend(range(start, start + take))
                if len(chosen) == n:
                    break
            chosen.sort()
        self._free[chosen] = False
        self._nfree -= n
        return chosen

    def alloc(self, nbytes: int) -> Allocation | None:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if not self.fits(nbytes):
            return None
        nfull, tail = self._split(nbytes)
        slots = self._take_slots(nfull)
        tail_rec = None
        charged = nfull * self.slot_size
        if tail:
            k = -(-tail // self.granule)
            found = self._find_tail_slot(k)
            if found is None:
                (slot,) = self._take_slots(1)
                self._partial[slot] = 0
                self._open[slot] = None
                g = 0
            else:
                slot, g = found
            self._partial[slot] |= ((1 << k) - 1) << g
            if self._partial[slot] == _FULL:
                del self._open[slot]
            tail_rec = (slot, g, k, tail)
            charged += k * self.granule
        self.used_bytes += charged
        return Allocation(self.slot_size, tuple(slots), tail_rec)

    def free(self, a: Allocation) -> None:
        if a.full_slots:
            idx = list(a.full_slots)
            assert not self._free[idx].any(), "double free of arena slots"
            self._free[idx] = True
            self._nfree += len(idx)
            idx.sort()
            lo = prev = idx[0]
            for slot in idx[1:]:
                if slot != prev + 1:
                    self._release_range(lo, prev + 1)
                    lo = slot
                prev = slot
            self._release_range(lo, prev + 1)
        if a.tail is not None:
            slot, g, k = a.tail
            bits = ((1 << k) - 1) << g
            assert self._partial[slot] & bits == bits, "double free of arena granules"
            self._partial[slot] &= ~bits
            self._open[slot] = None
            if self._partial[slot] == 0:
                del self._partial[slot]
                del self._open[slot]
                self._free[slot] = True
                self._nfree += 1
                self._release_range(slot, slot + 1)
        self.used_bytes -= a.charged
        assert self.used_bytes >= 0
