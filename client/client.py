"""``Client``: the connection to one daemon and the data path it negotiated.

Primitives:
- ``Client(address=None, *, timeout=None, transport="auto")``: connects (Hello) at once.
- ``park(seq_id, tensors, *, priority=0, overwrite=False) -> SeqInfo``.
- ``restore(seq_id, *, device=None, into=None) -> list[torch.Tensor]``.
- ``drop(seq_id) -> bool``, ``info(seq_id) -> SeqInfo``, ``list()``, ``stat()``.
- ``prefetch(seq_id, *, tier="device", wait=False, timeout=None) -> str``.
- ``transport``: the path negotiated at connect: "cuda_ipc" (only when forced), "shm"
  (same host, arena file mapped once) or "inline".

``auto`` picks ``shm`` when the daemon offers an arena file on this host that we can
open, else ``inline``; on top of that, a call whose tensors all live on the daemon's GPU
uses ``cuda_ipc`` (device-to-device into the device pool's slots). The pool is opened on
the first such call, so a process that never hands over CUDA tensors (a scheduler, a
CPU worker) never creates a CUDA context for it, and host tensors never travel
host -> device pool -> host. Forcing a transport that cannot work raises
``TransportUnavailable``; a forced ``cuda_ipc`` uses the device pool for every call.
Every gRPC failure becomes a typed ``KVParkError``.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Iterator, Mapping, Sequence

import grpc
import numpy as np
import torch

from kvpark.proto import GRPC_OPTIONS, VERSION, convert
from kvpark.proto.errors import (
    ERROR_KEY,
    DataLoss,
    InvalidArgument,
    KVParkError,
    ResourceExhausted,
    TransportUnavailable,
    from_code,
)
from kvpark.proto.layout import TensorMeta, validate_seq_id
from kvpark.proto.types import SeqInfo, Stat
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import decode_chunk, encode_chunk, regroup
from kvpark.tiers import copy as copier
from kvpark.tiers.shm import SharedArena

from .payload import Outputs, byte_view, pieces

DEFAULT_ADDRESS = "127.0.0.1:50551"
# Payloads up to this size travel inside one unary RPC even on shm/cuda_ipc: one round
# trip beats two (reserve+commit, acquire+release) when the bytes are few
# (bench/transport.py: a unary round trip costs about as much as copying 200 KiB through gRPC).
SMALL_POOL_BYTES = 128 << 10
TRANSPORTS = ("auto", "shm", "cuda_ipc", "inline")
_SVC = "/kvpark.v1.KVPark/"


def _translate(e: grpc.RpcError) -> KVParkError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    name = None
    if hasattr(e, "trailing_metadata"):
        for k, v in e.trailing_metadata() or ():
            if k == ERROR_KEY:
                name = v
    return from_code(code, details or "", name)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _header(seq_id: str, tensors: Sequence[torch.Tensor]) -> pb.ParkHeader:
    validate_seq_id(seq_id)
    metas = [TensorMeta.of(t) for t in tensors]
    return pb.ParkHeader(seq_id=seq_id, tensors=[convert.meta_to_pb(m) for m in metas],
                         nbytes=sum(m.nbytes for m in metas))


def _set_ids(req: Any, ids: list[str]) -> None:
    if len(ids) == 1:
        req.seq_id = ids[0]
    else:
        req.seq_ids.extend(ids)


def _chunks(it: Iterator[bytes], nbytes: int, what: str) -> Iterator[np.ndarray]:
    """Payload pieces of a Restore stream, checked to arrive in order and add up exactly."""
    pos = 0
    for raw in it:
        chunk = decode_chunk(raw)
        if chunk is None:
            raise DataLoss(f"restore of {what!r}: unexpected non-chunk message")
        offset, data = chunk
        if offset != pos or pos + len(data) > nbytes:
            raise DataLoss(f"restore of {what!r}: chunk at {offset} (+{len(data)}), expected {pos}")
        pos += len(data)
        yield np.frombuffer(data, dtype=np.uint8)
    if pos != nbytes:
        raise DataLoss(f"restore of {what!r}: stream ended after {pos} of {nbytes} bytes")


class _Layerwise:
    """The iterator ``restore(..., layerwise=True)`` returns; ``close()`` ends the lease early."""

    def __init__(self, gen: Iterator[tuple[int, torch.Tensor]]) -> None:
        self._gen = gen

    def __iter__(self) -> "_Layerwise":
        return self

    def __next__(self) -> tuple[int, torch.Tensor]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()  # type: ignore[attr-defined]


def _ser(m: Any) -> bytes:
    return m.SerializeToString()


def _identity(b: bytes) -> bytes:
    return b


class Client:
    def __init__(self, address: str | None = None, *, timeout: float | None = None,
                 transport: str = "auto") -> None:
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.address = address or os.environ.get("KVPARK_ADDRESS") or DEFAULT_ADDRESS
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.address, options=GRPC_OPTIONS)
        self._arena: SharedArena | None = None
        self._pool: torch.Tensor | None = None  # the daemon's device pool, via CUDA IPC
        self._ipc_why: str | None = None  # why auto cannot use cuda_ipc (None: not tried yet)
        self._pinned = False
        self._pin_tried = False
        ch = self._channel
        u = lambda name, resp: ch.unary_unary(_SVC + name, request_serializer=_ser,  # noqa: E731
                                               response_deserializer=resp.FromString)
        self._hello = u("Hello", pb.HelloResponse)
        self._reserve = u("Reserve", pb.ReserveResponse)
        self._commit = u("Commit", pb.SeqInfo)
        self._acquire = u("Acquire", pb.AcquireResponse)
        self._release = u("Release", pb.ReleaseResponse)
        self._prefetch = u("Prefetch", pb.PrefetchResponse)
        self._lookup = u("Lookup", pb.LookupResponse)
        self._park_small_rpc = u("ParkSmall", pb.SeqInfo)
        self._get = u("Get", pb.GetResponse)
        self._drop = u("Drop", pb.DropResponse)
        self._info = u("Info", pb.SeqInfo)
        self._list = u("List", pb.ListResponse)
        self._stat = u("Stat", pb.StatResponse)
        self._park = ch.stream_unary(_SVC + "Park", request_serializer=_identity,
                                     response_deserializer=pb.SeqInfo.FromString)
        self._restore = ch.unary_stream(_SVC + "Restore", request_serializer=_ser,
                                        response_deserializer=_identity)
        try:
            self.server = self._call(self._hello, pb.HelloRequest(client_version=VERSION))
            self.chunk_size = int(self.server.chunk_size) or (1 << 20)
            self.transport = self._negotiate(transport)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing

    def _call(self, stub: Callable[..., Any], req: Any, timeout: float | None = None) -> Any:
        try:
            return stub(req, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise _translate(e) from None

    def _negotiate(self, want: str) -> str:
        offered = set(self.server.transports)
        self._auto = want == "auto"
        if want == "cuda_ipc":
            why = self._try_cuda_ipc(offered)
            if why is None:
                return "cuda_ipc"
            raise TransportUnavailable(f"transport 'cuda_ipc' is not possible: {why}")
        if want in ("auto", "shm"):
            why = self._try_shm(offered)
            if why is None:
                return "shm"
            if want == "shm":
                raise TransportUnavailable(f"transport 'shm' is not possible: {why}")
        return "inline"

    def _try_cuda_ipc(self, offered: set[str]) -> str | None:
        d = self.server.device
        if "cuda_ipc" not in offered or not d.ipc_handle:
            return "the daemon has no CUDA device tier"
        device = copier.local_device_for(d.uuid)
        if device is None:
            return f"this process cannot see the daemon's GPU ({d.device}, {d.uuid})"
        try:
            self._pool = copier.open_ipc(d.ipc_handle, d.size, device)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            return f"cannot open the device pool's IPC handle: {e}"
        return None

    def _device_pool(self, devices: set[torch.device]) -> torch.Tensor | None:
        """The daemon's device pool when this call's tensors all live on its GPU (auto),
        or always when cuda_ipc was forced; else None. Opened on first use."""
        if self.transport == "cuda_ipc":
            return self._pool
        if not self._auto or len(devices) != 1:
            return None
        (dev,) = devices
        if dev.type != "cuda":
            return None
        if self._ipc_why is None:
            why = self._try_cuda_ipc(set(self.server.transports))
            self._ipc_why = why or ""
        if self._pool is None:
            return None
        local = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        return self._pool if self._pool.device == local else None

    def _paths(self, devices: set[torch.device]) -> tuple[torch.Tensor | None, str]:
        """Where this call's bytes go: (device pool, "device"), (arena, "host") or (None, "inline")."""
        pool = self._device_pool(devices)
        if pool is not None:
            return pool, "device"
        if self._arena is None:
            return None, "inline"
        if not self._pin_tried and any(d.type == "cuda" for d in devices):
            # Page-lock the mapping once, on the first call that moves GPU tensors
            # through it, so D2H/H2D go straight in and out (a CPU-only user of this
            # client never creates a CUDA context for it).
            self._pin_tried = True
            self._pinned = copier.pin_host(self._arena.tensor) is not None
        return self._arena.tensor, "host"

    def _try_shm(self, offered: set[str]) -> str | None:
        if self._arena is not None:
            return None
        a = self.server.arena
        if "shm" not in offered or not a.path:
            return "the daemon has no shared-memory arena"
        if a.hostname != socket.gethostname() or (a.boot_id and a.boot_id != _boot_id()):
            return f"the daemon runs on another host ({a.hostname})"
        try:
            self._arena = SharedArena.open(a.path, a.size)
        except OSError as e:
            return f"cannot map arena {a.path}: {e}"
        return None

    def close(self) -> None:
        if self._arena is not None:
            if self._pinned:
                copier.unpin_host(self._arena.tensor)
            self._arena.close()
            self._arena = None
        self._pool = None
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ park

    def park(self, seq_id: str, tensors: Sequence[torch.Tensor], *, priority: int = 0,
             overwrite: bool = False, pinned: bool = False, ttl_s: float | None = None,
             attrs: Mapping[str, str] | None = None, refs: Sequence[str] = (),
             new_blocks: Mapping[str, Sequence[torch.Tensor]] | None = None) -> SeqInfo:
        """Store ``tensors`` under ``seq_id``. Visible to others only once this returns.

        ``priority``: higher is demoted later. ``pinned``: never demoted below the tier it
        lands in. ``ttl_s``: dropped that many seconds after the park. ``attrs``: string
        metadata returned by ``info``. ``refs``: shared blocks the sequence starts with
        (its payload is theirs, then ``tensors``); ``new_blocks`` creates missing ones in
        the same commit (block id -> tensors); existing ones are kept (dedup).
        """
        validate_seq_id(seq_id)
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            raise InvalidArgument("tensors must be a list or tuple of torch tensors")
        if not -(1 << 31) <= int(priority) < (1 << 31):
            raise InvalidArgument(f"priority must fit in int32, got {priority}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s}")
        header = _header(seq_id, tensors)
        header.priority, header.overwrite, header.pinned = int(priority), overwrite, pinned
        header.ttl_s = float(ttl_s or 0.0)
        header.refs.extend(refs)
        header.attrs.update(attrs or {})
        flats: list[torch.Tensor] = []
        for bid, bts in (new_blocks or {}).items():
            bh = _header(bid, bts)
            bh.shared = True
            header.blocks.append(bh)
            flats.extend(byte_view(t) for t in bts)
        flats.extend(byte_view(t) for t in tensors)
        return self._park_any(header, flats)

    def park_batch(self, items: Mapping[str, Sequence[torch.Tensor]], *, priority: int = 0,
                   attrs: Mapping[str, str] | None = None) -> int:
        """Park many independent sequences in one commit (O(1) RPCs); ids already parked
        are skipped (content-addressed stores). Returns how many bytes were new."""
        if not items:
            return 0
        header = pb.ParkHeader(seq_id="", priority=int(priority))
        flats: list[torch.Tensor] = []
        for sid, ts in items.items():
            if isinstance(ts, torch.Tensor) or not isinstance(ts, (list, tuple)):
                raise InvalidArgument(f"{sid!r}: tensors must be a list or tuple of torch tensors")
            bh = _header(sid, ts)
            bh.attrs.update(attrs or {})
            header.blocks.append(bh)
            flats.extend(byte_view(t) for t in ts)
        return int(self._park_any(header, flats).nbytes)

    def _park_any(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        total = sum(f.numel() for f in flats)
        if total <= (self.chunk_size if self.transport == "inline" else SMALL_POOL_BYTES):
            return self._park_small(header, flats)
        pool, tier = self._paths({f.device for f in flats if f.numel()})
        if pool is None:
            return self._park_inline(header, flats)
        return self._park_pool(header, flats, pool, tier)

    def _park_small(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        data = b"".join(memoryview(f.cpu().numpy()) for f in flats if f.numel())
        return convert.info_from_pb(self._call(self._park_small_rpc, pb.ParkSmallRequest(header=header, data=data)))

    def _park_pool(self, header: pb.ParkHeader, flats: list[torch.Tensor], pool: torch.Tensor,
                   tier: str) -> SeqInfo:
        """shm / cuda_ipc: reserve slots, copy straight into the daemon's memory, commit."""
        r = self._call(self._reserve, pb.ReserveRequest(header=header, tier=tier))
        devices = {pool.device, *(f.device for f in flats)}
        try:
            segs = [(s.offset, s.length) for s in r.segments]
            for si, so, di, do, n in pieces([f.numel() for f in flats], [n for _, n in segs]):
                base = segs[di][0] + do
                pool[base : base + n].copy_(flats[si][so : so + n])
            # The daemon reads the slots right after Commit: every copy into them has
            # landed by then. Events on the streams that ran them, not a device-wide
            # synchronize that would also wait for unrelated queued work.
            copier.Fence(*devices).wait()
        except BaseException:
            # Copies already queued may still be writing the slots: they land before the
            # lease (and with it the slots) goes back to the daemon for reuse.
            try:
                copier.Fence(*devices).wait()
            except Exception:  # noqa: BLE001 - a broken context runs no more copies
                pass
            self._abort_quietly(r.lease_id)
            raise
        return convert.info_from_pb(self._call(self._commit, pb.CommitRequest(lease_id=r.lease_id)))

    def _abort_quietly(self, lease_id: str) -> None:
        if not lease_id:
            return
        try:
            self._call(self._release, pb.ReleaseRequest(lease_id=lease_id))
        except KVParkError:
            pass  # the lease TTL frees it anyway

    def _park_inline(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        # One D2H per device tensor; CPU tensors are framed straight from their memory.
        views = [memoryview(f.cpu().numpy()) for f in flats if f.numel()]
        size = self.chunk_size
        total = sum(len(v) for v in views)

        def stream() -> Iterator[bytes]:
            yield pb.ParkRequest(header=header).SerializeToString()
            for off, vs in regroup(views, size):
                yield encode_chunk(off, *vs)
            yield pb.ParkRequest(commit=pb.ParkCommit(nbytes=total)).SerializeToString()

        try:
            return convert.info_from_pb(self._park(stream(), timeout=self.timeout))
        except grpc.RpcError as e:
            raise _translate(e) from None

    # ------------------------------------------------------------------ restore

    def restore(self, seq_id: str, *, device: torch.device | str | None = None,
                into: Sequence[torch.Tensor] | None = None, layerwise: bool = False
                ) -> list[torch.Tensor] | Iterator[tuple[int, torch.Tensor]]:
        """Return the parked tensors (on ``device``, default CPU), or fill ``into`` in place.

        With ``layerwise=True``, return an iterator of ``(index, tensor)`` that yields
        each tensor as soon as its bytes have landed, in order, so a consumer can start
        on tensor 0 (layer 0) while later ones are still arriving. On CUDA each tensor's
        copies are queued on a side stream up front and each yield waits on its own event.
        """
        validate_seq_id(seq_id)
        gen = self._restore_gen([seq_id], device, into, "")
        info = next(gen)
        assert isinstance(info, SeqInfo)
        if layerwise:
            return _Layerwise(gen)  # type: ignore[arg-type]
        return [t for _, t in gen]  # type: ignore[misc]

    def restore_many(self, seq_ids: Sequence[str], *, device: torch.device | str | None = None,
                     into: Sequence[torch.Tensor] | None = None, into_flat: torch.Tensor | None = None,
                     expect_layout: str = "") -> tuple[SeqInfo, list[torch.Tensor]]:
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
        gen = self._restore_gen(list(seq_ids), device, into, expect_layout, into_flat)
        info = next(gen)
        assert isinstance(info, SeqInfo)
        return info, [t for _, t in gen]  # type: ignore[misc]

    def _restore_gen(self, ids: list[str], device: Any, into: Sequence[torch.Tensor] | None,
                     expect_layout: str, into_flat: torch.Tensor | None = None
                     ) -> Iterator[SeqInfo | tuple[int, torch.Tensor]]:
        """First yields the SeqInfo, then ``(index, tensor)`` as each tensor is complete."""
        if into_flat is not None:
            targets = {into_flat.device}
        elif into is not None:
            targets = {t.device for t in into if isinstance(t, torch.Tensor)}
        else:
            targets = {torch.device(device) if device is not None else torch.device("cpu")}
        pool, tier = self._paths(targets)
        if pool is not None:
            req = pb.AcquireRequest(tier=tier, expect_layout=expect_layout, inline_max=SMALL_POOL_BYTES)
            _set_ids(req, ids)
            try:
                r = self._call(self._acquire, req)
            except ResourceExhausted:
                # No room to stage it in that tier (all leased or pinned): stream it instead.
                pass
            else:
                if r.inlined:
                    return self._from_bytes(r.info, r.data, device, into, into_flat)
                return self._restore_pool(r, pool, device, into, into_flat)
        else:
            g = pb.GetRequest(expect_layout=expect_layout, max_bytes=self.chunk_size)
            _set_ids(g, ids)
            got = self._call(self._get, g)
            if not got.too_large:
                return self._from_bytes(got.info, got.data, device, into, into_flat)
        return self._restore_inline(ids, device, into, expect_layout, into_flat)

    @staticmethod
    def _from_bytes(info_pb: pb.SeqInfo, data: bytes, device: Any, into: Sequence[torch.Tensor] | None,
                    into_flat: torch.Tensor | None) -> Iterator[SeqInfo | tuple[int, torch.Tensor]]:
        info = convert.info_from_pb(info_pb)
        if len(data) != info.nbytes:
            raise DataLoss(f"restore of {info.seq_id!r}: {len(data)} bytes for a {info.nbytes}-byte payload")
        out = Outputs(info.tensors, device, into, staging_device="cpu", into_flat=into_flat)
        src = np.frombuffer(data, dtype=np.uint8)
        yield info
        pos = 0
        for i, f in enumerate(out.flats):
            n = f.numel()
            f.numpy()[:] = src[pos : pos + n]
            pos += n
            if out.flat is None:
                yield i, out.finish_one(i)
        out.finish_flat()

    def _restore_pool(self, r: pb.AcquireResponse, pool: torch.Tensor, device: Any,
                      into: Sequence[torch.Tensor] | None, into_flat: torch.Tensor | None
                      ) -> Iterator[SeqInfo | tuple[int, torch.Tensor]]:
        """shm / cuda_ipc: copy straight out of the leased slots, one event per tensor."""
        copies: copier.LayerCopier | None = None
        try:
            info = convert.info_from_pb(r.info)
            out = Outputs(info.tensors, device, into, into_flat=into_flat)
            segs = [(s.offset, s.length) for s in r.segments]
            by_tensor: list[list[tuple[int, int, int, int]]] = [[] for _ in out.flats]
            for di, do, si, so, n in pieces([f.numel() for f in out.flats], [n for _, n in segs]):
                by_tensor[di].append((do, segs[si][0] + so, n, 0))
            copies = copier.LayerCopier(pool.device, out.device)
            marks = []
            for di, plan in enumerate(by_tensor):
                for do, base, n, _ in plan:
                    copies.copy(out.flats[di][do : do + n], pool[base : base + n])
                marks.append(copies.mark())
            yield info
            if out.flat is not None:
                copies.wait(marks[0])
                out.finish_flat()
            else:
                for i, mark in enumerate(marks):
                    copies.wait(mark)
                    yield i, out.finish_one(i)
        finally:
            # Every queued copy has read its slots before the lease ends, also when a
            # layer-wise consumer stops early. They all run on the copier's stream, so
            # one event there covers them (no device-wide synchronize).
            try:
                if copies is not None:
                    copies.synchronize()
            finally:
                self._abort_quietly(r.lease_id)

    def _restore_inline(self, ids: list[str], device: Any, into: Sequence[torch.Tensor] | None,
                        expect_layout: str, into_flat: torch.Tensor | None = None
                        ) -> Iterator[SeqInfo | tuple[int, torch.Tensor]]:
        req = pb.RestoreRequest(expect_layout=expect_layout)
        _set_ids(req, ids)
        call = self._restore(req, timeout=self.timeout)
        what = ",".join(ids)
        try:
            it = iter(call)
            first = next(it, None)
            if first is None:
                raise DataLoss(f"restore of {what!r}: the daemon sent no header")
            head = pb.RestoreResponse.FromString(first)
            if head.WhichOneof("kind") != "header":
                raise DataLoss(f"restore of {what!r}: stream did not start with a header")
            info = convert.info_from_pb(head.header.info)
            try:
                out = Outputs(info.tensors, device, into, staging_device="cpu", into_flat=into_flat)
            except KVParkError:
                call.cancel()
                raise
            yield info
            if out.flat is not None:
                yield from self._receive_flat(it, out, info, what)
                return
            dsts = [f.numpy() for f in out.flats]
            lens = [d.size for d in dsts]
            ends = np.cumsum(lens).tolist() if lens else []
            pos = 0
            ti = 0  # next tensor to hand out
            while ti < len(lens) and lens[ti] == 0:
                yield ti, out.finish_one(ti)
                ti += 1
            for src in _chunks(it, info.nbytes, what):
                done = 0
                while done < len(src):
                    within = pos - (ends[ti] - lens[ti])
                    n = min(lens[ti] - within, len(src) - done)
                    dsts[ti][within : within + n] = src[done : done + n]
                    done += n
                    pos += n
                    while ti < len(lens) and pos >= ends[ti]:  # tensor complete (and any empty ones after it)
                        yield ti, out.finish_one(ti)
                        ti += 1
        except grpc.RpcError as e:
            raise _translate(e) from None

    @staticmethod
    def _receive_flat(it: Iterator[bytes], out: Outputs, info: SeqInfo, what: str) -> Iterator[Any]:
        assert out.flat is not None
        dst = out.flat.numpy()
        pos = 0
        for src in _chunks(it, info.nbytes, what):
            dst[pos : pos + len(src)] = src
            pos += len(src)
        out.finish_flat()
        return
        yield

    def present(self, seq_ids: Sequence[str]) -> list[bool]:
        """For each id, whether it is parked."""
        req = pb.LookupRequest(seq_ids=list(seq_ids))
        return list(self._call(self._lookup, req).present)

    def lookup(self, seq_ids: Sequence[str]) -> int:
        """How many of ``seq_ids``, from the first, are parked (a prefix lookup)."""
        return int(self._call(self._lookup, pb.LookupRequest(seq_ids=list(seq_ids))).prefix)

    # ------------------------------------------------------------------ control

    def prefetch(self, seq_id: str, *, tier: str = "device", wait: bool = False,
                 timeout: float | None = None) -> str:
        """Start promoting ``seq_id`` into ``tier`` so a later restore finds it resident.

        With ``wait=True``, return once it is there (raises ``DeadlineExceeded`` after
        ``timeout`` seconds). Returns the tier the sequence is in now.
        """
        validate_seq_id(seq_id)
        if tier not in ("device", "host"):
            raise InvalidArgument(f"tier must be 'device' or 'host', got {tier!r}")
        if timeout is not None and timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0, got {timeout}")
        req = pb.PrefetchRequest(seq_id=seq_id, tier=tier, wait=wait, timeout_s=timeout or 0.0)
        # The daemon enforces ``timeout``; the RPC deadline only guards against a hung daemon.
        rpc_timeout = None if timeout is None else timeout + 5.0
        return self._call(self._prefetch, req, timeout=rpc_timeout or self.timeout).tier

    def drop(self, seq_id: str) -> bool:
        validate_seq_id(seq_id)
        return bool(self._call(self._drop, pb.DropRequest(seq_id=seq_id)).dropped)

    def info(self, seq_id: str) -> SeqInfo:
        validate_seq_id(seq_id)
        return convert.info_from_pb(self._call(self._info, pb.InfoRequest(seq_id=seq_id)))

    def list(self) -> list[SeqInfo]:
        return [convert.info_from_pb(i) for i in self._call(self._list, pb.ListRequest()).sequences]

    def stat(self) -> Stat:
        return convert.stat_from_pb(self._call(self._stat, pb.StatRequest()))
