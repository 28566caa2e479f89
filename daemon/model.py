"""The engine's records: what a park asks for, what a parked sequence is, leases, results.

Primitives:
- ``Tier`` / ``MemTierName`` / ``LeaseKind``: the names the engine speaks, typed;
  ``MEM_TIERS``: memory tiers, fastest first (``private``, host memory no client maps,
  after ``host``: see ``placement.py``).
  ``NS_SEP``: what joins a tenant's name to the ids it uses (the catalog indexes by it).
- ``Generations``: the one source of generations: ``next()`` (REQUIRES: the index lock)
  is ``counter << INSTANCE_BITS | instance``; ``seen(gen)`` keeps the counter above
  generations loaded from disk or adopted from the remote tier.
- ``ParkSpec``: a park request (tensors, priority, pin, TTL, refs, new blocks, attrs,
  per-tensor digests for end-to-end verification); ``ParkSpec.validate()`` checks
  everything that needs no index; ``ParkSpec.manifest()`` is the disk record it commits
  as (the digests under the reserved attrs key of ``kvpark.proto.digests``);
  ``ParkSpec.owner``: an id in the park's namespace (a batch park has no id of its own).
- ``Seq``: a parked sequence in memory: its typed disk record (``Manifest``), ready
  memory copies per tier (``res``), disk presence, readers, and the flags the
  invariants rest on. Slotted, since the index holds one per parked block: the read
  counts (``readers``, changed only through ``add_reader`` / ``drop_reader``) and the
  ``move_lock`` are made on first use. ``Seq.attrs`` is the user's attrs (no digests);
  ``Seq.xxh3`` the digests; ``Seq.cpu_copy`` the memory copy a disk or remote write
  reads. ``verified(comps)``: a payload's digests, part by part.
- ``TierMap``: a mapping from memory tier name to value in three slots (``Seq.res``),
  fastest tier first; ``ReadCounts``: the same with ``disk`` too (read leases per tier).
- ``Lease``: a write reservation or a read lease (possibly over several sequences);
  live engine state, never handed to the servicer.
- ``Window``: a sequence larger than its memory tier, moving through one window of
  slots at a time (``window.py``); hung on the write or read lease that holds the slots.
- ``Part`` / ``ReadHandle``: what a restore reads, in payload order.
- Frozen results for the servicer: ``Reservation`` (a write lease's id and slot
  segments), ``Grant`` (a read lease's id, the info and segments), ``Capabilities``
  (what ``Hello`` reports).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, TypeVar

from kvpark.proto import digests
from kvpark.proto.errors import InvalidArgument
from kvpark.proto.layout import TensorMeta, validate_seq_id, validate_tensors
from kvpark.proto.types import SeqInfo
from kvpark.tiers.arena import Allocation
from kvpark.tiers import interning
from kvpark.tiers.disk import Manifest, ReadTxn

Tier = Literal["device", "host", "private", "disk", "remote"]
MemTierName = Literal["device", "host", "private"]
LeaseKind = Literal["write", "read"]
MEM_TIERS: tuple[MemTierName, ...] = ("device", "host", "private")
# What joins a tenant's name to every id it uses ("alice" + NS_SEP + "chat-1"): SYMBOL FOR
# UNIT SEPARATOR, printable (ids may not hold control characters) and rare in ids.
NS_SEP = "\u241f"
MAX_PARTS = 1 << 16  # ids in one restore/lookup call, new blocks in one park
V = TypeVar("V")
# The low bits of every generation: a random number drawn at each daemon start. Daemons
# that share a remote namespace count generations each on their own; the instance makes
# two of them never write the same id at the same generation (Redis chunk keys carry the
# generation, and a delete "by generation" must name one version). 24 bits leave 40 for
# the counter (a trillion commits) in the u64 the disk and Redis keys hold.
INSTANCE_BITS = 24


class Generations:
    """Generations of one daemon run: ordered by a counter, unique by an instance id.

    Manifests written before generations carried an instance hold plain counters below
    ``1 << INSTANCE_BITS``: every generation taken now is above them, as it is above any
    generation seen (``seen``), so "a newer generation wins" keeps holding across the
    upgrade and across restarts.
    """

    __slots__ = ("instance", "_counter")

    def __init__(self, instance: int | None = None) -> None:
        self.instance = random.getrandbits(INSTANCE_BITS) if instance is None else instance
        self._counter = 0

    def seen(self, gen: int) -> None:
        self._counter = max(self._counter, gen >> INSTANCE_BITS)

    @property
    def counter(self) -> int:
        """The highest counter taken or seen (``gen >> INSTANCE_BITS``)."""
        return self._counter

    def next(self) -> int:
        self._counter += 1
        return self._counter << INSTANCE_BITS | self.instance


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
    xxh3: tuple[int, ...] = ()  # end-to-end verification: one digest per tensor, or none

    @property
    def is_batch(self) -> bool:
        """A park with no sequence of its own: it only creates the blocks it carries."""
        return self.seq_id == "" and bool(self.blocks)

    @property
    def owner(self) -> str:
        """An id that names the park's namespace: its own, or (a batch) its first block's."""
        return self.seq_id or (self.blocks[0].seq_id if self.blocks else "")

    @property
    def total(self) -> int:
        """Payload bytes the park carries: new blocks, then the sequence's own."""
        return sum(b.nbytes for b in self.blocks) + self.nbytes

    def manifest(self, gen: int, block_size: int) -> Manifest:
        """The disk record this park commits as generation ``gen``.

        Tensor metadata, fingerprint and attrs are interned: the blocks of one model
        share them (``kvpark.tiers.interning``).
        """
        now = time.time()
        tensors, fp = interning.layout(self.tensors)
        attrs = interning.attrs(self.attrs)
        if self.xxh3:
            # Digests ride in the manifest, so every tier keeps them with the data. Each
            # set is unique: not interned.
            attrs = {**attrs, digests.HASH_ATTR: digests.encode(self.xxh3)}
        return Manifest(
            seq_id=self.seq_id, gen=gen, tensors=tensors, nbytes=interning.number(self.nbytes),
            block_size=block_size, fingerprint=fp, priority=self.priority, created_at=now, last_access=now,
            pinned=self.pinned, expires_at=now + self.ttl_s if self.ttl_s > 0 else None, refs=tuple(self.refs),
            shared=self.shared, attrs=attrs,
        )

    def validate(self) -> None:
        """Raise ``InvalidArgument`` unless the request is well formed on its own."""
        if self.is_batch:
            if self.tensors or self.refs or self.nbytes:
                raise InvalidArgument("a batch park (empty seq_id) carries only blocks: no tensors or refs")
        else:
            validate_seq_id(self.seq_id)
        validate_tensors(self.tensors, self.nbytes)
        if self.ttl_s < 0:
            raise InvalidArgument(f"ttl_s must be >= 0, got {self.ttl_s}")
        for r in self.refs:
            validate_seq_id(r)
        if self.shared and self.refs:
            raise InvalidArgument("a shared block cannot itself reference other blocks")
        if len(self.attrs) > 64 or any(len(k) + len(v) > 4096 for k, v in self.attrs.items()):
            raise InvalidArgument("attrs: at most 64 entries of at most 4096 bytes each")
        for s in (self, *self.blocks):
            if digests.HASH_ATTR in s.attrs:
                raise InvalidArgument(f"attrs key {digests.HASH_ATTR!r} is reserved (verify=True sets the digests)")
            if s.xxh3 and len(s.xxh3) != len(s.tensors):
                raise InvalidArgument(f"{len(s.xxh3)} digests for {len(s.tensors)} tensors of {s.seq_id!r}")
        if len(self.blocks) > MAX_PARTS:
            raise InvalidArgument(f"{len(self.blocks)} new blocks; at most {MAX_PARTS} per park")
        refs = set(self.refs)
        for b in self.blocks:
            validate_seq_id(b.seq_id)
            validate_tensors(b.tensors, b.nbytes)
            if b.shared and b.seq_id not in refs:
                raise InvalidArgument(f"new shared block {b.seq_id!r} is not among the sequence's refs")
            if not b.shared and not self.is_batch:
                raise InvalidArgument(f"new block {b.seq_id!r}: only a batch park creates plain sequences")
        if len({b.seq_id for b in self.blocks}) != len(self.blocks):
            raise InvalidArgument("the same new block is listed twice")
        if self.seq_id and (self.seq_id in refs or any(b.seq_id == self.seq_id for b in self.blocks)):
            raise InvalidArgument(f"sequence {self.seq_id!r} cannot reference itself as a block")


