"""The gRPC servicer: protobuf in, engine call, protobuf out. Nothing else lives here.

Primitives:
- ``handlers(engine, ServerConfig, hostname, boot_id, metrics=None, tenants=None) -> grpc.GenericRpcHandler``
  for service ``kvpark.v1.KVPark``. Every handler starts with ``eng = self.tenants.view()``:
  the engine itself on a daemon without tenants, else the calling tenant's
  ``TenantView`` (its names namespaced, its quotas; ``kvpark.daemon.tenants``). A new RPC
  does the same and is covered by auth with nothing else to do. With ``datachannel`` (a
  ``DataChannelServer``), Hello advertises it, and Reserve/Acquire with ``data_channel``
  issue its one-time tokens (inside the tenant's call: the token acts only on the
  reservation or lease that call made). With ``metrics``, parks
  and restores are counted and timed by transport (inline for the streamed and one-message RPCs, shm or cuda_ipc for
  reserve/commit and acquire), and every error by its status code.

Every reply that hands out memory (Reserve, Acquire, a Lookup's acquire, Window) and
Hello carry the engine's ``instance`` (random per start); a Commit or Window naming
another instance is refused as ``LeaseExpired``: the client wrote (or reads) the memory
of a daemon that is gone. An Acquire or Reserve first ends the leases its ``release`` names, as a
Release of each would (at most ``MAX_CARRIED_RELEASES``; more is ``INVALID_ARGUMENT``).

``Park`` and ``Restore`` use identity (de)serializers: their ``DataChunk`` messages are
framed by ``kvpark.proto.wire`` so payload bytes go from the wire straight into arena
slots, and from arena slots straight into the outgoing message. Every ``KVParkError``
becomes its gRPC status plus the class name in trailing metadata; anything else is
logged with its traceback and becomes INTERNAL. The daemon keeps running either way.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import grpc
from google.protobuf.message import DecodeError

from kvpark.proto import convert, packed
from kvpark.proto.dataframe import MAX_FRAME
from kvpark.proto.errors import (ERROR_KEY, FailedPrecondition, Internal, InvalidArgument, KVParkError,
                                 LeaseExpired, TransportUnavailable, Unavailable)
from kvpark.proto.layout import MAX_SEQ_ID_BYTES
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import decode_chunk, encode_chunk
from kvpark.tiers.disk import Manifest

from .config import ServerConfig
from .datachannel import DataChannelServer
from .engine import Engine
from .metrics import Metrics
from .model import ParkSpec, ReadHandle
from .tenants import Tenants

log = logging.getLogger("kvpark.servicer")
SERVICE = "kvpark.v1.KVPark"


def _abort(context: grpc.ServicerContext, err: KVParkError) -> None:
    context.set_trailing_metadata(((ERROR_KEY, type(err).__name__),))
    context.abort(err.code, err.message or type(err).__name__)


def _guard(context: grpc.ServicerContext, name: str, e: BaseException, metrics: Metrics | None = None) -> None:
    """Turn any failure into a typed status; the daemon must survive its own bugs."""
    if isinstance(e, DecodeError):
        e = InvalidArgument(f"malformed message: {e}")
    elif not isinstance(e, KVParkError):
        if isinstance(e, grpc.RpcError) or context.code() is not None or not isinstance(e, Exception):
            raise e
        log.exception("internal error in %s", name, exc_info=e)
        e = Internal(f"internal error in {name}: {type(e).__name__}: {e}")
    if metrics is not None:
        metrics.error(e.code.name)
    _abort(context, e)


def _typed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: "Servicer", request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except BaseException as e:  # noqa: BLE001 - sorted by _guard
            _guard(context, fn.__name__, e, self.metrics)

    return wrapper


def _typed_stream(fn: Callable[..., Iterator[bytes]]) -> Callable[..., Iterator[bytes]]:
    @functools.wraps(fn)
    def wrapper(self: "Servicer", request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            yield from fn(self, request, context)
        except BaseException as e:  # noqa: BLE001 - sorted by _guard
            _guard(context, fn.__name__, e, self.metrics)

    return wrapper


def _spec(h: pb.ParkHeader) -> ParkSpec:
    if any(b.blocks for b in h.blocks):
        raise InvalidArgument("new blocks cannot carry blocks of their own")
    return ParkSpec(
        seq_id=h.seq_id,
        tensors=packed.unpack(h.packed_tensors) if h.packed_tensors else tuple(
            convert.meta_from_pb(m) for m in h.tensors),
        nbytes=h.nbytes,
        priority=h.priority,
        overwrite=h.overwrite,
        pinned=h.pinned,
        ttl_s=h.ttl_s,
        refs=tuple(h.refs),
        shared=h.shared,
        attrs=dict(h.attrs),
        xxh3=tuple(h.xxh3),
        blocks=tuple(_spec(b) for b in h.blocks),
    )


def _disk_part(m: Manifest) -> pb.DiskPart:
    return pb.DiskPart(seq_id=m.seq_id, key_gen=m.key_gen, fingerprint=m.fingerprint, nbytes=m.nbytes,
                       block_size=m.block_size)


def _segments(segs: Sequence[tuple[int, int]]) -> list[pb.Segment]:
    return [pb.Segment(offset=o, length=n) for o, n in segs]


# Optional wire features a client may use once Hello lists them (older daemons do not).
FEATURES = ("packed", "carry_release")
_TRANSPORT = {"host": "shm", "device": "cuda_ipc"}  # the tier of a reservation or lease -> its data path
_MAX_PENDING = 100_000  # reservations timed at once; beyond it the oldest (expired, surely) are forgotten
MAX_CARRIED_RELEASES = 64  # lease ids one Acquire may end first (a client carries those still in flight)
PARK_END_GRACE_S = 0.5  # how long a park stream that ended with no commit waits to learn whether its client left


def _await_termination(context: grpc.ServicerContext, timeout: float) -> None:
    """Return once the RPC has terminated (a cancelled one terminates at once), or after
    ``timeout`` (less 0.1 s before the client's deadline): a live client that ended its
    stream early keeps its RPC open for our answer."""
    left = context.time_remaining()  # None: the client set no deadline
    if left is not None:
        # Never up to the client's deadline: it is owed the typed answer, not DEADLINE_EXCEEDED.
        timeout = min(timeout, left - 0.1)
    done = threading.Event()
    if timeout > 0 and context.add_callback(done.set):
        done.wait(timeout)


class Servicer:
    def __init__(self, engine: Engine, config: ServerConfig, hostname: str, boot_id: str,
                 metrics: Metrics | None = None, tenants: Tenants | None = None,
                 datachannel: DataChannelServer | None = None) -> None:
        self.engine = engine
        self.datachannel = datachannel
        self.tenants = tenants if tenants is not None else Tenants(engine, {})
        self.chunk_size = config.chunk_size
        self.hostname = hostname
        self.boot_id = boot_id
        self.metrics = metrics
        # Reserve -> Commit of the shm / cuda_ipc park path: lease id -> (start, transport).
        self._pending: dict[str, tuple[float, str]] = {}
        self._pending_lock = threading.Lock()

    def _parked(self, transport: str, nbytes: int, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.parked(transport, nbytes, time.perf_counter() - t0)

    def _restored(self, transport: str, nbytes: int, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.restored(transport, nbytes, time.perf_counter() - t0)

    @_typed
    def Hello(self, req: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloResponse:
        eng = self.tenants.view()
        h = eng.hello()
        return pb.HelloResponse(
            server_version=h.server_version,
            transports=list(h.transports),
            chunk_size=h.chunk_size,
            max_seq_id_len=getattr(eng, "max_seq_id_len", MAX_SEQ_ID_BYTES),
            arena=pb.ArenaInfo(
                path=h.arena_path, size=h.arena_size, slot_size=h.slot_size,
                hostname=self.hostname, boot_id=self.boot_id,
            ),
            lease_ttl_s=h.lease_ttl_s,
            device=pb.DeviceInfo(device=h.device, size=h.device_size, ipc_handle=h.ipc_handle, uuid=h.device_uuid),
            features=list(FEATURES),
            instance=h.instance,
            disk=pb.DiskInfo(path=h.disk_path) if h.disk_path else None,
            data_channel=None if self.datachannel is None else pb.DataChannelInfo(
                address=self.datachannel.address, tls=self.datachannel.tls, max_frame=MAX_FRAME),
        )

    @_typed
    def Park(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> pb.SeqInfo:
        eng = self.tenants.view()
        lease: str | None = None
        ended = False  # the stream ended with no commit
        t0 = time.perf_counter()
        try:
            first = next(requests, None)
            if first is None:
                raise InvalidArgument("empty park stream: expected a header, chunks and a commit")
            head = None if decode_chunk(first) is not None else pb.ParkRequest.FromString(first)
            if head is None or head.WhichOneof("kind") != "header":
                raise InvalidArgument("park stream must start with a header message")
            lease = eng.reserve(_spec(head.header), inline=True).lease_id
            for raw in requests:
                chunk = decode_chunk(raw)
                if chunk is not None:
                    eng.write_chunk(lease, chunk[0], chunk[1])
                    continue
                msg = pb.ParkRequest.FromString(raw)
                kind = msg.WhichOneof("kind")
                if kind != "commit":
                    raise InvalidArgument(f"unexpected {kind or 'empty'} message inside a park stream")
                lease_id, lease = lease, None
                info = eng.commit(lease_id, expect_nbytes=msg.commit.nbytes)
                self._parked("inline", info.nbytes, t0)
                return convert.info_to_pb(info)
            ended = True
            raise InvalidArgument("park stream ended before its commit message; nothing was stored")
        finally:
            if lease is not None:
                eng.release(lease)
                if ended:
                    # gRPC may end the request iterator of a client that went away before it
                    # records the cancellation (two completion events race): wait briefly for
                    # that record, so the log tells a client that left from one that ended its
                    # stream early (who is then answered INVALID_ARGUMENT).
                    _await_termination(context, PARK_END_GRACE_S)
                if not context.is_active():
                    # Not an error of ours or of the lease: a Ctrl-C, a killed worker.
                    log.info("a park was abandoned mid-stream: the client went away; nothing was stored")

    @_typed_stream
    def Restore(self, req: pb.RestoreRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        eng = self.tenants.view()
        ids = list(req.seq_ids) or req.seq_id
        t0 = time.perf_counter()
        handle = eng.acquire(ids, stream=True, expect_layout=req.expect_layout)
        try:
            yield pb.RestoreResponse(header=pb.RestoreHeader(info=convert.info_to_pb(handle.info))).SerializeToString()
            for offset, views in eng.iter_chunks(handle, self.chunk_size):
                if not context.is_active():
                    return
                # Copied out under the lease's copy lock, yielded after: a lease ended
                # while the stream waits is a typed error, never bytes of freed slots.
                with self.engine.leases.copying(handle.lease):
                    msg = encode_chunk(offset, *views)
                yield msg
            self._restored("inline", handle.info.nbytes, t0)
        finally:
            if handle.lease_id:
                eng.release(handle.lease_id)

    @_typed
    def ParkSmall(self, req: pb.ParkSmallRequest, context: grpc.ServicerContext) -> pb.SeqInfo:
        eng = self.tenants.view()
        t0 = time.perf_counter()
        lease_id = eng.reserve(_spec(req.header), inline=True).lease_id
        committing = False
        try:
            if req.data:
                eng.write_chunk(lease_id, 0, memoryview(req.data))
            committing = True  # commit frees the slots itself when it fails
            info = eng.commit(lease_id, expect_nbytes=len(req.data))
            self._parked("inline", info.nbytes, t0)
            return convert.info_to_pb(info)
        finally:
            if not committing:
                eng.release(lease_id)

    @_typed
    def Get(self, req: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetResponse:
        eng = self.tenants.view()
        ids = list(req.seq_ids) or req.seq_id
        t0 = time.perf_counter()
        handle = eng.acquire(ids, stream=True, expect_layout=req.expect_layout)
        try:
            info = convert.info_to_pb(handle.info)
            # The client's limit, never above one message's worth (the daemon builds it in memory).
            if handle.info.nbytes > min(req.max_bytes, self.chunk_size):
                return pb.GetResponse(info=info, too_large=True)
            out = pb.GetResponse(info=info, data=self._join(eng, handle))
            self._restored("inline", handle.info.nbytes, t0)
            return out
        finally:
            if handle.lease_id:
                eng.release(handle.lease_id)

    def _join(self, eng: Any, handle: ReadHandle) -> bytes:
        with self.engine.leases.copying(handle.lease):
            return b"".join(v for _, views in eng.iter_chunks(handle, 1 << 30) for v in views)

    def _pend(self, lease_id: str, t0: float, transport: str) -> None:
        if self.metrics is not None:
            with self._pending_lock:
                if len(self._pending) >= _MAX_PENDING:
                    self._pending.pop(next(iter(self._pending)))
                self._pending[lease_id] = (t0, transport)

    def _channel(self) -> DataChannelServer:
        if self.datachannel is None:
            raise FailedPrecondition("this daemon has no data channel (server.data_channel = false)")
        return self.datachannel

    @_typed
    def Reserve(self, req: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        eng = self.tenants.view()
        self._carried(eng, req.release)
        t0 = time.perf_counter()
        if req.data_channel:
            # The bytes come through this process, as an inline park's: it lands where an
            # inline park would (the park tier, else host), filled by the data channel.
            dc, spec = self._channel(), _spec(req.header)
            r = eng.reserve(spec, inline=True)
            if r.window_size:
                # Larger than its memory tier: parked window by window, which the gRPC
                # stream does; the client falls back to it.
                eng.release(r.lease_id)
                raise TransportUnavailable("a windowed park goes over the gRPC stream, not the data channel")
            self.engine.leases.require_all(r.lease_id)  # its commit needs every byte, counted on the lease
            self._pend(r.lease_id, t0, "inline")
            return pb.ReserveResponse(lease_id=r.lease_id, expires_in_s=r.expires_in_s,
                                      token=dc.tickets.issue_put(r.lease_id, spec.total, eng),
                                      instance=self.engine.instance)
        tier = req.tier or "host"
        r = eng.reserve(_spec(req.header), tier=tier)
        self._pend(r.lease_id, t0, _TRANSPORT.get(tier, tier))
        return pb.ReserveResponse(lease_id=r.lease_id, segments=_segments(r.segments), expires_in_s=r.expires_in_s,
                                  window_size=r.window_size, instance=self.engine.instance)

    @_typed
    def Window(self, req: pb.WindowRequest, context: grpc.ServicerContext) -> pb.WindowResponse:
        eng = self.tenants.view()
        self._same_instance(req.lease_id, req.instance)
        return pb.WindowResponse(segments=_segments(eng.window(req.lease_id, req.index)),
                                 instance=self.engine.instance)

    def _same_instance(self, lease_id: str, instance: str) -> None:
        """A lease another start of the daemon issued is unknown here, whatever its id:
        the bytes a client wrote for it are in that daemon's memory, not in ours."""
        if instance and instance != self.engine.instance:
            raise LeaseExpired(f"lease {lease_id[:8]}... was issued by daemon instance {instance[:8]}..., this is "
                               f"instance {self.engine.instance[:8]}... (the daemon restarted)")

    @_typed
    def Commit(self, req: pb.CommitRequest, context: grpc.ServicerContext) -> pb.SeqInfo:
        eng = self.tenants.view()
        self._same_instance(req.lease_id, req.instance)
        # A data-channel reservation publishes only once every byte has arrived on it.
        info = eng.commit(req.lease_id, expect_nbytes=self.engine.leases.required(req.lease_id))
        with self._pending_lock:
            started = self._pending.pop(req.lease_id, None)
        if started is not None:
            self._parked(started[1], info.nbytes, started[0])
        return convert.info_to_pb(info, packed=req.packed)

    @_typed
    def Acquire(self, req: pb.AcquireRequest, context: grpc.ServicerContext) -> pb.AcquireResponse:
        eng = self.tenants.view()
        self._carried(eng, req.release)
        return self._acquire(eng, list(req.seq_ids) or req.seq_id, req.tier, req.expect_layout,
                             req.inline_max, data_channel=req.data_channel, packed=req.packed, disk=req.disk)

    def _acquire(self, eng: Any, ids: list[str] | str, tier: str, expect_layout: str, inline_max: int, *,
                 data_channel: bool = False, packed: bool = False, disk: bool = False) -> pb.AcquireResponse:
        small = min(inline_max, self.chunk_size)
        t0 = time.perf_counter()
        need: str | None = tier or "host"
        if data_channel:
            self._channel()
            need = None  # served as an inline restore is: from its fastest copy, or from disk
        h = eng.acquire(ids, need=need, expect_layout=expect_layout, inline_max=small,
                        disk=disk and not data_channel)
        if h.info.nbytes <= small:
            # Small: one round trip, bytes in the reply, no lease left behind.
            try:
                out = pb.AcquireResponse(info=convert.info_to_pb(h.info), data=self._join(eng, h), inlined=True,
                                         instance=self.engine.instance)
                self._restored("inline", h.info.nbytes, t0)
                return out
            finally:
                if h.lease_id:
                    eng.release(h.lease_id)
        if h.direct:
            self._restored("disk", h.info.nbytes, t0)
            out = pb.AcquireResponse(info=convert.info_to_pb(h.info, packed=packed), instance=self.engine.instance,
                                     disk_parts=[_disk_part(p.manifest) for p in h.parts])
            self._promote_later(eng, [ids] if isinstance(ids, str) else ids)
            return out
        if data_channel:
            try:
                token = self._channel().tickets.issue_get(h, eng)
            except BaseException:
                if h.lease_id:
                    eng.release(h.lease_id)
                raise
            self._restored("inline", h.info.nbytes, t0)
            return pb.AcquireResponse(lease_id=h.lease_id, info=convert.info_to_pb(h.info, packed=packed),
                                      expires_in_s=self.engine.config.leases.ttl_s, token=token,
                                      instance=self.engine.instance)
        g = eng.grant(h)
        # Counted when the bytes are leased to the reader; its copy out is its own time.
        assert need is not None
        self._restored(_TRANSPORT.get(need, need), g.info.nbytes, t0)
        return pb.AcquireResponse(lease_id=g.lease_id, info=convert.info_to_pb(g.info, packed=packed),
                                  segments=_segments(g.segments), expires_in_s=g.expires_in_s,
                                  window_size=g.window_size, instance=self.engine.instance)

    def _promote_later(self, eng: Any, ids: list[str]) -> None:
        """After a disk grant: what ``policy.promote_on_restore`` asks for (a copy in
        memory for the next read) happens in the background, off the read's path, once
        reads and parks pause (``idle_work.py``: run at once, it competed with the
        client's own read of the same records); a sequence gone or with no room by then
        simply stays on disk."""
        tier = self.engine.restore_to
        if tier is None:
            return

        def promote() -> None:
            for sid in ids:
                try:
                    eng.prefetch(sid, tier)
                except Unavailable:
                    return  # stopping (a prefetch checks that first): the tiers close next
                except KVParkError as e:
                    log.debug("promotion after a disk grant of %r: %s", sid, e)

        self.engine.when_idle(promote, weight=len(ids))

    @_typed
    def Release(self, req: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self._release(self.tenants.view(), req.lease_id))

    def _carried(self, eng: Any, lease_ids: Sequence[str]) -> None:
        """Leases a client is done with, named by its next Acquire or Reserve: ended
        before that call's own work, as a Release of each sent first would have (a
        tenant's view skips another tenant's, as Release does)."""
        if len(lease_ids) > MAX_CARRIED_RELEASES:
            raise InvalidArgument(f"a call carries at most {MAX_CARRIED_RELEASES} releases, got {len(lease_ids)}")
        for lease_id in lease_ids:
            self._release(eng, lease_id)

    def _release(self, eng: Any, lease_id: str) -> bool:
        with self._pending_lock:
            self._pending.pop(lease_id, None)  # a park the client gave up
        return bool(eng.release(lease_id))

    @_typed
    def Prefetch(self, req: pb.PrefetchRequest, context: grpc.ServicerContext) -> pb.PrefetchResponse:
        eng = self.tenants.view()
        if req.timeout_s < 0:
            raise InvalidArgument(f"timeout_s must be >= 0, got {req.timeout_s}")
        tier = eng.prefetch(req.seq_id, req.tier or "device", wait=req.wait, timeout=req.timeout_s or None)
        return pb.PrefetchResponse(tier=tier)

    @_typed
    def Lookup(self, req: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        eng = self.tenants.view()
        ids = list(req.seq_ids)
        present = eng.present(ids)
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        if self.metrics is not None:  # the hit rate a prefix cache is judged by
            self.metrics.looked_up(prefix, len(ids) - prefix, req.tokens_per_block)
        out = pb.LookupResponse(prefix=prefix, present=present)
        if req.HasField("acquire") and prefix > req.acquire.skip:
            a = req.acquire
            end = prefix if not a.max_ids else min(prefix, a.skip + a.max_ids)
            try:
                # Only what is in memory: a lookup answers at once; a read from disk
                # belongs to the caller's own acquire, under its longer deadline.
                if eng.in_memory(ids[a.skip : end]):
                    out.acquired.CopyFrom(self._acquire(eng, ids[a.skip : end], a.tier, a.expect_layout,
                                                        a.inline_max))
            except KVParkError as e:
                # The lookup still answers; the caller acquires (and meets the error) itself.
                log.debug("lookup's acquire of %d ids failed: %s", end - a.skip, e)
        return out

    @_typed
    def Drop(self, req: pb.DropRequest, context: grpc.ServicerContext) -> pb.DropResponse:
        eng = self.tenants.view()
        return pb.DropResponse(dropped=eng.drop(req.seq_id))

    @_typed
    def Info(self, req: pb.InfoRequest, context: grpc.ServicerContext) -> pb.SeqInfo:
        eng = self.tenants.view()
        return convert.info_to_pb(eng.info(req.seq_id))

    @_typed
    def List(self, req: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        eng = self.tenants.view()
        return pb.ListResponse(sequences=[convert.info_to_pb(i) for i in eng.list()])

    @_typed
    def Stat(self, req: pb.StatRequest, context: grpc.ServicerContext) -> pb.StatResponse:
        eng = self.tenants.view()
        return convert.stat_to_pb(eng.stat())

    @_typed
    def Pin(self, req: pb.PinRequest, context: grpc.ServicerContext) -> pb.SeqInfo:
        eng = self.tenants.view()
        return convert.info_to_pb(eng.pin(req.seq_id, req.pinned))

    @_typed
    def Flush(self, req: pb.FlushRequest, context: grpc.ServicerContext) -> pb.FlushResponse:
        eng = self.tenants.view()
        return pb.FlushResponse(written=eng.flush())


def _identity(b: bytes) -> bytes:
    return b


def handlers(engine: Engine, config: ServerConfig, hostname: str, boot_id: str,
             metrics: Metrics | None = None, tenants: Tenants | None = None,
             datachannel: DataChannelServer | None = None) -> grpc.GenericRpcHandler:
    s = Servicer(engine, config, hostname, boot_id, metrics, tenants, datachannel)

    def parsed(fn: Callable[..., Any], req_cls: Any) -> Callable[[bytes, grpc.ServicerContext], Any]:
        # Parsed here, not by gRPC's request_deserializer: a message that fails to parse
        # there becomes an untyped INTERNAL; here it is INVALID_ARGUMENT like any bad input.
        def handle(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                req = req_cls.FromString(raw)
            except DecodeError as e:
                _guard(context, fn.__name__, e, metrics)
            return fn(req, context)

        return handle

    def unary(fn: Callable[..., Any], req_cls: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            parsed(fn, req_cls), request_deserializer=_identity, response_serializer=lambda m: m.SerializeToString()
        )

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Hello": unary(s.Hello, pb.HelloRequest),
            "Park": grpc.stream_unary_rpc_method_handler(
                s.Park, request_deserializer=_identity, response_serializer=lambda m: m.SerializeToString()
            ),
            "Restore": grpc.unary_stream_rpc_method_handler(
                parsed(s.Restore, pb.RestoreRequest), request_deserializer=_identity, response_serializer=_identity
            ),
            "ParkSmall": unary(s.ParkSmall, pb.ParkSmallRequest),
            "Get": unary(s.Get, pb.GetRequest),
            "Reserve": unary(s.Reserve, pb.ReserveRequest),
            "Commit": unary(s.Commit, pb.CommitRequest),
            "Acquire": unary(s.Acquire, pb.AcquireRequest),
            "Release": unary(s.Release, pb.ReleaseRequest),
            "Window": unary(s.Window, pb.WindowRequest),
            "Prefetch": unary(s.Prefetch, pb.PrefetchRequest),
            "Lookup": unary(s.Lookup, pb.LookupRequest),
            "Drop": unary(s.Drop, pb.DropRequest),
            "Info": unary(s.Info, pb.InfoRequest),
            "List": unary(s.List, pb.ListRequest),
            "Stat": unary(s.Stat, pb.StatRequest),
            "Pin": unary(s.Pin, pb.PinRequest),
            "Flush": unary(s.Flush, pb.FlushRequest),
        },
    )
