"""Per-tenant usage and quotas: what each tenant holds in each tier, and making room
for a park out of the tenant's own data only.

Primitives:
- ``Quotas(engine)``.
- ``usage(prefix) -> (sequences, {tier: bytes})`` (REQUIRES: index lock): payload bytes
  of the tenant's copies in ``device`` and ``host`` (copies in the private tier are host
  memory: counted under ``host``), and under ``disk`` every byte it has parked (each may
  land on disk; under write_through they all do); open write leases count as if
  committed, and so do commits between their lease's end and their publish
  (``Catalog.committing``).
- ``admit(tenant, prefix, spec, tier)``: before a park of ``spec`` (already namespaced)
  into memory tier ``tier`` (``"disk"`` for a park that streams to disk through windows): for that tier and for disk, if the tenant's usage plus the
  park is over its quota, demote (memory) or drop (disk) the tenant's own coldest
  sequences, by the eviction policy, until it fits; ``ResourceExhausted`` naming the
  tenant and the quota when its own data cannot make the room. Another tenant's data is
  never touched. The caller serialises admits of one tenant (``lock(name)``).
- ``settle(tenant, prefix, tier, pinned=False)``: after bytes landed in memory tier
  ``tier`` other than where they were admitted (an inline park's device->host fallback)
  or were promoted there (a restore, a prefetch): demote the tenant's own coldest
  sequences until it is within its ``tier`` quota again; ``ResourceExhausted`` when its
  own data cannot make the room (being read or written; pinned, unless ``pinned``).
  After a promotion the caller passes ``pinned``: a pinned sequence on disk that a
  restore promoted would otherwise stay in memory for good, past the quota (a pin is
  "never demoted below the tier it is in"), and a tenant pinning and restoring its
  sequences one by one would fill the tier with copies no demotion may take, to the
  exclusion of every other tenant; its pins hold within its quota, the pinned ones
  demoted last, coldest first. The caller holds ``lock(name)``.
- ``make_room(tenant, prefix, tier, need)``: before a promotion of ``need`` bytes into
  ``tier``: the same demotion, so that the promotion fits the quota.
- ``stat(tenant, prefix) -> TenantStat``.

The ``tier`` these take is the engine's memory tier (or ``"disk"``); the quota it is
charged to is ``placement.quota_tier(tier)``: a tenant that is not trusted_local has its
memory copies in the private tier only, and they are charged to its ``host`` quota
(its ``device`` quota has nothing to count: it never holds device memory).

Quotas are charged on the tier where the bytes land, on every path: a park is admitted
against the tier it is bound for, and settled on the tier it actually landed in; a
windowed park (through a window of the daemon's slots to disk) against disk. A
promotion never leaves a tenant over a memory quota for longer than the read it serves:
a prefetch makes room within the quota first (or is refused), and a restore's promoted
copy is settled as soon as the read ends (``TenantView.release``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvpark.proto.errors import FailedPrecondition, ResourceExhausted
from kvpark.proto.types import TenantStat
from kvpark.tiers import policy

from . import maintenance
from .config import QUOTA_TIERS, TenantConfig
from .evict_order import meta
from .model import ParkSpec, Seq
from .placement import quota_tier

if TYPE_CHECKING:
    from .engine import Engine


class Quotas:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def lock(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(name, threading.Lock())

    def usage(self, prefix: str, replacing: str = "") -> tuple[int, dict[str, int]]:
        # REQUIRES: index lock. ``replacing``: a sequence an overwrite will replace (not counted).
        used = {t: 0 for t in QUOTA_TIERS}
        n = 0
        for s in self.engine.catalog.in_namespace(prefix):
            if s.seq_id == replacing:
                continue
            n += 1
            for t in s.res:
                used[quota_tier(t)] += s.manifest.nbytes
            used["disk"] += s.manifest.nbytes
        for s in self.engine.catalog.committing:  # between their lease's end and their publish
            if s.seq_id.startswith(prefix) and s.seq_id != replacing:
                for t in s.res:
                    used[quota_tier(t)] += s.manifest.nbytes
                used["disk"] += s.manifest.nbytes
        for lease in self.engine.leases.open_writes():
            spec = lease.spec
            if spec is not None and spec.owner.startswith(prefix):
                if lease.window is None:  # a windowed park holds only its window, the daemon's
                    used[quota_tier(lease.tier)] += spec.total
                used["disk"] += spec.total
        return n, used

    def admit(self, tenant: TenantConfig, prefix: str, spec: ParkSpec, tier: str) -> None:
        replacing = spec.seq_id if spec.overwrite else ""
        for t in dict.fromkeys((tier, "disk")):
            quota = tenant.quota.get(quota_tier(t))
            if quota is None:
                continue
            if spec.total > quota:
                raise ResourceExhausted(f"tenant {tenant.name!r}: a park of {spec.total} bytes is larger than its "
                                        f"whole {quota_tier(t)} quota ({quota} bytes)")
            self._fit(tenant, prefix, t, spec.total, quota, replacing)

    def settle(self, tenant: TenantConfig, prefix: str, tier: str, pinned: bool = False) -> None:
        self.make_room(tenant, prefix, tier, 0, pinned)

    def make_room(self, tenant: TenantConfig, prefix: str, tier: str, need: int, pinned: bool = False) -> None:
        quota = tenant.quota.get(quota_tier(tier))
        if quota is not None and tier != "disk":
            if need > quota:
                raise ResourceExhausted(f"tenant {tenant.name!r}: {need} bytes are more than its whole "
                                        f"{quota_tier(tier)} quota ({quota} bytes)")
            self._fit(tenant, prefix, tier, need, quota, "", pinned)

    def _fit(self, tenant: TenantConfig, prefix: str, tier: str, need: int, quota: int, replacing: str,
             pinned: bool = False) -> None:
        eng = self.engine
        tried: set[int] = set()
        charged = quota_tier(tier)
        while True:
            with eng.catalog.lock:
                used = self.usage(prefix, replacing)[1][charged]
                if used + need <= quota:
                    return
                victims = [v for v in self._order(prefix, tier, pinned) if id(v) not in tried and v.seq_id != replacing]
            if not victims:
                verb = "dropped" if tier == "disk" else "demoted"
                raise ResourceExhausted(
                    f"tenant {tenant.name!r} is over its {charged} quota ({quota} bytes): {used} used, {need} more "
                    f"needed, and none of its own data can be {verb} (pinned, being read, or shared blocks in use)")
            victim = victims[0]
            tried.add(id(victim))
            # The version chosen, not whatever holds its id by now: a park that replaced
            # it meanwhile is not this quota's victim.
            if tier == "disk":
                try:
                    maintenance.drop_version(eng, victim, everywhere=False)  # a remote copy, if any, stays
                except FailedPrecondition:
                    pass  # a shared block taken up meanwhile
            else:
                eng.mover.demote(victim, tier)

    def _order(self, prefix: str, tier: str, pinned: bool = False) -> list[Seq]:
        """The tenant's own sequences that may leave ``tier``, coldest first (with ``pinned``,
        then its pinned copies there that nobody reads, coldest first). REQUIRES: index lock."""
        cat = self.engine.catalog
        name = self.engine.config.policy.eviction
        if tier != "disk":
            pool = cat.in_namespace(prefix)
            metas = cat.evictable(tier, among=pool)
            if pinned:
                free = {m.seq_id for m in metas}
                held = [meta(s, tier) for s in pool if s.pinned and s.seq_id not in free and tier in s.res
                        and not s.dropped and not s.readers.get(tier) and not s.moving]
                by_id = {s.seq_id: s for s in pool}
                return [by_id[sid] for sid in policy.demotion_order(name, metas) + policy.demotion_order(name, held)]
        else:
            pool = [s for s in cat.in_namespace(prefix)
                    if not s.pinned and not any(s.readers.values()) and not s.moving
                    and not (s.shared and cat.refcount(s.seq_id))]
            metas = [meta(s, "disk") for s in pool]
        by_id = {s.seq_id: s for s in pool}
        return [by_id[sid] for sid in policy.demotion_order(name, metas)]

    def stat(self, tenant: TenantConfig, prefix: str) -> TenantStat:
        with self.engine.catalog.lock:
            n, used = self.usage(prefix)
        return TenantStat(tenant.name, n, used, dict(tenant.quota))


__all__ = ["Quotas"]
