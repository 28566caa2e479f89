"""``Client``: the connection to one daemon and the data path it negotiated.

Primitives:
- ``Client(address=None, *, token=None, timeout=None, transport="auto", tls_ca=None,
  tls_cert=None, tls_key=None)``: connects (Hello) at once. ``token``: the tenant's bearer
  token (default ``KVPARK_TOKEN``), sent as ``authorization`` metadata on every call.
  ``tls_ca`` (default ``KVPARK_TLS_CA``), ``tls_cert``, ``tls_key`` (defaults
  ``KVPARK_TLS_CERT``, ``KVPARK_TLS_KEY``): file paths or PEM bytes; any of them makes the
  channel TLS (``tls_cert``/``tls_key``: mTLS). The environment reaches clients that
  libraries build for you (the vLLM connector, ``kvpark health``).
  ``verify`` (default ``KVPARK_VERIFY``): end-to-end verification (``kvpark.client.verify``):
  each tensor's xxh3-64 is sent with the park and checked after every restore
  (``DataLoss`` on a mismatch).
  ``timeout`` is every call's deadline: ``None`` means ``KVPARK_TIMEOUT`` or 30 s,
  ``float("inf")`` means none; a transfer also gets its size at 50 MB/s on top. Every
  public call takes ``timeout=`` for itself alone: a bound on the whole call, transfer
  included, and never past an enclosing ``deadline()``.
- ``park(seq_id, tensors, ...) -> SeqInfo``; ``park_batch(items) -> int``.
- ``restore(seq_id, *, device=None, into=None, layerwise=False)``; ``restore_many(seq_ids, ...)``.
- ``present``, ``lookup``, ``prefetch``, ``drop``, ``info``, ``list``, ``stat``.
- ``lookup_acquire(seq_ids, skip=0, max_ids=0, expect_layout="") -> (prefix, Grant | None)``:
  a prefix lookup that also acquires the hit past ``skip`` in the same round trip;
  ``restore_grant(grant, into_flat=..., release=True)`` copies it out (no further round
  trip when it came inline); ``release_grant(grant)`` ends its lease.
- ``pin(seq_id, pinned=True) -> SeqInfo``; ``flush() -> int`` (sequences written to disk).
- ``deadline(seconds)``: every call the calling thread makes inside the block ends
  within ``seconds`` from now, all together, transfers included; a call's ``timeout=``
  and nested blocks narrow it, never widen it.
- ``close()``: calls begun after it raise ``Unavailable``; calls running on other threads
  finish first (the mappings and the channel are let go when the last one ends).
- Daemon restarts: every mapping names the daemon instance it came from (Hello's
  ``instance``). A call whose reply names another instance (the daemon restarted under
  a live client) drops the mappings, re-Hellos and is retried once, before any byte is
  copied; a park written into the old arena is never committed by the new daemon (the
  Commit names the instance). A grant of an instance that is gone is ``LeaseExpired``.
- ``transport``: the path negotiated at connect: "cuda_ipc" (only when forced), "shm"
  (same host, arena file mapped once) or "inline".

The data paths are strategies (``kvpark.client.transport``), chosen by name. ``auto``
picks ``shm`` when the daemon offers an arena file on this host that we can open, else
``inline``; on top of that, a call whose tensors all live on the daemon's GPU uses
``cuda_ipc`` (device-to-device into the device pool's slots). The pool is opened on the
first such call, so a process that never hands over CUDA tensors (a scheduler, a CPU
worker) never creates a CUDA context for it, and host tensors never travel host ->
device pool -> host. Forcing a transport that cannot work raises
``TransportUnavailable``; a forced ``cuda_ipc`` uses the device pool for every call.
The wire calls live in ``kvpark.client.rpc``; every gRPC failure becomes a typed
``KVParkError``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import torch

from kvpark.proto import VERSION, convert
from kvpark.proto import packed as packing
from kvpark.proto.errors import (AlreadyExists, InvalidArgument, KVParkError, LeaseExpired, TransportUnavailable,
                                 Unavailable)
from kvpark.proto.layout import TensorMeta, validate_seq_id
from kvpark.proto.types import SeqInfo
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.tiers import cuda

from .address import normalize
from .control import DEFAULT_ADDRESS, TOKEN_ENV, ControlCalls, tls_from_env
from .payload import as_tensors, byte_view, check_into
from .rpc import Rpc
from .same import Park, stored_as
from . import verify as verifying
from .tlsprobe import speaks_tls
from .uses import Uses
from .transport import (SMALL_POOL_BYTES, TRANSPORTS, CudaIpc, InstanceChanged, Restoring, Shm, Target, Transport,
                        negotiate)

TRANSPORT_NAMES = ("auto", *TRANSPORTS)
T = TypeVar("T")

__all__ = ["Client", "DEFAULT_ADDRESS", "Grant", "Restoring", "SMALL_POOL_BYTES", "TRANSPORT_NAMES"]


@dataclass(frozen=True)
class Grant:
    """Sequences a ``lookup_acquire`` acquired: their bytes inline, or a lease on host
    arena slots (until ``release_grant`` or the daemon's lease deadline). Plain data, so
    it can be handed to another process, which restores it through its own client."""

    count: int  # how many ids, from the lookup's ``skip``
    nbytes: int
    inlined: bool
    lease_id: str
    reply: bytes  # the daemon's answer, kept as it came
    # time.monotonic() (system-wide on Linux, so valid in another process on this host)
    # past which a leased grant is refused: half the lease's life, so the copy out
    # always ends well before the daemon could reuse the slots.
    usable_until: float
    # The daemon instance that leased it: only a mapping of that instance may read it.
    instance: str = ""


def _header(seq_id: str, tensors: Sequence[torch.Tensor], packed: bool = False) -> pb.ParkHeader:
    """The park header of one sequence; ``packed``: the tensor list in compact form
    (``kvpark.proto.packed``), for daemons whose Hello lists the feature."""
    validate_seq_id(seq_id)
    if packed:
        data, nbytes = packing.pack_tensors(tensors)
        return pb.ParkHeader(seq_id=seq_id, packed_tensors=data, nbytes=nbytes)
    metas = [TensorMeta.of(t) for t in tensors]
    return pb.ParkHeader(seq_id=seq_id, tensors=[convert.meta_to_pb(m) for m in metas],
                         nbytes=sum(m.nbytes for m in metas))


def _tokens_per_block(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < (1 << 32):
        raise InvalidArgument(f"tokens_per_block must be an int in [0, 2**32), got {n!r}")
    return n


class Client(ControlCalls):
    def __init__(self, address: str | None = None, *, token: str | None = None, timeout: float | None = None,
                 transport: str = "auto", tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None, verify: bool | None = None) -> None:
        if transport not in TRANSPORT_NAMES:
            raise InvalidArgument(f"transport must be one of {', '.join(TRANSPORT_NAMES)}, got {transport!r}")
        self.address = normalize(address or os.environ.get("KVPARK_ADDRESS") or DEFAULT_ADDRESS)
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.verify = verifying.from_env(verify)
        self.rpc = Rpc(self.address, timeout, token=token, **tls_from_env(tls_ca, tls_cert, tls_key))
        self._auto = transport == "auto"
        self._want = transport
        self._ipc: Transport | None = None  # auto: the device pool, opened on first use
        self._ipc_tried = False
        self._remap_lock = threading.Lock()
        self._uses = Uses()  # calls under way: close tears down after the last of them
        try:
            self.server = self.rpc.call(self.rpc.hello, pb.HelloRequest(client_version=VERSION))
            self.chunk_size = int(self.server.chunk_size) or (1 << 20)
            self._transport = negotiate(self.rpc, self.server, transport)
            self._packed = "packed" in self.server.features
        except Unavailable:
            self.rpc.close()
            if not any(self.rpc.tls) and speaks_tls(self.address):
                raise Unavailable(f"{self.address} requires TLS and this client connected in plaintext: pass "
                                  f"tls_ca=... (or set KVPARK_TLS_CA)") from None
            raise
        except BaseException:
            self.rpc.close()
            raise

    @property
    def transport(self) -> str:
        return self._transport.name

    @property
    def timeout(self) -> float | None:
        """The default deadline of every call (``deadline()`` overrides it per thread)."""
        return self.rpc.default_timeout

    def deadline(self, seconds: float | None) -> AbstractContextManager[None]:
        """Bound every call the calling thread makes inside the block, together, by ``seconds`` from now."""
        return self.rpc.deadline(seconds)

    def _for(self, devices: set[torch.device]) -> Transport:
        """The path of one call: the device pool when (auto) its tensors all live on the
        daemon's GPU, else the one negotiated at connect."""
        if not self._auto or len(devices) != 1:
            return self._transport
        (dev,) = devices
        if dev.type != "cuda":
            return self._transport
        if not self._ipc_tried:
            self._ipc_tried = True
            try:
                self._ipc = CudaIpc.open(self.rpc, self.server)
                # A device tier with no room for a restore: through the shm mapping.
                self._ipc.fallback = self._transport if isinstance(self._transport, Shm) else None
            except TransportUnavailable:
                self._ipc = None
        if not isinstance(self._ipc, CudaIpc):
            return self._transport
        return self._ipc if self._ipc.pool.device == cuda.indexed(dev) else self._transport

    def pin_arena(self, device: torch.device | str) -> bool:
        """Page-lock this process's mapping of the daemon's arena now, for copies to and
        from ``device`` (a GPU), instead of on the first call that moves GPU tensors.
        Once per process: the mapping is shared by its clients. Returns whether the
        mapping is page-locked (False without shm, CUDA, or where the runtime refuses)."""
        dev = torch.device(device)
        t = self._transport
        if dev.type != "cuda" or not cuda.cuda_available() or not isinstance(t, Shm):
            return False
        try:
            with self._uses.held(), t._uses.held():  # the transport is not closed (unmapped) under it
                t.prepare({cuda.indexed(dev)})
                return t.pinned
        except Unavailable:
            return False  # closed, or retired by a remap: the new mapping pins on first use

    def close(self) -> None:
        """End this client; calls begun after it raise ``Unavailable``. Calls running on
        other threads are not cut off: the mappings and the channel they use are let go
        when the last of them ends (an arena unmapped under a copy would kill the process)."""
        self._uses.close(self._teardown, lambda: Unavailable("client closed"))

    def _teardown(self) -> None:
        try:
            if self._ipc is not None:
                self._ipc.close()
            self._transport.close()
        finally:
            self.rpc.close()

    # ------------------------------------------------------------------ daemon instances

    def _remap(self, stale: str) -> None:
        """The daemon restarted: drop what was mapped from instance ``stale`` (the arena,
        the device pool, data-channel sockets) and open the instance answering now.
        Threads that met the same restart remap once."""
        with self._remap_lock:
            if self.server.instance != stale:
                return  # another thread has remapped already
            hello = self.rpc.call(self.rpc.hello, pb.HelloRequest(client_version=VERSION))
            fresh = negotiate(self.rpc, hello, self._want)
            old, ipc = self._transport, self._ipc
            self.server, self._transport, self._ipc, self._ipc_tried = hello, fresh, None, False
            self.chunk_size = int(hello.chunk_size) or (1 << 20)
            self._packed = "packed" in hello.features
        # Other threads may still be copying through the old mappings: each transport
        # unmaps after its last copy; a call that picks one up after this is retried on
        # the fresh one (``InstanceChanged``).
        for t in (ipc, old):
            if t is not None:
                t.close(partial(t._changed, "a call on the old mappings"))

    def _fresh(self, call: Callable[[], T]) -> T:
        """Run ``call``; when it finds this client's mappings of a daemon instance that is
        gone (refused before any byte moved), remap and run it once more. A second
        restart in between is ``Unavailable``."""
        self._uses.enter()
        try:
            try:
                r = call()
            except InstanceChanged as e:
                self._remap(e.stale)
                r = call()
        except BaseException:
            self._uses.exit()
            raise
        if isinstance(r, Restoring):
            return r.then(self._uses.exit)  # a restore holds the client open until it ends
        self._uses.exit()
        return r

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ park

    def park(self, seq_id: str, tensors: Sequence[torch.Tensor], *, priority: int = 0,
             overwrite: bool = False, pinned: bool = False, ttl_s: float | None = None,
             attrs: Mapping[str, str] | None = None, refs: Sequence[str] = (),
             new_blocks: Mapping[str, Sequence[torch.Tensor]] | None = None,
             timeout: float | None = None) -> SeqInfo:
        """Store ``tensors`` under ``seq_id``. Visible once its commit reaches the daemon.

        ``priority``: higher is demoted later. ``pinned``: never demoted below the tier it
        lands in. ``ttl_s``: dropped that many seconds after the park. ``attrs``: string
        metadata returned by ``info``. ``refs``: shared blocks the sequence starts with
        (its payload is theirs, then ``tensors``); ``new_blocks`` creates missing ones in
        the same commit (block id -> tensors); existing ones are kept (dedup).

        Without ``overwrite``, an id already parked is ``AlreadyExists`` unless what is
        parked is this very park (same layout, ``attrs``, ``priority``, ``pinned``, TTL and
        bytes: a retry after an interruption that landed once the commit had reached the
        daemon); then the stored version's ``SeqInfo`` is returned (``client/same.py``
        says how it compares).
        """
        validate_seq_id(seq_id)
        tensors = as_tensors(tensors)
        if not -(1 << 31) <= int(priority) < (1 << 31):
            raise InvalidArgument(f"priority must fit in int32, got {priority}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s}")
        header = _header(seq_id, tensors, self._packed)
        header.priority, header.overwrite, header.pinned = int(priority), overwrite, pinned
        header.ttl_s = float(ttl_s or 0.0)
        header.refs.extend(refs)
        header.attrs.update(attrs or {})
        flats: list[torch.Tensor] = []
        for bid, bts in (new_blocks or {}).items():
            bts = as_tensors(bts, f"new_blocks[{bid!r}]")
            bh = _header(bid, bts, self._packed)
            bh.shared = True
            if self.verify:
                bh.xxh3.extend(verifying.digests(bts))
            header.blocks.append(bh)
            flats.extend(byte_view(t) for t in bts)
        flats.extend(byte_view(t) for t in tensors)
        if self.verify:
            header.xxh3.extend(verifying.digests(tensors))
        with self.rpc.deadline(timeout):
            try:
                return self._park(header, flats)
            except AlreadyExists as conflict:
                if overwrite or refs or new_blocks:
                    raise
                try:
                    same = stored_as(self, seq_id, Park(tensors, attrs or {}, int(priority), pinned, ttl_s,
                                                        list(header.xxh3)))
                except KVParkError:
                    raise  # the compare's own failure (its deadline, a daemon gone): that is the answer
                except Exception:  # noqa: BLE001 - a local compare that cannot run: the conflict stands
                    same = None
                if same is None:
                    raise conflict from None
                return same

    def park_batch(self, items: Mapping[str, Sequence[torch.Tensor]], *, priority: int = 0,
                   attrs: Mapping[str, str] | None = None, timeout: float | None = None) -> int:
        """Park many independent sequences in one commit (O(1) RPCs); ids already parked
        are skipped (content-addressed stores). Returns how many bytes were new."""
        if not isinstance(items, Mapping):
            raise InvalidArgument(f"items must be a mapping of seq_id -> tensors, got {type(items).__name__}")
        if not items:
            return 0
        header = pb.ParkHeader(seq_id="", priority=int(priority))
        flats: list[torch.Tensor] = []
        for sid, ts in items.items():
            ts = as_tensors(ts, f"items[{sid!r}]")
            bh = _header(sid, ts, self._packed)
            bh.attrs.update(attrs or {})
            if self.verify:
                bh.xxh3.extend(verifying.digests(ts))
            header.blocks.append(bh)
            flats.extend(byte_view(t) for t in ts)
        with self.rpc.deadline(timeout):
            return int(self._park(header, flats).nbytes)

    def _park(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        def park() -> SeqInfo:
            t = self._transport
            if sum(f.numel() for f in flats) > t.small_limit:  # else one round trip, whatever the path
                t = self._for({f.device for f in flats if f.numel()})
            return t.park(header, flats)

        return self._fresh(park)

    # ------------------------------------------------------------------ restore

    def restore(self, seq_id: str, *, device: torch.device | str | None = None,
                into: Sequence[torch.Tensor] | None = None, layerwise: bool = False,
                timeout: float | None = None) -> list[torch.Tensor] | Restoring:
        """Return the parked tensors (on ``device``, default CPU), or fill ``into`` in place.

        With ``layerwise=True``, return an iterator of ``(index, tensor)`` that yields
        each tensor as soon as its bytes have landed, in order, so a consumer can start
        on tensor 0 (layer 0) while later ones are still arriving. On CUDA each tensor's
        copies are queued on a side stream up front and each yield waits on its own event.
        """
        validate_seq_id(seq_id)
        check_into(into)
        target = Target(device, into)
        with self.rpc.deadline(timeout):
            r = self._checked(self._fresh(lambda: self._for(target.devices()).restore([seq_id], target)))
            if layerwise:
                # Closes itself once exhausted; close() ends the lease early. Its later
                # steps (windows, the release) still end by this call's deadline.
                return self._bounded(r)
            try:  # inside the deadline: the transfer and the lease's end are part of the call
                return [t for _, t in r]
            finally:
                r.close()

    def _bounded(self, r: Restoring) -> Restoring:
        """``r``, whose every step runs under the deadline in force now (none: as is)."""
        until, rpc = self.rpc.until, self.rpc
        if until is None:
            return r

        def tensors() -> Iterator[tuple[int, torch.Tensor]]:
            while True:
                with rpc.deadline_at(until):
                    try:
                        item = next(r)
                    except StopIteration:
                        return
                yield item

        def cleanup() -> None:
            with rpc.deadline_at(until):
                r.close()

        return Restoring(r.info, tensors(), cleanup)

    def restore_many(self, seq_ids: Sequence[str], *, device: torch.device | str | None = None,
                     into: Sequence[torch.Tensor] | None = None, into_flat: torch.Tensor | None = None,
                     expect_layout: str = "", timeout: float | None = None
                     ) -> tuple[SeqInfo, list[torch.Tensor]]:
        """Restore several sequences (shared blocks included) as one payload, under one lease.

        Returns the combined ``SeqInfo`` (its ``attrs`` are the first sequence's) and
        every tensor in order. ``into_flat`` takes the whole payload into one contiguous
        caller tensor instead (then no tensors are returned). With ``expect_layout``,
        raises ``LayoutMismatch`` unless each named sequence was parked with
        ``attrs["layout"] == expect_layout``.
        """
        if isinstance(seq_ids, str) or not seq_ids:
            raise InvalidArgument("seq_ids must be a non-empty list of ids")
        for sid in seq_ids:
            validate_seq_id(sid)
        check_into(into)
        if into_flat is not None and not isinstance(into_flat, torch.Tensor):
            raise InvalidArgument(f"into_flat must be a tensor, got {type(into_flat).__name__}")
        target = Target(device, into, into_flat, expect_layout)
        with self.rpc.deadline(timeout):
            r = self._checked(self._fresh(lambda: self._for(target.devices()).restore(list(seq_ids), target)),
                              into_flat)
            try:
                return r.info, [t for _, t in r]
            finally:
                r.close()

    def present(self, seq_ids: Sequence[str], *, timeout: float | None = None) -> list[bool]:
        """For each id, whether it is parked."""
        req = pb.LookupRequest(seq_ids=list(seq_ids))
        return list(self._call(self.rpc.lookup, req, timeout).present)

    def lookup(self, seq_ids: Sequence[str], *, tokens_per_block: int = 0, timeout: float | None = None) -> int:
        """How many of ``seq_ids``, from the first, are parked (a prefix lookup).

        ``tokens_per_block``: how many tokens each id stands for, when the caller knows
        (a paged adapter's block size); the daemon then counts hit and missed tokens in
        ``kvpark_lookup_tokens_total`` besides blocks."""
        req = pb.LookupRequest(seq_ids=list(seq_ids), tokens_per_block=_tokens_per_block(tokens_per_block))
        return int(self._call(self.rpc.lookup, req, timeout).prefix)

    def lookup_acquire(self, seq_ids: Sequence[str], *, skip: int = 0, max_ids: int = 0,
                       expect_layout: str = "", tokens_per_block: int = 0,
                       timeout: float | None = None) -> tuple[int, Grant | None]:
        """A prefix lookup that also acquires ``seq_ids[skip:prefix]`` (at most ``max_ids``
        of them when > 0) in the same round trip: inline when they fit the small path,
        else under one lease on the host arena. Returns the prefix and the grant (``None``
        when nothing past ``skip`` is parked or the daemon could not acquire it)."""
        if skip < 0 or max_ids < 0:
            raise InvalidArgument(f"skip and max_ids must be >= 0, got {skip} and {max_ids}")
        acq = pb.LookupAcquire(skip=skip, max_ids=max_ids, tier="host", expect_layout=expect_layout,
                               inline_max=SMALL_POOL_BYTES)
        req = pb.LookupRequest(seq_ids=list(seq_ids), acquire=acq,
                               tokens_per_block=_tokens_per_block(tokens_per_block))
        r = self._call(self.rpc.lookup, req, timeout)
        if not r.HasField("acquired"):
            return int(r.prefix), None
        a = r.acquired
        n = min(int(r.prefix), skip + max_ids if max_ids else int(r.prefix)) - skip
        usable = time.monotonic() + (a.expires_in_s / 2 if a.expires_in_s > 0 else float("inf"))
        return int(r.prefix), Grant(n, int(a.info.nbytes), bool(a.inlined), a.lease_id, a.SerializeToString(), usable,
                                    a.instance)

    def restore_grant(self, grant: Grant, *, into_flat: torch.Tensor, release: bool = True,
                      timeout: float | None = None) -> None:
        """Copy a grant's bytes into ``into_flat``. Inline grants need no round trip;
        leased ones are copied straight out of the arena (needs the ``shm`` transport,
        else ``TransportUnavailable``; a grant past ``usable_until`` raises
        ``LeaseExpired``; either way the caller should ``release_grant``). With
        ``release=False`` the lease stays held until ``release_grant``, so the caller
        can end it off its critical path."""
        if not isinstance(into_flat, torch.Tensor):
            raise InvalidArgument(f"into_flat must be a tensor, got {type(into_flat).__name__}")
        reply = pb.AcquireResponse.FromString(grant.reply)
        target = Target(into_flat=into_flat)
        if grant.inlined:
            r = Transport._from_bytes(reply.info, reply.data, target)
        elif time.monotonic() > grant.usable_until:
            raise LeaseExpired(f"grant {grant.lease_id} is too old to read safely; restore the ids instead")
        elif isinstance(self._transport, Shm):
            with self.rpc.deadline(timeout):
                r = self._fresh(lambda: self._grant_restoring(grant, reply, target, release))
        else:
            raise TransportUnavailable(f"a leased grant needs the shm transport, this client uses {self.transport}")
        r = self._checked(r, into_flat)
        with self.rpc.deadline(timeout):  # the windows asked for while copying are part of the call
            try:
                for _ in r:
                    pass
            finally:
                r.close()

    def _checked(self, r: Restoring, into_flat: torch.Tensor | None = None) -> Restoring:
        """``r`` with every tensor checked against its park digests (under ``verify``)."""
        return verifying.checked(r, into_flat) if self.verify else r

    def _grant_restoring(self, grant: Grant, reply: pb.AcquireResponse, target: Target,
                         release: bool) -> Restoring:
        t = self._grant_mapping(grant, reply.instance)
        t.prepare(target.devices())  # page-locked before a GPU copies out of it (once per process)
        if reply.window_size:
            # Larger than the host tier: served window by window, each asked for, and the
            # lease ends with the last one.
            return t.holding(lambda: t._restore_windows(reply, target))
        # No ``usable_until``: a grant's Release is always answered. Its lease's clock
        # started before the lookup's reply was even sent, and a grant may be read in
        # another process, on another clock.
        return t.holding(lambda: t._restore_leased(reply, target, release=release))

    def _grant_mapping(self, grant: Grant, instance: str) -> Shm:
        """The arena mapping of the daemon instance that leased ``grant``: this client's,
        re-mapped first when it is of an older instance and the grant's is the one
        answering now. A grant of an instance that is gone is ``LeaseExpired``: its lease
        died with that daemon, and its slots may be anyone's."""
        t = self._transport
        if instance != t.instance and not t.restarted():
            raise LeaseExpired(f"grant {grant.lease_id[:8]}... was leased by daemon instance {instance[:8]}..., "
                               "which is gone (the daemon restarted); restore the ids instead")
        if instance != t.instance:
            self._remap(t.instance)
            t = self._transport
        if not isinstance(t, Shm) or instance != t.instance:
            raise LeaseExpired(f"grant {grant.lease_id[:8]}... was leased by daemon instance {instance[:8]}..., "
                               "not the one answering now (the daemon restarted); restore the ids instead")
        return t

    def release_grant(self, grant: Grant) -> None:
        """End a grant's lease (nothing to do for an inline one); never raises."""
        if not grant.lease_id:
            return
        try:
            with self._uses.held():
                self.rpc.release_quietly(grant.lease_id)
        except Unavailable:
            pass  # this client is closed: the lease's TTL frees it

    def _call(self, stub: Any, req: Any, timeout: float | None) -> Any:
        """One control call under ``timeout`` (``None``: the connection's default)."""
        with self._uses.held(), self.rpc.deadline(timeout):
            return self.rpc.call(stub, req)

    # ------------------------------------------------------------------ control

    def prefetch(self, seq_id: str, *, tier: str | None = None, wait: bool = False,
                 timeout: float | None = None) -> str:
        """Start promoting ``seq_id`` into ``tier`` so a later restore finds it resident.

        ``tier`` defaults to the fastest tier the daemon has ("device" when it runs a
        device tier, else "host"). With ``wait=True``, return once it is there (raises
        ``DeadlineExceeded`` after ``timeout`` seconds). Returns the tier the sequence is in now.
        """
        validate_seq_id(seq_id)
        if tier is None:
            tier = "device" if self.server.device.size else "host"
        if tier not in ("device", "host"):
            raise InvalidArgument(f"tier must be 'device' or 'host', got {tier!r}")
        if timeout is not None and timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0, got {timeout}")
        req = pb.PrefetchRequest(seq_id=seq_id, tier=tier, wait=wait, timeout_s=0.0 if timeout is None or math.isinf(timeout) else timeout)
        # The daemon enforces ``timeout``; the RPC deadline only guards against a hung daemon.
        # (``inf`` waits as long as it takes, with no RPC deadline either.)
        return self._call(self.rpc.prefetch, req, None if timeout is None else timeout + 5.0).tier