class TierMap(MutableMapping[str, V]):
    """A dict keyed by memory tier name (``device``, ``host``, ``private``) in three slots.

    ``Seq.res`` is one of these, and the read counts a ``ReadCounts``: a plain dict costs
    64 bytes empty and 184 with one entry, and a million parked blocks each carry one.
    Iteration goes fastest tier first. Any other key is a ``KeyError``.
    """

    __slots__ = ("device", "host", "private")
    _keys: frozenset[str] = frozenset(MEM_TIERS)
    _order: tuple[str, ...] = MEM_TIERS

    def __init__(self, items: Mapping[str, V] | None = None) -> None:
        # Plain stores, not a loop of setattr: a restart makes one map per indexed block.
        self.device = self.host = self.private = None
        if items:
            for k, v in items.items():
                self[k] = v

    def __getitem__(self, key: str) -> V:
        v = getattr(self, key) if key in self._keys else None
        if v is None:
            raise KeyError(key)
        return v

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        v = getattr(self, key) if key in self._keys else None
        return default if v is None else v

    def __contains__(self, key: object) -> bool:
        return key in self._keys and getattr(self, key) is not None  # type: ignore[arg-type]

    def __setitem__(self, key: str, value: V) -> None:
        if key not in self._keys:
            raise KeyError(f"not a tier this map holds: {key!r}")
        assert value is not None
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        setattr(self, key, None)

    def __iter__(self) -> Iterator[str]:
        return iter([k for k in self._order if getattr(self, k) is not None])

    def __len__(self) -> int:
        return sum(getattr(self, k) is not None for k in self._order)

    def __bool__(self) -> bool:
        return any(getattr(self, k) is not None for k in self._order)

    def __repr__(self) -> str:
        return repr(dict(self.items()))


