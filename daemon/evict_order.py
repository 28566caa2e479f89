"""Each tier's eviction order, kept as sequences change, so that choosing victims looks
at the coldest few, not at every indexed sequence, under the index lock.

For a key-ordered policy (``policy.order_key``: ``lru``, ``lfu``, ``s3fifo``) each tier
(``device``, ``host``, ``disk``) keeps a heap of ``(key, n, seq)`` with lazy deletion:
an entry is live while its sequence still has a copy in that tier, is not dropped, and
its current key there is the entry's key (a touch pushes a new entry; the old one, a
colder key, comes out first and is discarded). For any other policy (``arc``, registered
ones) each tier keeps its member set, and the pure policy orders that set: a scan of the
tier, not of the index.

The disk's heap is built the first time a disk victim is wanted (one pass over the
index, once per daemon): a daemon that never evicts from disk never pays for it, and
start-up does not.

REQUIRES: the index lock (``Catalog.lock``) for everything.

Primitives:
- ``EvictionOrder(policy, tiers)``.
- ``track(seq)``: ``seq`` has copies where it has them now (published, promoted,
  written to disk) or its access metadata changed (a touch): (re)key it in each tier.
- ``forget(seq)``: ``seq`` left the index.
- ``victims(tier, ok, cover, index) -> list[Seq]``: the eligible sequences (``ok``) in
  the tier, in policy order, just enough that their sizes in the tier cover ``cover``
  bytes (None: all of them). ``index``: every indexed sequence (read once, to build the
  disk's heap).
- ``compact()``: rebuild a heap whose stale entries outnumber its live ones (the
  maintenance pass: touches without evictions would otherwise grow it).
- ``check(seqs)``: every copy of ``seqs`` is tracked under its current key.
"""

from __future__ import annotations

import heapq
import itertools
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
        self._tiers = (*tiers, DISK)
        self._keys: dict[str, dict[Seq, tuple]] = {t: {} for t in self._tiers}  # live members -> key
        self._heaps: dict[str, list[tuple[tuple, int, Seq]]] = {t: [] for t in self._tiers}
        self._built = set(tiers)  # the disk's order is built on first use (see the module docstring)
        self._n = itertools.count()

    def track(self, seq: Seq) -> None:
        for t in self._tiers:
            if t not in self._built:
                continue
            keys = self._keys[t]
            if not has(seq, t):
                keys.pop(seq, None)
                continue
            key = self._key(meta(seq, t)) if self._key is not None else ()
            if keys.get(seq) == key:
                continue
            keys[seq] = key
            if self._key is not None:
                heapq.heappush(self._heaps[t], (key, next(self._n), seq))

    def forget(self, seq: Seq) -> None:
        for t in self._tiers:
            self._keys[t].pop(seq, None)

    def victims(self, tier: str, ok: Callable[[Seq], bool], cover: int | None,
                index: Callable[[], Iterable[Seq]]) -> list[Seq]:
        if tier not in self._built:
            self._build(tier, index())
        keys = self._keys[tier]
        if self._key is None:
            live = [s for s in keys if has(s, tier)]
            for s in [s for s in keys if not has(s, tier)]:
                del keys[s]
            cands = {s.seq_id: s for s in live if ok(s)}
            metas = [meta(s, tier) for s in cands.values()]
            if cover is None:
                return [cands[sid] for sid in policy.demotion_order(self.policy, metas)]
            return [cands[sid] for sid in policy.plan_demotion(self.policy, metas, cover, cover, 0)]
        heap = self._heaps[tier]
        out: list[Seq] = []
        back: list[tuple[tuple, int, Seq]] = []
        seen: set[int] = set()
        got = 0
        while heap and (cover is None or got < cover):
            entry = heapq.heappop(heap)
            key, _, seq = entry
            if keys.get(seq) != key or id(seq) in seen:
                continue  # re-keyed since (a touch), gone from the tier, or a twin entry
            seen.add(id(seq))
            if not has(seq, tier):
                del keys[seq]
                continue
            back.append(entry)
            if ok(seq):
                out.append(seq)
                got += size_in(seq, tier)
        for entry in back:  # victims stay until they are actually moved
            heapq.heappush(heap, entry)
        return out

    def _build(self, tier: str, index: Iterable[Seq]) -> None:
        keys = self._keys[tier]
        for s in index:
            if has(s, tier):
                keys[s] = self._key(meta(s, tier)) if self._key is not None else ()
        if self._key is not None:
            heap = [(k, next(self._n), s) for s, k in keys.items()]
            heapq.heapify(heap)
            self._heaps[tier] = heap
        self._built.add(tier)

    def compact(self) -> None:
        for t, heap in self._heaps.items():
            keys = self._keys[t]
            if len(heap) > 2 * len(keys) + 4096:
                fresh = [(k, next(self._n), s) for s, k in keys.items()]
                heapq.heapify(fresh)
                self._heaps[t] = fresh

    def check(self, seqs: Iterable[Seq]) -> None:
        for s in seqs:
            for t in self._tiers:
                if t not in self._built:
                    continue  # not built yet: built from the index when first wanted
                if has(s, t):
                    want = self._key(meta(s, t)) if self._key is not None else ()
                    assert self._keys[t].get(s) == want, f"{s.seq_id}: its {t} copy is not in the eviction order"
