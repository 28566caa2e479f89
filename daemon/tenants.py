"""One tenant's view of the engine: its names namespaced, its quotas applied, its data paths.

The servicer asks ``Tenants.view()`` for the engine of the running call. Without tenants
configured that is an ``OpenView``: the engine itself (names, replies and the on-disk
format as they always were) behind the one id check every daemon applies; with
tenants it is a ``TenantView`` for the caller that ``auth`` bound.

Primitives:
- ``SEP``: what joins a tenant's name to each id it uses ("alice" + SEP + "chat-1"). A
  tenant name cannot contain it, and no id a client sends may (``check_id``), so no id
  one tenant can send lands in another's space.
- ``check_id(seq_id)``: the one rule for an id a client sends, on every daemon:
  ``InvalidArgument`` for an empty, overlong or control-character id, or one holding ``SEP``.
- ``Tenants(engine, tenants)``: ``view() -> OpenView | TenantView`` for the running call
  (``Unauthenticated`` if tenants are configured and no tenant is bound: the last line of
  defence should the interceptor ever be bypassed); ``all_stats()`` (every tenant's row,
  for /metrics).
- ``OpenView``: the engine as a daemon without tenants serves it, every id checked by
  ``check_id`` on the way in (so a token-less client of an open daemon can name no
  tenant's sequence, on its disk or in a Redis it shares); everything else is the engine's.
- ``TenantView``: the engine calls the servicer makes (``hello``, ``reserve``,
  ``write_chunk``, ``commit``, ``release``, ``acquire``, ``grant``, ``iter_chunks``,
  ``prefetch``, ``present``, ``in_memory``, ``drop``, ``info``, ``list``, ``stat``, ``pin``, ``flush``),
  each id (sequence, reference, shared block) qualified on the way in and shown bare on
  the way out, errors included. ``max_seq_id_len`` is what is left of the id limit.

Shared blocks are content-addressed by the ids the client computes; qualifying them
means a prefix hit, a dedup and the time a lookup takes only ever reflect the caller's
own blocks. Lease ids are 128-bit random capabilities issued to the caller; a commit of
another tenant's write lease is refused all the same. Tenants not ``trusted_local`` get
no arena and no device pool: Hello offers them inline only, and Reserve and Acquire
(the shm / cuda_ipc calls) are refused with PERMISSION_DENIED. Nor are their bytes ever
in either: the engine keeps their memory copies in the private tier (``placement.py``),
charged to their ``host`` quota; ``TenantView.tiers`` are the memory tiers a tenant's
copies may be in.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from kvpark.proto.errors import (
    InvalidArgument,
    KVParkError,
    LeaseExpired,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvpark.proto.layout import MAX_SEQ_ID_BYTES, validate_seq_id
from kvpark.proto.types import SeqInfo, Stat, TenantStat

from . import flush as flushing
from .auth import current_tenant
from .config import TenantConfig
from .leases import gone, write_gone, write_idle
from .model import NS_SEP, Capabilities, Grant, ParkSpec, ReadHandle, Reservation
from .placement import CLIENT_TIERS, PRIVATE, quota_tier
from .quota import Quotas

if TYPE_CHECKING:
    from .engine import Engine

SEP = NS_SEP


def check_id(seq_id: str) -> None:
    """An id as a client may send it, whatever daemon it reaches."""
    validate_seq_id(seq_id)
    if SEP in seq_id:
        raise InvalidArgument(f"seq_id must not contain {SEP!r} (U+241F, the tenant separator)")


def _check_spec(spec: ParkSpec) -> None:
    if spec.seq_id:  # "": a batch of blocks only
        check_id(spec.seq_id)
    for r in spec.refs:
        check_id(r)
    for b in spec.blocks:
        _check_spec(b)


class OpenView:
    """The engine of a daemon without tenants, ids checked as a tenant's are."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)  # calls that name no id: the engine's own

    def reserve(self, spec: ParkSpec, inline: bool = False, tier: str | None = None) -> Reservation:
        _check_spec(spec)
        return self.engine.reserve(spec, inline=inline, tier=tier)

    def acquire(self, seq_ids: str | list[str], need: str | None = None, stream: bool = False,
                expect_layout: str = "", inline_max: int = 0, disk: bool = False) -> ReadHandle:
        for s in [seq_ids] if isinstance(seq_ids, str) else seq_ids:
            check_id(s)
        return self.engine.acquire(seq_ids, need=need, stream=stream, expect_layout=expect_layout,
                                   inline_max=inline_max, disk=disk)

    def prefetch(self, seq_id: str, tier: str, wait: bool = False, timeout: float | None = None) -> str:
        check_id(seq_id)
        return self.engine.prefetch(seq_id, tier, wait=wait, timeout=timeout)

    def present(self, seq_ids: list[str]) -> list[bool]:
        for s in seq_ids:
            check_id(s)
        return self.engine.present(seq_ids)

    def in_memory(self, seq_ids: list[str]) -> bool:
        for s in seq_ids:
            check_id(s)
        return self.engine.in_memory(seq_ids)

    def drop(self, seq_id: str) -> bool:
        check_id(seq_id)
        return self.engine.drop(seq_id)

    def info(self, seq_id: str) -> SeqInfo:
        check_id(seq_id)
        return self.engine.info(seq_id)

    def pin(self, seq_id: str, pinned: bool = True) -> SeqInfo:
        check_id(seq_id)
        return self.engine.pin(seq_id, pinned)