class ReadCounts(TierMap[int]):
    """Read leases per tier: the memory tiers, and ``disk`` (a windowed restore reads
    its sequence's disk records under a lease: ``window.py``)."""

    __slots__ = ("disk",)
    _keys = frozenset((*MEM_TIERS, "disk"))
    _order = (*MEM_TIERS, "disk")

    def __init__(self, items: Mapping[str, int] | None = None) -> None:
        self.disk = None
        super().__init__(items)


class _Empty(ReadCounts):
    """The shared, unchangeable read counts of a sequence nobody reads."""

    __slots__ = ()

    def __setitem__(self, key: str, value: int) -> None:
        raise TypeError("Seq.readers is read-only; use Seq.add_reader / Seq.drop_reader")


_NO_READERS: ReadCounts = _Empty()
_NEW_LOCK = threading.Lock()  # makes a Seq's move lock exactly once (see Seq.move_lock)


# ``Seq._state``: three flags and the count of copies in flight, in one int that stays
# below 256 (Python's shared small ints) for up to 31 copies in flight: three bools and a
# count in separate slots cost 24 bytes more per parked block.
_ON_DISK, _ON_REMOTE, _DROPPED, _MOVING = 1, 2, 4, 8


def _flag(bit: int, doc: str) -> property:
    def get(self: "Seq") -> bool:
        return bool(self._state & bit)

    def put(self: "Seq", value: bool) -> None:
        self._state = self._state | bit if value else self._state & ~bit

    return property(get, put, doc=doc)


