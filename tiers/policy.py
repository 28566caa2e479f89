"""Pure placement and eviction policy: decisions are functions of sequence metadata.

Nothing here touches memory, disk or locks; the engine gathers ``SeqMeta`` snapshots,
asks for a plan, and applies it. That keeps every decision unit-testable without I/O.

Primitives:
- ``SeqMeta``: what a policy may look at.
- ``POLICIES``: name -> eviction key (lowest key is evicted first); ``register`` adds one.
- ``over_high(used, capacity, high) -> bool``: when background demotion should start.
- ``plan_demotion(policy, candidates, used, capacity, target) -> list[str]``: victims, in
  order, whose removal brings ``used`` to ``target`` or below; if even all candidates
  are not enough, all of them (the caller checks).
- ``background_target(capacity, low)`` and ``room_target(capacity, need)``.
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


EvictionKey = Callable[[SeqMeta], tuple]


def _lru(m: SeqMeta) -> tuple:
    # Priority first: a higher-priority sequence is only demoted once every
    # lower-priority one has gone, whatever their recency.
    return (m.priority, m.last_access)


POLICIES: dict[str, EvictionKey] = {"lru": _lru}


def register(name: str, key: EvictionKey) -> None:
    POLICIES[name] = key


def over_high(used: int, capacity: int, high: float) -> bool:
    return capacity > 0 and used > high * capacity


def background_target(capacity: int, low: float) -> int:
    return int(low * capacity)


def room_target(capacity: int, need: int) -> int:
    return capacity - need


def plan_demotion(
    policy: str,
    candidates: Iterable[SeqMeta],
    used: int,
    capacity: int,
    target: int,
) -> list[str]:
    try:
        key = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown eviction policy {policy!r}; known: {', '.join(sorted(POLICIES))}") from None
    if used <= target:
        return []
    victims: list[str] = []
    for m in sorted(candidates, key=key):
        if used <= target:
            break
        victims.append(m.seq_id)
        used -= m.nbytes
    return victims
