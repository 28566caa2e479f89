"""Pure placement and eviction policy: decisions are functions of sequence metadata.

Nothing here touches memory, disk or locks; the engine gathers ``SeqMeta`` snapshots,
asks for a plan, and applies it. That keeps every decision unit-testable without I/O,
and one contract suite (tests/tiers/test_policy.py) runs over every registered policy.

Primitives:
- ``SeqMeta``: what a policy may look at.
- ``POLICIES``: name -> order function (candidates -> demotion order, first = coldest);
  ``register(name, order)`` adds one. Built in:
    - ``lru``: least recently used first;
    - ``lfu``: fewest accesses first, LRU among equals;
    - ``s3fifo``: S3-FIFO-style: sequences never touched since they were parked (the
      "small queue" of one-hit wonders) leave first in FIFO order, then the rest in FIFO order;
    - ``arc``: ARC-style: a recency list (touched at most once) and a frequency list,
      each LRU; the split adapts to where "ghost hits" (promotions back up from a
      lower tier) came from, so the list that was evicted too eagerly keeps more room.
  Every policy orders by ``priority`` first: a higher priority is demoted last.
- ``over_high(used, capacity, high)``; ``background_target(capacity, low)``.
- ``demotion_order(policy, candidates) -> list[str]``: all of them, coldest first.
- ``plan_demotion(policy, candidates, used, capacity, target) -> list[str]``: victims in
  order whose removal brings ``used`` to ``target`` or below (all of them if not enough).
- ``order_key(policy)``: for ``lru``, ``lfu`` and ``s3fifo``, the key whose ascending
  order is the demotion order (priority first), so a caller may keep the order
  incrementally; None for a policy that must see every candidate (``arc``, registered ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable



@dataclass(frozen=True, slots=True)
class SeqMeta:
    seq_id: str
    nbytes: int  # capacity the sequence holds in the tier being relieved
    last_access: float
    priority: int = 0
    access_count: int = 0
    created_at: float = 0.0
    promotions: int = 0  # times brought back up from a lower tier (ARC's ghost hits)


Order = Callable[[list[SeqMeta]], list[SeqMeta]]


def _by_priority(order: Order) -> Order:
    def wrapped(cands: list[SeqMeta]) -> list[SeqMeta]:
        out: list[SeqMeta] = []
        for prio in sorted({c.priority for c in cands}):
            out.extend(order([c for c in cands if c.priority == prio]))
        return out

    return wrapped


def _lru_key(m: SeqMeta) -> tuple:
    return (m.last_access, m.seq_id)


def _lfu_key(m: SeqMeta) -> tuple:
    return (m.access_count, m.last_access, m.seq_id)


def _s3fifo_key(m: SeqMeta) -> tuple:
    return (m.access_count > 0, m.created_at, m.seq_id)


def _lru(c: list[SeqMeta]) -> list[SeqMeta]:
    return sorted(c, key=_lru_key)


def _lfu(c: list[SeqMeta]) -> list[SeqMeta]:
    return sorted(c, key=_lfu_key)


def _s3fifo(c: list[SeqMeta]) -> list[SeqMeta]:
    return sorted(c, key=_s3fifo_key)


def _arc(c: list[SeqMeta]) -> list[SeqMeta]:
    t1 = _lru([m for m in c if m.access_count <= 1])
    t2 = _lru([m for m in c if m.access_count > 1])
    g1 = sum(m.promotions for m in t1)
    g2 = sum(m.promotions for m in t2)
    # Target share of the recency list: grows with ghost hits on recency entries.
    p = min(0.9, max(0.1, (g1 + 1) / (g1 + g2 + 2)))
    b1, b2 = sum(m.nbytes for m in t1), sum(m.nbytes for m in t2)
    out: list[SeqMeta] = []
    i = j = 0
    while i < len(t1) or j < len(t2):
        total = b1 + b2
        take_t1 = j >= len(t2) or (i < len(t1) and total > 0 and b1 / total > p)
        if take_t1:
            out.append(t1[i])
            b1 -= t1[i].nbytes
            i += 1
        else:
            out.append(t2[j])
            b2 -= t2[j].nbytes
            j += 1
    return out


POLICIES: dict[str, Order] = {
    "lru": _by_priority(_lru),
    "lfu": _by_priority(_lfu),
    "s3fifo": _by_priority(_s3fifo),
    "arc": _by_priority(_arc),
}


# The policies whose order is a sort by one key of each candidate alone (after priority):
# the engine keeps such an order incrementally (a heap per tier) instead of sorting every
# candidate on every eviction. ``arc`` depends on the whole population, so it has none.
KEYS: dict[str, Callable[[SeqMeta], tuple]] = {"lru": _lru_key, "lfu": _lfu_key, "s3fifo": _s3fifo_key}


def register(name: str, order: Order) -> None:
    POLICIES[name] = _by_priority(order)
    KEYS.pop(name, None)


def order_key(policy: str) -> Callable[[SeqMeta], tuple] | None:
    """The full sort key ``(priority, ...)`` of a key-ordered policy, or None (order
    the whole population with ``demotion_order``)."""
    _get(policy)
    key = KEYS.get(policy)
    if key is None:
        return None
    return lambda m: (m.priority, *key(m))


def over_high(used: int, capacity: int, high: float) -> bool:
    return capacity > 0 and used > high * capacity


def background_target(capacity: int, low: float) -> int:
    return int(low * capacity)


def demotion_order(policy: str, candidates: Iterable[SeqMeta]) -> list[str]:
    """Every candidate, coldest first."""
    return [m.seq_id for m in _get(policy)(list(candidates))]


def _get(policy: str) -> Order:
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown eviction policy {policy!r}; known: {', '.join(sorted(POLICIES))}") from None


def plan_demotion(
    policy: str,
    candidates: Iterable[SeqMeta],
    used: int,
    capacity: int,
    target: int,
) -> list[str]:
    order = _get(policy)
    if used <= target:
        return []
    victims: list[str] = []
    for m in order(list(candidates)):
        if used <= target:
            break
        victims.append(m.seq_id)
        used -= m.nbytes
    return victims