class Seq:
    """A parked sequence: its disk record, its memory copies and its state (see the
    module docstring). Identity is the sequence version: compared and hashed by object."""

    __slots__ = ("manifest", "res", "_state", "access_count", "promotions", "dirty_since", "_readers",
                 "_move_lock")

    def __init__(self, manifest: Manifest, res: Mapping[str, Allocation] | None = None, on_disk: bool = False,
                 on_remote: bool = False, dropped: bool = False) -> None:
        self.manifest = manifest
        self.res: TierMap[Allocation] = res if isinstance(res, TierMap) else TierMap(res)  # ready memory copies
        self._state = (_ON_DISK if on_disk else 0) | (_ON_REMOTE if on_remote else 0) | (_DROPPED if dropped else 0)
        self.access_count = 0
        self.promotions = 0
        # write_back's dirty set (``dirty.py``): when this became memory-only (monotonic
        # seconds); 0.0 while it is not in the set.
        self.dirty_since = 0.0
        self._readers: ReadCounts | None = None  # read leases per tier; made on the first (see ``readers``)
        # Made on first use: most of a million parked blocks never move, and a lock is 56
        # bytes and a third of the time of rebuilding one index entry at restart.
        self._move_lock: threading.Lock | None = None

    on_disk = _flag(_ON_DISK, "A copy on the disk tier.")
    on_remote = _flag(_ON_REMOTE, "A copy in the remote tier (Redis) is known to this daemon.")
    dropped = _flag(_DROPPED, "Retired from the index (dropped, overwritten, expired).")

    @property
    def moving(self) -> int:
        """Copies in flight from this sequence's memory (``Catalog.copy_begin``/``copy_end``)."""
        return self._state >> 3

    @moving.setter
    def moving(self, n: int) -> None:
        assert n >= 0, f"{self.seq_id}: moving would be {n}"
        self._state = (self._state & (_MOVING - 1)) | n << 3

    def __repr__(self) -> str:
        return (f"Seq({self.seq_id!r}, gen={self.gen}, res={self.res!r}, on_disk={self.on_disk}, "
                f"on_remote={self.on_remote}, dropped={self.dropped}, moving={self.moving})")

    @property
    def readers(self) -> Mapping[str, int]:
        """Read leases on each memory copy (read-only: change it with ``add_reader`` /
        ``drop_reader``). Most parked blocks are never being read: they share one empty map."""
        return self._readers if self._readers is not None else _NO_READERS

    def add_reader(self, tier: str) -> None:
        r = self._readers
        if r is None:
            r = self._readers = ReadCounts()
        r[tier] = r.get(tier, 0) + 1

    def drop_reader(self, tier: str) -> None:
        r = self._readers
        n = r.get(tier, 0) if r is not None else 0
        assert r is not None and n > 0, f"{self.seq_id}: no reader on {tier} to drop"
        if n > 1:
            r[tier] = n - 1
        else:
            del r[tier]
            if not r:
                self._readers = None

    @property
    def move_lock(self) -> threading.Lock:
        """Serialises the moves of this sequence (``mover.py``)."""
        lock = self._move_lock
        if lock is None:
            with _NEW_LOCK:
                lock = self._move_lock
                if lock is None:
                    lock = self._move_lock = threading.Lock()
        return lock

    @property
    def seq_id(self) -> str:
        return self.manifest.seq_id

    @property
    def gen(self) -> int:
        return self.manifest.gen

    @property
    def tier(self) -> Tier:
        for t in MEM_TIERS:
            if t in self.res:
                return t
        return "remote" if self.on_remote and not self.on_disk else "disk"

    @property
    def cpu_copy(self) -> str | None:
        """The memory tier to read this sequence's bytes from on the CPU (a disk or remote
        write): a host-memory copy before a device one; None without a memory copy."""
        return next((t for t in ("host", "private", "device") if t in self.res), None)

    @property
    def pinned(self) -> bool:
        return self.manifest.pinned

    @property
    def expires_at(self) -> float | None:
        return self.manifest.expires_at

    @property
    def refs(self) -> tuple[str, ...]:
        return self.manifest.refs

    @property
    def shared(self) -> bool:
        return self.manifest.shared

    @property
    def attrs(self) -> dict[str, str]:
        """The user's attrs (the reserved digest key is not theirs)."""
        return digests.split(self.manifest.attrs)[0]

    @property
    def xxh3(self) -> tuple[int, ...]:
        """One digest per tensor when parked with verify, else ``()``."""
        found = digests.decode(self.manifest.attrs.get(digests.HASH_ATTR, ""))
        return found if len(found) == len(self.manifest.tensors) else ()


def verified(comps: list["Seq"]) -> tuple[int, ...]:
    """The digests of a payload made of ``comps``, per tensor (0 where a part was parked
    without); ``()`` when no part has any."""
    parts = [c.xxh3 for c in comps]
    if not any(parts):
        return ()
    return tuple(d for c, p in zip(comps, parts) for d in (p or (0,) * len(c.manifest.tensors)))