@contextmanager
def _scrubbed(prefix: str) -> Iterator[None]:
    """Errors name ids as the tenant sent them."""
    try:
        yield
    except KVParkError as e:
        if prefix not in e.message:
            raise
        raise type(e)(e.message.replace(prefix, "")) from None


class TenantView:
    def __init__(self, engine: "Engine", tenant: TenantConfig, quotas: Quotas) -> None:
        self.engine = engine
        self.tenant = tenant
        self.quotas = quotas
        self.prefix = tenant.name + SEP
        self.max_seq_id_len = MAX_SEQ_ID_BYTES - len(self.prefix.encode())
        # The memory tiers this tenant's copies may be in: what no client maps, unless it
        # is trusted with every other trusted_local tenant's bytes anyway.
        self.tiers: tuple[str, ...] = CLIENT_TIERS if tenant.trusted_local else (PRIVATE,)

    # ------------------------------------------------------------------ names

    def _ns(self, seq_id: str) -> str:
        check_id(seq_id)
        if len(seq_id.encode("utf-8")) > self.max_seq_id_len:
            raise InvalidArgument(f"seq_id is {len(seq_id.encode('utf-8'))} bytes; the limit for tenant "
                                  f"{self.tenant.name!r} is {self.max_seq_id_len}")
        return self.prefix + seq_id

    def _bare(self, seq_id: str) -> str:
        return seq_id[len(self.prefix):] if seq_id.startswith(self.prefix) else seq_id

    def _spec(self, spec: ParkSpec) -> ParkSpec:
        return dataclasses.replace(
            spec,
            seq_id=self._ns(spec.seq_id) if spec.seq_id else "",  # "": a batch of blocks only
            refs=tuple(self._ns(r) for r in spec.refs),
            blocks=tuple(self._spec(b) for b in spec.blocks),
        )

    def _out(self, info: SeqInfo, shown: str | None = None) -> SeqInfo:
        return dataclasses.replace(info, seq_id=self._bare(info.seq_id) if shown is None else shown,
                                   refs=tuple(self._bare(r) for r in info.refs))

    def _trusted(self, what: str) -> None:
        if not self.tenant.trusted_local:
            raise PermissionDenied(f"tenant {self.tenant.name!r} is not trusted_local: {what} is not offered to it "
                                   "(inline transport only)")

    # ------------------------------------------------------------------ park

    def hello(self) -> Capabilities:
        h = self.engine.hello()
        if self.tenant.trusted_local:
            return h
        return dataclasses.replace(h, transports=("inline",), arena_path="", arena_size=0, ipc_handle=b"",
                                   device="", device_size=0, device_uuid="", disk_path="")

    def reserve(self, spec: ParkSpec, inline: bool = False, tier: str | None = None) -> Reservation:
        if not inline:
            self._trusted("the shm / cuda_ipc park path")
        with _scrubbed(self.prefix):
            spec = self._spec(spec)
            spec.validate()  # before any room is made for it
            landing = self.engine.landing(spec, inline, tier)[0]  # the private tier, for an untrusted tenant
            if self.engine.windowed(spec, inline, tier):
                landing = "disk"  # through windows of slots straight to disk: no memory quota is used
            with self.quotas.lock(self.tenant.name):
                try:
                    self.quotas.admit(self.tenant, self.prefix, spec, landing)
                except ResourceExhausted:
                    if not (inline and landing == "device"):
                        raise
                    # As the engine does for room: an inline park that cannot land on the
                    # device lands on host, under the host quota.
                    tier = "host"
                    landing = "disk" if self.engine.windowed(spec, inline, tier) else tier
                    self.quotas.admit(self.tenant, self.prefix, spec, landing)
                r = self.engine.reserve(spec, inline=inline, tier=tier)
                landed = "disk" if r.window_size else r.tier
                if landed != landing and landed != "disk":
                    # The engine's own fallback (the device physically full): charged where
                    # the bytes are, the open reservation counted there already.
                    try:
                        self.quotas.settle(self.tenant, self.prefix, landed)
                    except BaseException:
                        self.engine.release(r.lease_id)
                        raise
                return r

    def _own(self, lease_id: str, missing: Callable[[str], LeaseExpired]) -> None:
        owner = self.engine.leases.owner(lease_id)
        if owner is not None and not owner.startswith(self.prefix):
            # Answered exactly as the engine answers a lease that never was (``missing``
            # is its error for this call): the caller learns nothing either way.
            raise missing(lease_id)

    def write_chunk(self, lease_id: str, offset: int, data: memoryview) -> None:
        self._own(lease_id, write_idle)
        self.engine.write_chunk(lease_id, offset, data)

    def commit(self, lease_id: str, expect_nbytes: int | None = None) -> SeqInfo:
        self._own(lease_id, write_gone)
        with _scrubbed(self.prefix):
            return self._out(self.engine.commit(lease_id, expect_nbytes=expect_nbytes))

    def release(self, lease_id: str) -> bool:
        owner = self.engine.leases.owner(lease_id)
        if owner is not None and not owner.startswith(self.prefix):
            return False  # as for a lease that never was
        done = self.engine.release(lease_id)
        if done:  # a lease someone else ended was settled by them (a Release, the reaper)
            self._settle()  # a read that promoted has ended: its copies may leave now
        return done

    def _settle(self) -> None:
        """Bring the tenant back within its memory quotas after a promotion."""
        for tier in self.tiers:
            if quota_tier(tier) in self.tenant.quota and tier in self.engine.tiers:
                with self.quotas.lock(self.tenant.name):
                    try:
                        # Pinned copies too: a promoted pin may not outstay the quota.
                        self.quotas.settle(self.tenant, self.prefix, tier, pinned=True)
                    except ResourceExhausted:
                        pass  # only copies still being read are left: the last of those reads settles

    def window(self, lease_id: str, index: int) -> tuple[tuple[int, int], ...]:
        # Windows are arena slots: the shm / cuda_ipc path of a sequence larger than its tier.
        self._trusted("the windowed shm / cuda_ipc path")
        self._own(lease_id, gone)
        return self.engine.window(lease_id, index)

    # ------------------------------------------------------------------ restore

    def acquire(self, seq_ids: str | list[str], need: str | None = None, stream: bool = False,
                expect_layout: str = "", inline_max: int = 0, disk: bool = False) -> ReadHandle:
        if need is not None or disk:
            self._trusted("the shm / cuda_ipc restore path")
        ids = [seq_ids] if isinstance(seq_ids, str) else list(seq_ids)
        with _scrubbed(self.prefix):
            try:
                h = self.engine.acquire([self._ns(s) for s in ids], need=need, stream=stream,
                                        expect_layout=expect_layout, inline_max=inline_max, disk=disk)
            except KVParkError:
                # A restore of several ids that failed part way (a drop racing it, a corrupt
                # block) may have promoted the ones before: no Release will come to settle them.
                self._settle()
                raise
        return dataclasses.replace(h, info=self._out(h.info, ",".join(ids)))

    def grant(self, handle: ReadHandle) -> Grant:
        return self.engine.grant(handle)

    def iter_chunks(self, handle: ReadHandle, chunk_size: int) -> Iterator[tuple[int, list[memoryview]]]:
        with _scrubbed(self.prefix):
            yield from self.engine.iter_chunks(handle, chunk_size)

    def prefetch(self, seq_id: str, tier: str, wait: bool = False, timeout: float | None = None) -> str:
        # Before the quota's room is made: making room moves other sequences, which a
        # daemon that is stopping must not start (a promotion held for a lull runs late).
        self.engine.check_open()
        with _scrubbed(self.prefix):
            sid = self._ns(seq_id)
            to = self.engine.placement.tier(sid, self.engine.tier_arg(tier))  # where the engine will put it
            if quota_tier(to) in self.tenant.quota and to in self.engine.tiers:
                # Room within the quota first: a promotion never takes the tenant over it.
                info = self.engine.info(sid)
                with self.engine.absent([sid]), self.engine.catalog.lock:  # NOT_FOUND once durable
                    there = to in self.engine.catalog.get(sid).res
                with self.quotas.lock(self.tenant.name):
                    self.quotas.make_room(self.tenant, self.prefix, to, 0 if there else info.nbytes)
            # Once the promotion lands, the tenant is brought back within its quota: the room
            # made above is not held for it, so prefetches that do not wait, one after
            # another, each found that room free and would all land in it.
            out = self.engine.prefetch(sid, tier, wait=wait, timeout=timeout, then=None if wait else self._settle)
            if wait:
                self._settle()  # a promotion through a faster tier leaves the tenant within each
            return out

    # ------------------------------------------------------------------ queries

    def present(self, seq_ids: list[str]) -> list[bool]:
        with _scrubbed(self.prefix):
            return self.engine.present([self._ns(s) for s in seq_ids])

    def in_memory(self, seq_ids: list[str]) -> bool:
        with _scrubbed(self.prefix):
            return self.engine.in_memory([self._ns(s) for s in seq_ids])

    def drop(self, seq_id: str) -> bool:
        with _scrubbed(self.prefix):
            return self.engine.drop(self._ns(seq_id))

    def info(self, seq_id: str) -> SeqInfo:
        with _scrubbed(self.prefix):
            return self._out(self.engine.info(self._ns(seq_id)))

    def list(self) -> list[SeqInfo]:
        cat = self.engine.catalog
        with cat.lock:
            own = sorted(cat.in_namespace(self.prefix), key=lambda s: s.seq_id)
            return [self._out(cat.info(s)) for s in own]

    def pin(self, seq_id: str, pinned: bool = True) -> SeqInfo:
        with _scrubbed(self.prefix):
            return self._out(self.engine.pin(self._ns(seq_id), pinned))

    def flush(self) -> int:
        # This tenant's own sequences only: one tenant cannot make the daemon write (or
        # time the writing of) another's.
        return flushing.flush(self.engine.mover, self.prefix)

    def stat(self) -> Stat:
        # The tiers' totals (capacity, bytes and extents used: how full the daemon is),
        # and every count this tenant's own: no tenant learns another's name, usage or
        # activity (how many sequences or leases it holds).
        st = self.engine.stat()
        row = self.quotas.stat(self.tenant, self.prefix)
        held = dict.fromkeys(st.tiers, 0)
        cat = self.engine.catalog
        with cat.lock:
            own = cat.in_namespace(self.prefix)
            for s in own:
                for t in s.res:
                    held[t] = held.get(t, 0) + 1
                held["disk"] = held.get("disk", 0) + s.on_disk
            on_remote = sum(1 for s in own if s.on_remote)
            leases = self.engine.leases.count_owned(self.prefix)
        tiers = {name: dataclasses.replace(t, sequences=held.get(name, 0)) for name, t in st.tiers.items()}
        remote = None if st.remote is None else dataclasses.replace(st.remote, sequences=on_remote)
        return dataclasses.replace(st, tiers=tiers, sequences=row.sequences, leases=leases, remote=remote,
                                   tenants=(row,))


class Tenants:
    def __init__(self, engine: "Engine", tenants: Mapping[str, TenantConfig]) -> None:
        self.engine = engine
        self.quotas = Quotas(engine)
        self.views = {name: TenantView(engine, t, self.quotas) for name, t in tenants.items()}
        self.open = OpenView(engine)
        if self.views:
            engine.leases.on_expired = self._expired

    def _expired(self, owner: str) -> None:
        """A read lease on ``owner`` expired unreleased: its tenant's quota settles as after a
        Release (a reader that never releases must not keep the copies its reads promoted)."""
        view = self.views.get(owner.split(SEP, 1)[0]) if SEP in owner else None
        if view is not None:
            view._settle()

    def view(self) -> "OpenView | TenantView":
        if not self.views:
            return self.open
        t = current_tenant()
        if t is None or t.name not in self.views:
            raise Unauthenticated("no tenant bound to this call")
        return self.views[t.name]

    def all_stats(self) -> list[TenantStat]:
        return [self.quotas.stat(v.tenant, v.prefix) for v in self.views.values()]


__all__ = ["SEP", "OpenView", "TenantView", "Tenants", "check_id"]
