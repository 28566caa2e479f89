"""The engine's records: what a park asks for, what a parked sequence is, leases, reads.

Primitives:
- ``ParkSpec``: a park request (tensors, priority, pin, TTL, refs, new blocks, attrs).
- ``Seq``: a parked sequence: its manifest, ready memory copies per tier, disk presence,
  readers, and the flags the engine's invariants rest on.
- ``Lease``: a write reservation or a read lease (possibly over several sequences).
- ``Part`` / ``ReadHandle``: what a restore reads, in payload order.
- ``MEM_TIERS``: memory tiers, fastest first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvpark.proto.layout import TensorMeta
from kvpark.proto.types import SeqInfo
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import Manifest

MEM_TIERS = ("device", "host")


@dataclass(frozen=True)
class ParkSpec:
    seq_id: str
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    priority: int = 0
    overwrite: bool = False
    pinned: bool = False
    ttl_s: float = 0.0
    refs: tuple[str, ...] = ()
    shared: bool = False
    attrs: dict[str, str] = field(default_factory=dict)
    blocks: tuple["ParkSpec", ...] = ()  # shared blocks created by this park; their bytes come first

    @property
    def is_batch(self) -> bool:
        """A park with no sequence of its own: it only creates the blocks it carries."""
        return self.seq_id == "" and bool(self.blocks)

    @property
    def total(self) -> int:
        """Payload bytes the park carries: new blocks, then the sequence's own."""
        return sum(b.nbytes for b in self.blocks) + self.nbytes


@dataclass(eq=False)
class Seq:
    manifest: Manifest
    res: dict[str, Allocation] = field(default_factory=dict)  # ready memory copies
    on_disk: bool = False
    readers: dict[str, int] = field(default_factory=dict)
    moving: int = 0  # copies in flight from this sequence's memory
    dropped: bool = False
    access_count: int = 0
    promotions: int = 0
    move_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def seq_id(self) -> str:
        return self.manifest.seq_id

    @property
    def tier(self) -> str:
        for t in MEM_TIERS:
            if t in self.res:
                return t
        return "disk"

    @property
    def pinned(self) -> bool:
        return bool(self.manifest.extra.get("pinned", False))

    @property
    def expires_at(self) -> float | None:
        v = self.manifest.extra.get("expires_at")
        return float(v) if v else None

    @property
    def refs(self) -> tuple[str, ...]:
        return tuple(self.manifest.extra.get("refs", ()))

    @property
    def shared(self) -> bool:
        return bool(self.manifest.extra.get("shared", False))

    @property
    def attrs(self) -> dict[str, str]:
        return dict(self.manifest.extra.get("attrs", {}))


@dataclass(eq=False)
class Lease:
    lease_id: str
    kind: str  # "write" | "read"
    tier: str  # memory tier of a write lease
    expires_at: float | None  # None: held by a live stream, released by it
    parts: list[tuple[Seq, str]] = field(default_factory=list)  # read leases: (sequence, tier) pairs
    spec: ParkSpec | None = None  # write leases
    alloc: Allocation | None = None  # write leases: the sequence's own bytes
    block_allocs: list[Allocation] = field(default_factory=list)  # write leases: spec.blocks, in order
    received: int = 0  # inline bytes written so far
    ended: bool = False  # write leases: released, committed or expired; no more writes
    lock: threading.Lock = field(default_factory=threading.Lock)  # write leases: held while copying in

    def write_allocs(self) -> list[Allocation]:
        """Allocations in payload order (new shared blocks, then the sequence)."""
        return [*self.block_allocs, *([self.alloc] if self.alloc is not None else [])]


@dataclass
class Part:
    """One sequence's bytes inside a restore: a leased memory copy, or disk records."""

    manifest: Manifest
    alloc: Allocation | None
    tier: str  # "device" | "host" | "disk"
    seq: "Seq | None" = None


@dataclass
class ReadHandle:
    """What a restore reads: the parts in payload order, under one read lease."""

    info: SeqInfo
    parts: list[Part]
    lease: Lease | None  # holds every memory part

    def segments(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for p in self.parts:
            assert p.alloc is not None
            out.extend(p.alloc.segments())
        return out
