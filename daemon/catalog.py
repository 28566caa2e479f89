"""The index: parked sequences, shared blocks and their reference counts.

Everything here happens under one lock, ``Catalog.lock`` (the *index lock*), which is
never held across disk I/O. It guards the sequence table, reference counts, every
``Seq``'s memory copies, readers and flags, and the memory tiers' slot allocators (the
lease table shares it; see ``leases.py``).

Primitives:
- ``Catalog(tiers, eviction, placement)``; ``load(manifests)`` rebuilds the index from
  disk manifests; ``placement`` says which memory tiers each sequence's copies may be in
  (``placement.py``), for the mover and the readers, and ``check`` asserts it.
- ``lock``; ``changed`` (a condition: notified whenever memory may have become
  available: a free, a reader leaving, a copy ending) and ``version`` (bumped with each
  such notice, so a waiter sees what happened while it was not waiting); ``wake`` (the
  maintenance thread's condition).
- Lookups (REQUIRES: lock): ``find``, ``get`` (``NotFound``), ``present``, ``in``, ``in_memory``,
  ``sequences``, ``memory_only``, ``refcount``. A sequence nobody uses is kept as a row of typed columns, not a ``Seq``
  (``rows.py``): a lookup makes its ``Seq`` again, and ``freeze_idle(limit)`` (the
  maintenance pass) turns ``Seq`` records back into rows once nothing but the index
  holds them. Nothing outside the catalog sees a row: every ``Seq`` handed out stays
  the one record of its version for as long as anyone holds it (``current`` and every
  identity check rest on that), because a ``Seq`` anyone else references is never
  frozen.
- ``committing``: versions between their write lease's end and their publish (REQUIRES: lock).
- ``next_gen()``: generations order every commit, drop and disk write of an id; they
  come from ``gens`` (``model.Generations``: unique across daemons).
- ``plan_commit(lease, expect_nbytes, block_size)``: validate a commit against the index
  (dedup of new blocks included); ``pin_refs`` / ``unpin_refs``: a commit takes its
  references when it validates, so the blocks it names cannot be retired while it
  writes to disk without a lock.
- ``publish_blocks``, ``publish_commit``, ``publish``: make committed sequences visible.
- ``expired(wall, grace_s) -> (ttl, unused)``: the versions (``Seq`` records) past their
  TTL, and shared blocks nobody took up (it looks only at sequences with a TTL and
  shared blocks, which the catalog keeps apart, not at every indexed block);
  ``current(seq)``: whether ``seq`` is still its id's indexed version (work chosen
  under the lock re-checks this after a gap); ``dangling()``: sequences referencing a
  missing shared block (start-up only: it scans).
- ``adopt(manifests)``: index sequences found in the remote tier on a local miss;
  ``on_remote()``: how many indexed sequences have a remote copy.
- ``retire(seq)``: unlink a sequence (drop, overwrite, expiry); memory is freed now or
  by the last reader or copy (``release_dropped``); shared blocks left unreferenced
  retire with it and are returned by ``take_orphans()`` for their disk copies.
- ``free(tier, alloc)``; ``over_high()`` (a memory tier, or the disk through
  ``disk_pressure``, past its high mark).
- Eviction without a scan: ``order`` keeps each tier's eviction order (``evict_order.py``)
  as copies come and go (``touch(seq, tier)`` after a new copy, ``touch(seq)`` after a read);
  ``demotion_plan(tier, exclude, cover)`` and ``disk_victims(ok, cover)`` give the
  coldest eligible few; ``evictable(tier, exclude, among)`` (policy snapshots).
- ``claim(seq)`` / ``unclaim(seq)`` (a move lock, counted) and ``copy_begin`` /
  ``copy_end`` (``Seq.moving``, counted): ``busy(exclude)`` reads the two counters.
- ``info``, ``info_of``, ``infos``, ``tier_stats``: read-only views.
- ``check(disk_used)``: the invariants, as assertions.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Callable, Iterable

from kvpark.proto.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvpark.proto.types import SeqInfo, TierStat
from kvpark.tiers import policy
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import Manifest, block_count
from kvpark.tiers.memory import MemTier

from .dirty import Dirty
from .evict_order import DISK, EvictionOrder, has, meta
from .model import MEM_TIERS, NS_SEP, Generations, Lease, ParkSpec, Seq, verified
from .placement import Placement
from .rows import Rows

_RANK = {"device": 0, "host": 1, "private": 1, "disk": 2, "remote": 3}


def _refs(table: dict, key: str) -> int:
    """References to ``table[key]``, counted from inside this function (its own local and
    the call's argument included): ``_ALONE`` when the table holds the only other one."""
    v = table[key]
    return sys.getrefcount(v)


class _Probe:
    __slots__ = ()


# Measured with the very call the freeze pass makes, so it holds whatever the interpreter
# counts for locals and arguments.
_ALONE = _refs({"k": _Probe()}, "k")


class Catalog:
    def __init__(self, tiers: dict[str, MemTier], eviction: str = "lru", placement: Placement | None = None) -> None:
        self.tiers = tiers
        self.placement = placement if placement is not None else Placement()
        # Each tier's eviction order, kept as copies come and go and sequences are read:
        # victims are found among the coldest few, not by sorting the index.
        self.order = EvictionOrder(eviction, tiers)
        # Moves in flight (``claim``ed move locks) and copies reading a memory copy
        # (``copy_begin``): ``busy`` reads them, rather than every sequence's move lock.
        self._claims = 0
        self._copies = 0
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.wake = threading.Condition(self.lock)
        # id -> its indexed version: a ``Seq``, or (nobody uses it) a row of ``rows``.
        self._seqs: dict[str, Seq | int] = {}
        # Rows only where the eviction order keeps ids (key-ordered policies): the other
        # policies' member sets hold every ``Seq`` of a tier.
        self.rows: Rows | None = (Rows({n: t.alloc.slot_size for n, t in tiers.items()})
                                  if self.order.keyed else None)
        self._hot: deque[str] = deque()  # ids that may hold a ``Seq`` the freeze pass could make a row
        self.order.bind(self._entry_of, self.get, self._peek)
        self._refcount: dict[str, int] = {}  # shared block id -> sequences using it (and commits pinning it)
        self._orphans: list[Seq] = []  # retired shared blocks whose disk copies still need deleting
        # The indexed sequences ``expired`` looks at (a TTL, or a shared block): the
        # maintenance pass runs it every second, and a scan of a million plain blocks
        # there held the index lock for most of a second.
        self._special: dict[Seq, None] = {}
        # Namespace ("alice" + NS_SEP) -> its sequences: a tenant's usage, quota victims and
        # list without a scan of every tenant's million blocks. Open daemons have none.
        self._spaces: dict[str, dict[str, Seq]] = {}
        # Versions a commit has taken from its write lease and not yet published or
        # refused (``commit.py``): a tenant's usage counts them (``quota.py``).
        self.committing: set[Seq] = set()
        self.gens = Generations()
        # Memory-only sequences, oldest first, for write_back's dirty bounds (set by the
        # engine; none by default).
        self.dirty = Dirty()
        self.version = 0  # bumped by every change that may make room (see ``notify``)
        # Whether the disk tier is past its high mark with eviction on (set by the engine):
        # that too wakes the maintenance thread, not only a memory tier past its mark.
        self.disk_pressure: Callable[[], bool] = lambda: False

    def load(self, manifests: Iterable[Manifest]) -> int:
        """Index sequences found on disk; returns their payload bytes."""
        total = 0
        rows = self.rows
        with self.lock:
            for m in manifests:
                sid = m.seq_id
                special = m.shared or m.expires_at is not None
                # A plain block goes straight into a row: a restart makes no ``Seq`` for it.
                row = rows.add(m, on_disk=True) if rows is not None and not special and NS_SEP not in sid else None
                if row is not None:
                    self._seqs[sid] = row  # load_manifests yields each id once
                else:
                    seq = Seq(m, on_disk=True)
                    self._seqs[sid] = seq
                    if special:
                        self._special[seq] = None
                    if NS_SEP in sid:
                        self._space_add(seq)
                total += m.nbytes
                self.gens.seen(m.gen)
                for r in m.refs:
                    self._refcount[r] = self._refcount.get(r, 0) + 1
        return total

    # ------------------------------------------------------------------ lookups (REQUIRES: lock)

    def find(self, seq_id: str) -> Seq | None:
        v = self._seqs.get(seq_id)
        if v.__class__ is int:
            return self._thaw(seq_id, v)  # type: ignore[arg-type]
        return v  # type: ignore[return-value]

    def get(self, seq_id: str) -> Seq:
        seq = self.find(seq_id)
        if seq is None:
            raise NotFound(f"no parked sequence {seq_id!r}")
        return seq

    def present(self, seq_ids: list[str]) -> list[bool]:
        return [sid in self._seqs for sid in seq_ids]

    def __contains__(self, seq_id: str) -> bool:
        """Whether ``seq_id`` is indexed (a row stays a row)."""
        return seq_id in self._seqs

    def sequences(self) -> list[Seq]:
        """Every indexed version, as ``Seq`` records (rows are thawed: not for a request's path)."""
        return [self.get(sid) for sid in list(self._seqs)]

    def in_memory(self, seq_ids: list[str]) -> bool:
        """Whether every id is indexed with a ready memory copy; rows are read in place
        (a connector's lookup asks this of a whole prefix on every step)."""
        rows = self.rows
        for sid in seq_ids:
            v = self._seqs.get(sid)
            if v is None:
                return False
            if v.__class__ is int:
                if rows.alloc(v) is None:  # type: ignore[union-attr,arg-type]
                    return False
            elif not v.res:  # type: ignore[union-attr]
                return False
        return True

    def memory_only(self) -> list[Seq]:
        """Every indexed version with a memory copy and no disk copy (a flush's work):
        rows are read in place, and only those are thawed."""
        rows = self.rows
        out: list[Seq] = []
        cold: list[str] = []
        for sid, v in self._seqs.items():
            if v.__class__ is int:
                if not rows.on_disk(v) and rows.alloc(v) is not None:  # type: ignore[union-attr,arg-type]
                    cold.append(sid)
            elif v.res and not v.on_disk:  # type: ignore[union-attr]
                out.append(v)  # type: ignore[arg-type]
        return out + [self.get(sid) for sid in cold]

    # ------------------------------------------------------------------ rows (REQUIRES: lock)

    def _peek(self, seq_id: str) -> Seq | None:
        """The indexed version to read, a row as a detached copy (``Rows.view``): for
        what only reads (a listing, a victim's eligibility) and must not make a row a
        ``Seq`` again, nor hold, index or compare the copy by identity."""
        v = self._seqs.get(seq_id)
        if v.__class__ is int:
            return self.rows.view(v, seq_id)  # type: ignore[union-attr,arg-type]
        return v  # type: ignore[return-value]

    def freeze_queued(self) -> int:
        """Ids queued for the freeze pass (those write-back cleaned taken in first): a
        pass looks at each at most once. REQUIRES: lock."""
        self._hot.extend(self.dirty.take_cleaned())
        return len(self._hot)

    def _thaw(self, seq_id: str, row: int) -> Seq:
        assert self.rows is not None
        seq = self.rows.thaw(row, seq_id)
        self._seqs[seq_id] = seq
        self._hot.append(seq.seq_id)  # the index's own string, not the caller's copy
        return seq

    def freeze_idle(self, limit: int) -> int:
        """Turn up to ``limit`` ``Seq`` records nobody but the index holds into rows;
        returns how many ids it looked at (fewer than ``limit``: nothing left to look at).

        Held records (a lease, a copy, a dirty clock, a move, a commit, a caller between
        two lock holds) are looked at again later; records that stay ``Seq`` for good (a
        TTL or shared block, a tenant's id: their sets hold them) are dropped from the
        queue. REQUIRES: lock."""
        rows, hot, seqs = self.rows, self._hot, self._seqs
        if rows is None:
            hot.clear()
            self.dirty.take_cleaned()
            return 0
        hot.extend(self.dirty.take_cleaned())
        later: dict[str, None] = {}  # an id queued twice (a thaw, then a clean) goes back once
        looked = 0
        while hot and looked < limit:
            sid = hot.popleft()
            looked += 1
            v = seqs.get(sid)
            if v is None or v.__class__ is int:
                continue
            if v.shared or v.expires_at is not None or NS_SEP in sid:  # type: ignore[union-attr]
                continue  # ``_special`` or ``_spaces`` holds it for as long as it is indexed
            if v.dirty_since:  # type: ignore[union-attr]
                continue  # memory-only: looked at again when write-back cleans it (``take_cleaned``)
            del v  # the count below must see the table's reference and its own only
            if _refs(seqs, sid) != _ALONE:
                later[sid] = None
                continue
            seq: Seq = seqs[sid]  # type: ignore[assignment]
            row = rows.freeze(seq)
            del seq  # a later id's count must not see this one
            if row is None:
                later[sid] = None
            else:
                seqs[sid] = row
        hot.extend(later)
        return looked

    def _entry_of(self, seq_id: str, tier: str) -> tuple | None:
        """The eviction order's entry for ``seq_id``'s indexed version in ``tier`` (a
        ``Seq`` or a row: nothing is thawed), or None without a copy there."""
        v = self._seqs.get(seq_id)
        if v is None:
            return None
        if v.__class__ is int:
            rows = self.rows
            assert rows is not None
            if not rows.has(v, tier):  # type: ignore[arg-type]
                return None
            return self.order.entry_of_meta(rows.meta(v, seq_id, tier))  # type: ignore[arg-type]
        seq: Seq = v  # type: ignore[assignment]
        return self.order.entry(seq, tier) if has(seq, tier) else None

    def _tier_index(self, tier: str) -> list:
        """Every indexed copy in ``tier`` for building its eviction order: entries (keyed
        policies, rows read in place) or ``Seq`` records."""
        if not self.order.keyed:
            return [s for s in self._seqs.values() if s.__class__ is not int]
        out = []
        for sid in self._seqs:
            e = self._entry_of(sid, tier)
            if e is not None:
                out.append(e)
        return out

    def __len__(self) -> int:
        return len(self._seqs)

    def refcount(self, seq_id: str) -> int:
        return self._refcount.get(seq_id, 0)

    def next_gen(self) -> int:
        return self.gens.next()

    # ------------------------------------------------------------------ changes (REQUIRES: lock)

    def pin_refs(self, refs: Iterable[str]) -> None:
        for r in refs:
            self._refcount[r] = self._refcount.get(r, 0) + 1

    def unpin_refs(self, refs: Iterable[str]) -> None:
        # A block left unreferenced by a failed commit stays until the reaper expires it,
        # exactly as if the commit had never pinned it.
        for r in refs:
            left = self._refcount.get(r, 0) - 1
            if left > 0:
                self._refcount[r] = left
            else:
                self._refcount.pop(r, None)

    def publish_blocks(self, blocks: list[Seq]) -> None:
        """Publish new blocks; one a concurrent park created first is retired (dedup)."""
        for b in blocks:
            if b.seq_id in self._seqs:
                self.retire(b)
                self._orphans.append(b)
            else:
                self._index(b)
        self.notify()

    def publish(self, seq: Seq, old: Seq | None) -> None:
        # References were pinned when the commit validated; the old version's go now,
        # so a block shared by the old and the new version never drops to zero.
        if old is not None:
            self.retire(old)
        self._index(seq)
        self.notify()

    def publish_commit(self, seq: Seq, spec: ParkSpec, replace: Manifest | None) -> list[Seq]:
        """Publish ``seq`` over whatever version of its id is current now. REQUIRES: index lock.

        A drop between validation and now is ordered before this commit; a newer
        generation already published wins over this one (this one is replaced at once).
        Returns the version retired, whose disk copy the caller deletes.
        """
        for r in spec.refs:
            target = self.find(r)
            if target is None or not target.shared:
                raise FailedPrecondition(f"referenced shared block {r!r} is no longer a shared block")
        cur = self.find(spec.seq_id)
        if cur is not None and cur.gen > seq.gen:
            self.retire(seq)  # a later commit of the same id already published
            return [seq]
        if cur is not None and not spec.overwrite:
            raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
        if cur is not None and cur.shared and self.refcount(cur.seq_id):
            raise FailedPrecondition(f"shared block {spec.seq_id!r} is in use; it cannot be overwritten")
        if cur is not None and replace is not None and cur.gen == replace.gen and seq.on_disk:
            cur.on_disk = False  # its blocks went in the same transaction as ours
        self.publish(seq, cur)
        return [cur] if cur is not None else []

    def plan_commit(self, lease: Lease, expect_nbytes: int | None, block_size: int) -> tuple[list[Seq], Seq | None]:
        """Validate a commit; returns the blocks to create and the version it replaces.

        REQUIRES: index lock. Blocks that exist by now (another park created the same
        content) are dropped from the list and their reserved slots freed:
        content-addressed dedup.
        """
        spec, tier = lease.spec, lease.tier
        assert spec is not None
        if expect_nbytes is not None and (lease.received != spec.total or expect_nbytes != spec.total):
            raise InvalidArgument(
                f"commit after {lease.received} bytes (commit says {expect_nbytes}); header declared {spec.total}"
            )
        old = None if spec.is_batch else self.find(spec.seq_id)
        if old is not None and not spec.overwrite:
            raise AlreadyExists(f"sequence {spec.seq_id!r} is already parked (pass overwrite=True)")
        if old is not None and old.shared and self.refcount(old.seq_id):
            raise FailedPrecondition(f"shared block {spec.seq_id!r} is in use; it cannot be overwritten")
        # Validate everything first: an error below leaves every allocation with the lease,
        # and the caller frees them all exactly once.
        plan: list[tuple[ParkSpec, Allocation, bool]] = []
        creating: set[str] = set()
        for b, a in zip(spec.blocks, lease.block_allocs):
            have = self.find(b.seq_id)
            if have is not None and have.shared != b.shared:
                kind = "a shared block" if have.shared else "a plain sequence"
                raise FailedPrecondition(f"{b.seq_id!r} is already parked as {kind}")
            plan.append((b, a, have is not None))
            if have is None:
                creating.add(b.seq_id)
        for r in spec.refs:
            target = self.find(r)
            if r not in creating and (target is None or not target.shared):
                raise NotFound(f"referenced shared block {r!r} is not parked")
        # Commit point: nothing below raises.
        fresh: list[Seq] = []
        for b, a, exists in plan:
            if exists:
                self.free(tier, a)  # same content is already stored: content-addressed dedup
                continue
            m = ParkSpec(b.seq_id, b.tensors, b.nbytes, priority=spec.priority, shared=b.shared, attrs=b.attrs,
                         pinned=spec.pinned, ttl_s=spec.ttl_s, xxh3=b.xxh3).manifest(self.next_gen(), block_size)
            fresh.append(Seq(manifest=m, res={tier: a}))
        lease.block_allocs = []  # owned by the fresh block sequences (or freed) now
        return fresh, old

    def _index(self, seq: Seq) -> None:
        prev = self.find(seq.seq_id)
        if prev is not None:
            self._special.pop(prev, None)
        if prev is not None:
            self.order.forget(prev)
        self._seqs[seq.seq_id] = seq
        if seq.shared or seq.expires_at is not None:
            self._special[seq] = None
        if NS_SEP in seq.seq_id:
            self._space_add(seq)
        self.order.track(seq)
        self.dirty.track(seq, time.monotonic())
        if self.rows is not None:
            self._hot.append(seq.seq_id)

    def _space_add(self, seq: Seq) -> None:
        sid = seq.seq_id
        self._spaces.setdefault(sid[: sid.index(NS_SEP) + 1], {})[sid] = seq

    def _space_drop(self, seq: Seq) -> None:
        sid = seq.seq_id
        if NS_SEP not in sid:
            return
        prefix = sid[: sid.index(NS_SEP) + 1]
        space = self._spaces.get(prefix)
        if space is not None and space.get(sid) is seq:
            del space[sid]
            if not space:
                del self._spaces[prefix]

    def in_namespace(self, prefix: str) -> list[Seq]:
        """The sequences whose ids start with ``prefix`` (a name + ``NS_SEP``). REQUIRES: lock."""
        return list(self._spaces.get(prefix, {}).values())

    def retire(self, seq: Seq) -> None:
        """Unlink ``seq``; memory is freed now, or by the last reader/copy."""
        seq.dropped = True
        self.dirty.untrack(seq)
        if self._seqs.get(seq.seq_id) is seq:
            del self._seqs[seq.seq_id]
            self._special.pop(seq, None)
            self._space_drop(seq)
        self.order.forget(seq)
        self.release_dropped(seq)
        for r in seq.refs:
            left = self._refcount.get(r, 0) - 1
            if left > 0:
                self._refcount[r] = left
                continue
            self._refcount.pop(r, None)
            block = self.find(r)
            if block is not None and block.shared:
                self.retire(block)  # its last user is gone
                self._orphans.append(block)

    def expired(self, wall: float, grace_s: float) -> tuple[list[Seq], list[Seq]]:
        """Versions past their TTL; and shared blocks nobody took up within ``grace_s`` of
        their park. A block known only from the remote tier holds nothing here and is left
        alone (another daemon's sequences may use it). The records themselves, not their
        ids: the caller drops them after releasing the lock, and an id re-parked meanwhile
        is another version (``drop_version``)."""
        ttl = [s for s in self._special if s.expires_at is not None and s.expires_at <= wall]
        unused = [s for s in self._special
                  if s.shared and not self._refcount.get(s.seq_id) and s.manifest.created_at < wall - grace_s
                  and (s.res or s.on_disk) and (s.expires_at is None or s.expires_at > wall)]
        return ttl, unused

    def current(self, seq: Seq) -> bool:
        """Whether ``seq`` is still the indexed version of its id. REQUIRES: lock."""
        return self._seqs.get(seq.seq_id) is seq

    def dangling(self) -> list[Seq]:
        """Sequences that reference a shared block the index lacks (a crash left them);
        a start-up check, not for a request's path (it scans the index). REQUIRES: lock."""
        rows = self.rows

        def shared(v: Seq | int | None) -> bool:
            return v is not None and (rows.form(v).shared if v.__class__ is int else v.shared)  # type: ignore

        bad = [sid for sid, v in self._seqs.items()
               if any(not shared(self._seqs.get(r))
                      for r in (rows.form(v).refs if v.__class__ is int else v.refs))]  # type: ignore
        return [self.get(sid) for sid in bad]

    def adopt(self, manifests: Iterable[Manifest]) -> None:
        """Index sequences found in the remote tier on a local miss (ids already indexed
        are left as they are). Later local generations stay above theirs."""
        for m in manifests:
            if m.seq_id in self._seqs:
                continue
            seq = Seq(manifest=m, on_remote=True)
            self._index(seq)
            self.gens.seen(m.gen)
            for r in seq.refs:
                self._refcount[r] = self._refcount.get(r, 0) + 1

    def on_remote(self) -> int:
        rows = self.rows
        return sum(1 for s in self._seqs.values()
                   if (rows.on_remote(s) if s.__class__ is int else s.on_remote))  # type: ignore[union-attr,arg-type]

    def take_orphans(self) -> list[Seq]:
        todo, self._orphans = self._orphans, []
        return todo

    def release_dropped(self, seq: Seq) -> None:
        if not seq.dropped or seq.moving:
            return
        for name in list(seq.res):
            if not seq.readers.get(name):
                self.free(name, seq.res.pop(name))

    def free(self, tier: str, alloc: Allocation) -> None:
        self.tiers[tier].alloc.free(alloc)
        self.version += 1
        self.changed.notify_all()

    def notify(self) -> None:
        """Something that may make room happened; wake waiters and, past a high mark, demotion."""
        self.version += 1
        self.changed.notify_all()
        if self.over_high():
            self.wake.notify_all()

    def over_high(self) -> bool:
        """A tier the maintenance thread relieves is past its high mark (memory, or disk)."""
        return (any(policy.over_high(t.alloc.used_bytes, t.alloc.capacity, t.high) for t in self.tiers.values())
                or self.disk_pressure())

    @staticmethod
    def _demotable(s: Seq, tier: str, exclude: Seq | None) -> bool:
        # Pinned sequences leave a tier only when a faster copy remains (they are never
        # demoted below the tier they are in); leased or moving copies stay.
        return (tier in s.res and not s.dropped and not s.readers.get(tier) and not s.moving and s is not exclude
                and (not s.pinned or s.tier != tier))

    def evictable(self, tier: str, exclude: Seq | None = None,
                  among: Iterable[Seq] | None = None) -> list[policy.SeqMeta]:
        """Every copy in ``tier`` that may be demoted now (``among`` given sequences, or
        the tier's members: not the whole index)."""
        pool = self.demotion_plan(tier, exclude) if among is None else among
        return [meta(s, tier) for s in pool if self._demotable(s, tier, exclude)]

    def demotion_plan(self, tier: str, exclude: Seq | None = None, cover: int | None = None) -> list[Seq]:
        """Copies in memory tier ``tier`` that may be demoted now, coldest first by the
        eviction policy, just enough to free ``cover`` bytes (None: all of them)."""
        return self.order.victims(tier, lambda s: self._demotable(s, tier, exclude), cover, self._tier_index)

    def disk_victims(self, ok: Callable[[Seq], bool], cover: int | None) -> list[Seq]:
        """Sequences with a disk copy for which ``ok`` holds, coldest first, enough to cover ``cover`` bytes."""
        return self.order.victims(DISK, ok, cover, self._tier_index)

    def touch(self, seq: Seq, tier: str | None = None) -> None:
        """``seq`` gained a copy in ``tier``, or (no tier) was read: its place in the
        eviction order of that tier (every tier it is in)."""
        self.order.track(seq, tier)

    def claim(self, seq: Seq, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take ``seq``'s move lock, counted for ``busy``. NOT under the index lock.
        Blocking with a ``timeout``: ``Unavailable`` when the move holding it has not
        ended by then (a copy on a hung device holds it until the copy completes)."""
        if not seq.move_lock.acquire(blocking, timeout if blocking and timeout is not None else -1):
            if blocking:
                raise Unavailable(f"sequence {seq.seq_id!r} is held by a move that has not ended in "
                                  f"{timeout:.0f} s (a hung device?)")
            return False
        with self.lock:
            self._claims += 1
        return True

    def unclaim(self, seq: Seq) -> None:
        with self.lock:
            self._claims -= 1
        seq.move_lock.release()

    def copy_begin(self, seq: Seq) -> None:
        """A copy reads ``seq``'s memory (it cannot be freed meanwhile). REQUIRES: lock."""
        seq.moving += 1
        self._copies += 1

    def copy_end(self, seq: Seq) -> None:
        seq.moving -= 1
        self._copies -= 1

    def busy(self, exclude: Seq | None = None) -> bool:
        """A copy or promotion is in flight: room may appear without anyone demoting.
        ``exclude``'s own move (the caller's) does not count. Two counters, no scan."""
        lock = exclude._move_lock if exclude is not None else None  # never made here
        own = 1 if lock is not None and lock.locked() else 0
        return self._copies > 0 or self._claims - own > 0

    # ------------------------------------------------------------------ views (REQUIRES: lock)

    def info(self, seq: Seq) -> SeqInfo:
        comps = [c for c in map(self._peek, seq.refs) if c is not None] + [seq]
        return self.info_of([seq], comps)

    def info_of(self, tops: list[Seq], comps: list[Seq]) -> SeqInfo:
        """One payload made of ``comps``; a composite's tier is the slowest of its parts'."""
        top = tops[0]
        m = top.manifest
        tensors = tuple(t for c in comps for t in c.manifest.tensors)
        return SeqInfo(
            seq_id=",".join(t.seq_id for t in tops),
            nbytes=sum(c.manifest.nbytes for c in comps),
            tier=max((c.tier for c in comps), key=_RANK.__getitem__),
            num_tensors=len(tensors),
            tensors=tensors,
            priority=m.priority,
            created_at=m.created_at,
            last_access=m.last_access,
            num_blocks=sum(len(c.manifest.block_lengths) for c in comps),
            attrs=top.attrs,
            refs=top.refs,
            shared=top.shared,
            refcount=self._refcount.get(top.seq_id, 0),
            pinned=top.pinned,
            expires_at=top.expires_at or 0.0,
            xxh3=verified(comps),
        )

    def infos(self) -> list[SeqInfo]:
        # Rows are read as detached copies: a listing makes no row a ``Seq`` again.
        return [self.info(self._peek(sid)) for sid in sorted(self._seqs)]  # type: ignore[arg-type]

    def tier_stats(self, disk_capacity: int, disk_used: int, evictions: dict[str, int] | None = None,
                   slot_size: int = 1) -> dict[str, TierStat]:
        out: dict[str, TierStat] = {}
        ev = evictions or {}
        rows = self.rows
        by_tier: dict[str, list[Allocation]] = {name: [] for name in self.tiers}
        disk_blocks = disk_n = 0
        for v in self._seqs.values():
            if v.__class__ is int:  # a row: read in place, nothing thawed
                held_row = rows.alloc(v)  # type: ignore[union-attr,arg-type]
                if held_row is not None:
                    by_tier[held_row[0]].append(held_row[1])
                if rows.on_disk(v):  # type: ignore[union-attr,arg-type]
                    f = rows.form(v)  # type: ignore[union-attr,arg-type]
                    disk_n += 1
                    disk_blocks += block_count(f.nbytes, f.block_size)
                continue
            s: Seq = v  # type: ignore[assignment]
            for name in s.res:
                by_tier[name].append(s.res[name])
            if s.on_disk:
                disk_n += 1
                disk_blocks += block_count(s.manifest.nbytes, s.manifest.block_size)
        for name, mem in self.tiers.items():
            held = by_tier[name]
            a = mem.alloc
            state = ("full" if not a.fits(slot_size) else
                     "demoting" if policy.over_high(a.used_bytes, a.capacity, mem.high) else "ok")
            out[name] = TierStat(a.capacity, a.used_bytes, sum(len(x.extents) for x in held), len(held),
                                 ev.get(name, 0), state)
        # Disk evictions: to the remote tier, or dropped (policy.disk_full = "evict").
        out["disk"] = TierStat(disk_capacity, disk_used, disk_blocks, disk_n,
                               ev.get("disk", 0), "full" if disk_capacity - disk_used < slot_size else "ok")
        return out

    def check(self, disk_used: int, write_leases: list[list[tuple[str, Allocation]]],
              readers: dict[tuple[int, str], int], leased: list[Seq]) -> None:
        """Assert the index's invariants against the tiers' own accounting.

        REQUIRES: lock, and a quiet engine (no park, copy or disk write in flight).
        ``write_leases`` are the slots reserved by open write leases, ``readers`` the
        read-lease count per ``(id(seq), tier)``, ``leased`` the sequences read leases
        hold: a dropped one among them still owns the copies its readers read.
        Rows are thawed first (the freeze pass turns them back later).
        """
        if self.rows is not None:
            cold = [(sid, v) for sid, v in self._seqs.items() if v.__class__ is int]
            assert len(self.rows) == len(cold), "rows in use out of step with the index"
            for sid, v in cold:
                assert self.rows.id_of(v) == sid, f"{sid}: row {v} holds {self.rows.id_of(v)!r}"  # type: ignore
        self.sequences()
        gone = [s for s in leased if self._seqs.get(s.seq_id) is not s]
        for s in gone:
            assert s.dropped, f"{s.seq_id}: leased, not in the index, yet not dropped"
            assert set(s.res) == {t for t, n in s.readers.items() if n and t in MEM_TIERS}, (
                f"{s.seq_id}: dropped, keeps {sorted(s.res)} for readers on {s.readers}")
        for name, mem in self.tiers.items():
            allocs = [s.res[name] for s in [*self._seqs.values(), *gone] if name in s.res]
            allocs += [a for held in write_leases for t, a in held if t == name]
            charged = sum(a.charged for a in allocs)
            assert mem.alloc.used_bytes == charged, f"{name}: allocator says {mem.alloc.used_bytes}, owners {charged}"
        on_disk = sum(s.manifest.nbytes for s in self._seqs.values() if s.on_disk)
        assert disk_used == on_disk, f"disk: store holds {disk_used} bytes, the index {on_disk}"
        for s in gone:
            for t, n in s.readers.items():
                assert n == readers.get((id(s), t), 0), f"{s.seq_id} (dropped): {n} readers on {t}"
        refs: dict[str, int] = {}
        for s in self._seqs.values():
            assert not s.dropped and s.moving == 0, f"{s.seq_id}: dropped={s.dropped} moving={s.moving}"
            assert s.res or s.on_disk or s.on_remote, f"{s.seq_id}: no copy anywhere"
            assert set(s.res) <= set(MEM_TIERS)
            for t in s.res:
                assert self.placement.allowed(s.seq_id, t), f"{s.seq_id}: a copy in the {t} tier"
            for t, n in s.readers.items():
                assert n == readers.get((id(s), t), 0), f"{s.seq_id}: {n} readers on {t}"
            for r in s.refs:
                refs[r] = refs.get(r, 0) + 1
        assert refs == self._refcount, f"refcounts {self._refcount} != references {refs}"
        assert self._copies == sum(s.moving for s in [*self._seqs.values(), *gone]), "copies in flight miscounted"
        self.order.check(self._seqs.values())
        special = [s for s in self._seqs.values() if s.shared or s.expires_at is not None]
        assert set(map(id, special)) == set(map(id, self._special)), "expiry candidates out of step with the index"
        spaced = {id(s) for s in self._seqs.values() if NS_SEP in s.seq_id}
        assert spaced == {id(s) for space in self._spaces.values() for s in space.values()}, (
            "namespaces out of step with the index")
        for r in refs:
            block = self._seqs.get(r)
            assert block is not None and block.shared, f"reference to missing shared block {r!r}"
