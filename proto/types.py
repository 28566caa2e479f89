"""Plain result types returned to users, shared by the engine and the client.

Primitives: ``SeqInfo``, ``TierStat``, ``RemoteStat``, ``Stat``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .layout import TensorMeta


@dataclass(frozen=True, slots=True)
class SeqInfo:
    seq_id: str
    nbytes: int
    # Fastest tier holding all of it: "device" | "host" | "private" (the daemon-private
    # memory of tenants that are not trusted_local) | "disk" | "remote".
    tier: str
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
    # End-to-end verification: the xxh3-64 of each tensor's bytes as parked, one per
    # tensor (0: that tensor was parked without); empty when none was.
    xxh3: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TierStat:
    capacity_bytes: int
    used_bytes: int
    blocks: int
    sequences: int
    evictions: int = 0  # copies moved out to make room, since the daemon started
    state: str = "ok"  # "ok" | "demoting" (past its high watermark) | "full"


@dataclass(frozen=True, slots=True)
class RemoteStat:
    state: str  # circuit breaker: "closed" (healthy), "open" (degraded: failing fast), "half_open"
    errors: int = 0
    refused: int = 0
    data_loss: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    outages: int = 0
    pending_writes: int = 0
    sequences: int = 0

    @property
    def degraded(self) -> bool:
        return self.state != "closed"


@dataclass(frozen=True, slots=True)
class TenantStat:
    """One tenant's usage. ``used``/``quota``: tier -> bytes; "disk" counts every byte the
    tenant has parked (each may land on disk); "host" counts its copies in the private tier
    too (host memory); a tier missing from ``quota`` is unlimited."""

    name: str
    sequences: int = 0
    used: dict[str, int] = field(default_factory=dict)
    quota: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Stat:
    tiers: dict[str, TierStat] = field(default_factory=dict)
    sequences: int = 0
    leases: int = 0
    remote: RemoteStat | None = None  # None: no remote tier configured
    damaged: int = 0  # held sequences whose disk record failed verification (reads are DATA_LOSS)
    tenants: tuple[TenantStat, ...] = ()  # the caller's own row (all rows for /metrics); () without tenants
    pinned: dict[str, int] = field(default_factory=dict)  # page-locked bytes: "registered", "staging"