@dataclass(eq=False)
class Window:
    """A windowed park or restore: payload window ``index`` sits in ``alloc`` now.

    Window ``k`` is payload bytes ``[k * size, min((k + 1) * size, nbytes))``; ``size`` is
    whole slots, so a window is whole disk blocks. With ``buffers`` = 2 the allocation
    holds two windows and window ``k`` uses half ``k % 2``: the daemon writes one to disk
    (or reads the next from it, ``pending``) while the client fills (or copies) the other.
    REQUIRES: the lease's ``lock`` to move.
    """

    manifest: Manifest
    tier: str
    alloc: Allocation | None  # the window's slots (a write lease's are also its ``alloc``)
    size: int
    buffers: int = 1
    reading: bool = False
    index: int = 0
    seq: "Seq | None" = None  # a restore: the sequence it reads
    txn: ReadTxn | None = None  # a restore: one snapshot for every window (a drop meanwhile changes nothing)
    pending: "Future[int] | None" = None  # the disk write (park) or read (restore) in flight: its window
    # Run once the lease ends unpublished, outside the index lock and before its slots are
    # freed: a park deletes what it staged; a restore ends its read transaction.
    on_end: Callable[[], None] | None = None

    @property
    def count(self) -> int:
        return max(1, -(-self.manifest.nbytes // self.size))

    def span(self, index: int) -> tuple[int, int]:
        """(payload offset, length) of window ``index``."""
        start = index * self.size
        return start, min(self.size, self.manifest.nbytes - start)

    def extents(self, index: int) -> list[tuple[int, int]]:
        """Window ``index``'s blocks in the pool: (offset, length), its last one cut short."""
        assert self.alloc is not None
        per = len(self.alloc.extents) // self.buffers
        half = index % self.buffers
        lengths = self.manifest.block_lengths
        first = self.span(index)[0] // self.manifest.block_size
        mine = self.alloc.extents[half * per:(half + 1) * per]
        return [(off, n) for (off, _), n in zip(mine, lengths[first:first + per])]

    def segments(self, index: int | None = None) -> list[tuple[int, int]]:
        """Where window ``index`` (default: the current one) lies, contiguous runs merged."""
        out: list[tuple[int, int]] = []
        for off, n in self.extents(self.index if index is None else index):
            if out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((off, n))
        return out

    def settle(self) -> None:
        """Wait for the disk I/O in flight; its error is the caller's to ignore."""
        job, self.pending = self.pending, None
        if job is not None:
            job.exception()


@dataclass(eq=False)
class Lease:
    lease_id: str
    kind: LeaseKind
    tier: str  # memory tier of a write lease
    expires_at: float | None  # None: held by a live stream, released by it
    parts: list[tuple[Seq, str]] = field(default_factory=list)  # read leases: (sequence, tier) pairs
    spec: ParkSpec | None = None  # write leases
    alloc: Allocation | None = None  # write leases: the sequence's own bytes
    block_allocs: list[Allocation] = field(default_factory=list)  # write leases: spec.blocks, in order
    received: int = 0  # inline bytes written so far
    fill_here: bool = False  # write leases the data channel fills: a commit needs every byte received
    ended: bool = False  # released, committed or expired: no more copies in or out
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while a chunk is copied in or out
    window: Window | None = None  # a windowed park or restore

    def write_allocs(self) -> list[Allocation]:
        """Allocations in payload order (new shared blocks, then the sequence)."""
        return [*self.block_allocs, *([self.alloc] if self.alloc is not None else [])]


@dataclass
class Part:
    """One sequence's bytes inside a restore: a leased memory copy, or disk records."""

    manifest: Manifest
    alloc: Allocation | None
    tier: str  # "device" | "host" | "private" | "disk"
    seq: "Seq | None" = None


@dataclass
class ReadHandle:
    """What a restore reads: the parts in payload order, under one read lease."""

    info: SeqInfo
    parts: list[Part]
    lease: Lease | None  # holds every memory part
    # A disk grant: every part is on disk only and the caller reads the records itself
    # (``Engine.acquire(disk=True)``); no lease, nothing promoted first.
    direct: bool = False

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id if self.lease is not None else ""

    @property
    def window(self) -> Window | None:
        return self.lease.window if self.lease is not None else None

    def segments(self) -> list[tuple[int, int]]:
        if self.window is not None:
            return self.window.segments()
        out: list[tuple[int, int]] = []
        for p in self.parts:
            assert p.alloc is not None
            out.extend(p.alloc.segments())
        return out


@dataclass(frozen=True)
class Reservation:
    """A write lease as the servicer sees it: where the client writes, and for how long."""

    lease_id: str
    tier: MemTierName
    segments: tuple[tuple[int, int], ...]  # (offset, length) in payload order
    expires_in_s: float
    window_size: int = 0  # windowed: the segments hold window 0 of this many bytes each


@dataclass(frozen=True)
class Grant:
    """A read lease as the servicer sees it: what is leased and where it lies."""

    lease_id: str  # "" when nothing is memory-resident (nothing to release)
    info: SeqInfo
    segments: tuple[tuple[int, int], ...]
    expires_in_s: float
    window_size: int = 0  # windowed: the segments hold window 0 of this many bytes each


@dataclass(frozen=True)
class Capabilities:
    """What ``Hello`` reports: transports, the arena and the device pool."""

    server_version: str
    transports: tuple[str, ...]
    chunk_size: int
    arena_path: str
    arena_size: int
    slot_size: int
    lease_ttl_s: float
    device: str = ""
    device_size: int = 0
    ipc_handle: bytes = b""
    device_uuid: str = ""
    instance: str = ""  # this start of the daemon (random; see Engine.instance)
    disk_path: str = ""  # the LMDB directory offered for disk grants ("" when they are not)
