"""Plain result types returned to users, shared by the engine and the client.

Primitives: ``SeqInfo``, ``TierStat``, ``Stat``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .layout import TensorMeta


@dataclass(frozen=True, slots=True)
class SeqInfo:
    seq_id: str
    nbytes: int
    tier: str  # fastest tier holding all of it: "device" | "host" | "disk"
    num_tensors: int
    tensors: tuple[TensorMeta, ...] = ()
    priority: int = 0
    created_at: float = 0.0
    last_access: float = 0.0
    num_blocks: int = 0
    attrs: dict[str, str] = field(default_factory=dict)
    refs: tuple[str, ...] = ()
    shared: bool = False
    refcount: int = 0
    pinned: bool = False
    expires_at: float = 0.0  # unix seconds; 0 = no TTL


@dataclass(frozen=True, slots=True)
class TierStat:
    capacity_bytes: int
    used_bytes: int
    blocks: int
    sequences: int
    evictions: int = 0  # copies moved out to make room, since the daemon started
    state: str = "ok"  # "ok" | "demoting" (past its high watermark) | "full"


@dataclass(frozen=True, slots=True)
class Stat:
    tiers: dict[str, TierStat] = field(default_factory=dict)
    sequences: int = 0
    leases: int = 0
