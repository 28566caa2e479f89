"""Each tier's eviction order, kept as sequences change, so that choosing victims looks
at the coldest few, not at every indexed sequence, under the index lock.

For a key-ordered policy (``policy.order_key``: ``lru``, ``lfu``, ``s3fifo``) each tier
(``device``, ``host``, ``disk``) keeps a heap of ``(*key, seq_id)`` with lazy
deletion: an entry is live while its id's indexed version has a copy in that tier and
its key now is the entry's key (a touch pushes a new entry; the old one, a colder key,
comes out first and is discarded). No generation: an entry whose id was re-parked under
the same key is a true entry of the new version, and twins are skipped as they surface.
Nothing else is kept per sequence, and no ``Seq``: the index keeps sequences nobody uses as columns
(``rows.py``), and an entry must not keep one alive. The index answers for an id
(``bind``): the current entry of its version, and its ``Seq`` for a victim. For any
other policy (``arc``, registered ones) each tier keeps its member set of ``Seq``
records, and the pure policy orders that set: a scan of the tier, not of the index.

The disk's heap is built the first time a disk victim is wanted (one pass over the
index, once per daemon): a daemon that never evicts from disk never pays for it, and
start-up does not.

REQUIRES: the index lock (``Catalog.lock``) for everything.

Primitives:
- ``EvictionOrder(policy, tiers)``; ``keyed``: a key-ordered policy; ``bind(entry_of,
  resolve, peek)``: the index's answers, ``entry_of(seq_id, tier)`` (the current entry of
  the id's version in ``tier``, or None), ``resolve(seq_id)`` (its ``Seq``) and
  ``peek(seq_id)`` (a copy to check a victim's eligibility on, without a thaw).
- ``track(seq, tier=None)``: ``seq`` gained a copy in ``tier`` (promoted, written to
  disk), or (no tier: published, or read, so its key changed) in every tier it is in.
- ``forget(seq)``: ``seq`` left the index.
- ``victims(tier, ok, cover, index) -> list[Seq]``: the eligible sequences (``ok``) in
  the tier, in policy order, just enough that their sizes in the tier cover ``cover``
  bytes (None: all of them). ``index``: every indexed copy in the tier, as entries
  (key-ordered) or ``Seq`` records (read once, to build the disk's order).
- ``compact()``: rebuild a heap whose stale entries outnumber its live ones (the
  maintenance pass: touches without evictions would otherwise grow it).
- ``entry(seq, tier)`` / ``entry_of_meta(m)``: an entry, from a record or a policy's view.
- ``check(seqs)``: every copy of ``seqs`` is tracked under its current key.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable

from kvpark.tiers import policy

from .model import Seq

DISK = "disk"


def size_in(seq: Seq, tier: str) -> int:
    """What ``seq`` occupies in ``tier``: its charged slots, or its payload on disk."""
    return seq.manifest.nbytes if tier == DISK else seq.res[tier].charged


def meta(seq: Seq, tier: str) -> policy.SeqMeta:
    m = seq.manifest
    return policy.SeqMeta(seq.seq_id, size_in(seq, tier), m.last_access, m.priority, seq.access_count,
                          m.created_at, seq.promotions)


def has(seq: Seq, tier: str) -> bool:
    return not seq.dropped and (seq.on_disk if tier == DISK else tier in seq.res)


class EvictionOrder:
    def __init__(self, policy_name: str, tiers: Iterable[str]) -> None:
        self.policy = policy_name
        self._key = policy.order_key(policy_name)
        self.keyed = self._key is not None
        self._tiers = (*tiers, DISK)
        # Key-ordered policies: per tier, a heap of flat entries ``(*key, seq_id)`` (ties
        # order by id), and nothing else per sequence: 64 bytes and the key's float for a
        # million parked blocks, where a generation in it cost 40 more.
        self._heaps: dict[str, list[tuple]] = {t: [] for t in self._tiers}
        self._floor = {t: 0 for t in self._tiers}  # heap size after the last compaction
        # Other policies: per tier, its members (the policy orders them all when asked).
        self._members: dict[str, dict[Seq, None]] = {t: {} for t in self._tiers}
        self._built = set(tiers)  # the disk's order is built on first use (see the module docstring)
        self._entry_of: Callable[[str, str], tuple | None] = lambda sid, t: None
        self._resolve: Callable[[str], Seq] = lambda sid: None  # type: ignore[assignment,return-value]
        self._peek: Callable[[str], Seq | None] = lambda sid: None

    def bind(self, entry_of: Callable[[str, str], tuple | None], resolve: Callable[[str], Seq],
             peek: Callable[[str], Seq | None]) -> None:
        self._entry_of, self._resolve, self._peek = entry_of, resolve, peek

    def entry_of_meta(self, m: policy.SeqMeta) -> tuple:
        """A heap entry: the policy's key of ``m``, ending with the id (the built-in
        keys end with it already: no second copy)."""
        assert self._key is not None
        k = self._key(m)
        return k if k and k[-1] == m.seq_id else (*k, m.seq_id)

    def entry(self, seq: Seq, tier: str) -> tuple:
        return self.entry_of_meta(meta(seq, tier))


    def track(self, seq: Seq, tier: str | None = None) -> None:
        for t in self._tiers if tier is None else (tier,):
            if t not in self._built or not has(seq, t):
                continue
            if self._key is None:
                self._members[t][seq] = None
            else:
                heapq.heappush(self._heaps[t], self.entry(seq, t))

    def forget(self, seq: Seq) -> None:
        # Heap entries of a retired sequence go as they surface (it is ``dropped``).
        for t in self._tiers:
            self._members[t].pop(seq, None)

    def _live(self, entry: tuple, tier: str) -> bool:
        return self._entry_of(entry[-1], tier) == entry

    def victims(self, tier: str, ok: Callable[[Seq], bool], cover: int | None,
                index: Callable[[str], Iterable]) -> list[Seq]:
        if tier not in self._built:
            self._build(tier, index(tier))
        if self._key is None:
            members = self._members[tier]
            for s in [s for s in members if not has(s, tier)]:
                del members[s]
            cands = {s.seq_id: s for s in members if ok(s)}
            metas = [meta(s, tier) for s in cands.values()]
            if cover is None:
                return [cands[sid] for sid in policy.demotion_order(self.policy, metas)]
            return [cands[sid] for sid in policy.plan_demotion(self.policy, metas, cover, cover, 0)]
        heap = self._heaps[tier]
        out: list[Seq] = []
        back: list[tuple] = []
        seen: set[str] = set()
        got = 0
        while heap and (cover is None or got < cover):
            entry = heapq.heappop(heap)
            sid = entry[-1]
            if sid in seen or not self._live(entry, tier):
                continue  # re-keyed since (a touch), gone from the tier, or a twin entry
            seen.add(sid)
            back.append(entry)
            # Eligibility first on what the index has (a row is read as a detached copy):
            # a tier of pinned rows is not made ``Seq`` records by every plan. The record
            # handed out is the indexed one, checked again.
            first = self._peek(sid)
            if first is None or not ok(first):
                continue
            seq = self._resolve(sid)
            if seq is first or ok(seq):
                out.append(seq)
                got += size_in(seq, tier)
        for entry in back:  # victims stay until they are actually moved
            heapq.heappush(heap, entry)
        return out

    def _build(self, tier: str, index: Iterable) -> None:
        if self._key is None:
            self._members[tier] = {s: None for s in index if has(s, tier)}
        else:
            heap = list(index)
            heapq.heapify(heap)
            self._heaps[tier] = heap
            self._floor[tier] = len(heap)
        self._built.add(tier)

    def compact(self) -> None:
        """Drop stale entries once they outnumber the live ones (amortised: a heap is
        rebuilt only after it has doubled since the last time)."""
        if self._key is None:
            return
        for t, heap in self._heaps.items():
            if len(heap) <= 2 * self._floor[t] + 4096:
                continue
            seen: set[str] = set()
            fresh = []
            for e in heap:
                if e[-1] not in seen and self._live(e, t):
                    seen.add(e[-1])
                    fresh.append(e)
            heapq.heapify(fresh)
            self._heaps[t] = fresh
            self._floor[t] = len(fresh)

    def check(self, seqs: Iterable[Seq]) -> None:
        entries = {t: set(self._heaps[t]) for t in self._built} if self._key else {}
        for s in seqs:
            for t in self._tiers:
                if t not in self._built or not has(s, t):
                    continue  # the disk's order is built from the index when first wanted
                if self._key is None:
                    assert s in self._members[t], f"{s.seq_id}: its {t} copy is not in the eviction order"
                else:
                    assert self.entry(s, t) in entries[t], (
                        f"{s.seq_id}: its {t} copy is not in the eviction order under its key")
