"""``Client``: the connection to one daemon and the data path it negotiated.

Primitives:
- ``Client(address=None, *, timeout=None, transport="auto")``: connects (Hello) at once.
- ``park(seq_id, tensors, *, priority=0, overwrite=False) -> SeqInfo``.
- ``restore(seq_id, *, device=None, into=None) -> list[torch.Tensor]``.
- ``drop(seq_id) -> bool``, ``info(seq_id) -> SeqInfo``, ``list()``, ``stat()``.
- ``prefetch(seq_id, *, tier="device", wait=False, timeout=None) -> str``.
- ``transport``: "cuda_ipc", "shm" (same host, arena file mapped once) or "inline".

Transports, in the order ``auto`` tries them: ``cuda_ipc`` when the daemon's device pool
is on a GPU this process can see (copies device-to-device into its slots), ``shm`` when
the daemon offers an arena file on this host that we can open, else ``inline``. Forcing one that cannot work
raises ``TransportUnavailable``. Every gRPC failure becomes a typed ``KVParkError``.
"""

from __future__ import annotations

import os
import pickle
import socket
from typing import Any, Callable, Iterator, Sequence

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
        ch = self._channel
        u = lambda name, resp: ch.unary_unary(_SVC + name, request_serializer=_ser,  # noqa: E731
                                               response_deserializer=resp.FromString)
        self._hello = u("Hello", pb.HelloResponse)
        self._reserve = u("Reserve", pb.ReserveResponse)
        self._commit = u("Commit", pb.SeqInfo)
        self._acquire = u("Acquire", pb.AcquireResponse)
        self._release = u("Release", pb.ReleaseResponse)
        self._prefetch = u("Prefetch", pb.PrefetchResponse)
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
        if want in ("auto", "cuda_ipc"):
            why = self._try_cuda_ipc(offered)
            if why is None:
                return "cuda_ipc"
            if want == "cuda_ipc":
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
            self._pool = copier.open_ipc(pickle.loads(d.ipc_handle), d.size)
        except (RuntimeError, pickle.UnpicklingError) as e:
            return f"cannot open the device pool's IPC handle: {e}"
        return None

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
             overwrite: bool = False, pinned: bool = False, ttl_s: float | None = None) -> SeqInfo:
        """Store ``tensors`` under ``seq_id``. Visible to others only once this returns.

        ``priority``: higher is demoted later. ``pinned``: never demoted below the tier it
        lands in. ``ttl_s``: dropped that many seconds after the park.
        """
        validate_seq_id(seq_id)
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            raise InvalidArgument("tensors must be a list or tuple of torch tensors")
        if not -(1 << 31) <= int(priority) < (1 << 31):
            raise InvalidArgument(f"priority must fit in int32, got {priority}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s}")
        flats = [byte_view(t) for t in tensors]
        metas = [TensorMeta.of(t) for t in tensors]
        header = pb.ParkHeader(
            seq_id=seq_id, tensors=[convert.meta_to_pb(m) for m in metas], nbytes=sum(m.nbytes for m in metas),
            priority=int(priority), overwrite=overwrite, pinned=pinned, ttl_s=float(ttl_s or 0.0),
        )
        if self.transport == "inline":
            return self._park_inline(header, flats)
        return self._park_pool(header, flats)

    def _pool_for(self) -> tuple[torch.Tensor, str]:
        if self.transport == "cuda_ipc":
            assert self._pool is not None
            return self._pool, "device"
        assert self._arena is not None
        return self._arena.tensor, "host"

    def _park_pool(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        """shm / cuda_ipc: reserve slots, copy straight into the daemon's memory, commit."""
        pool, tier = self._pool_for()
        r = self._call(self._reserve, pb.ReserveRequest(header=header, tier=tier))
        try:
            segs = [(s.offset, s.length) for s in r.segments]
            for si, so, di, do, n in pieces([f.numel() for f in flats], [n for _, n in segs]):
                base = segs[di][0] + do
                pool[base : base + n].copy_(flats[si][so : so + n])
            # Explicit synchronisation: the daemon reads the slots only after Commit,
            # and every copy into them has completed by then.
            copier.synchronize(pool.device)
        except BaseException:
            self._abort_quietly(r.lease_id)
            raise
        return convert.info_from_pb(self._call(self._commit, pb.CommitRequest(lease_id=r.lease_id)))

    def _abort_quietly(self, lease_id: str) -> None:
        try:
            self._call(self._release, pb.ReleaseRequest(lease_id=lease_id))
        except KVParkError:
            pass  # the lease TTL frees it anyway

    def _park_inline(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        # One D2H per device tensor; CPU tensors are framed straight from their memory.
        views = [memoryview(f.cpu().numpy()) for f in flats if f.numel()]
        size = self.chunk_size

        def stream() -> Iterator[bytes]:
            yield pb.ParkRequest(header=header).SerializeToString()
            for off, vs in regroup(views, size):
                yield encode_chunk(off, *vs)
            yield pb.ParkRequest(commit=pb.ParkCommit(nbytes=header.nbytes)).SerializeToString()

        try:
            return convert.info_from_pb(self._park(stream(), timeout=self.timeout))
        except grpc.RpcError as e:
            raise _translate(e) from None

    # ------------------------------------------------------------------ restore

    def restore(self, seq_id: str, *, device: torch.device | str | None = None,
                into: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Return the parked tensors (on ``device``, default CPU), or fill ``into`` in place."""
        validate_seq_id(seq_id)
        if self.transport == "inline":
            return self._restore_inline(seq_id, device, into)
        return self._restore_pool(seq_id, device, into)

    def _restore_pool(self, seq_id: str, device: Any, into: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """shm / cuda_ipc: lease the resident slots, copy straight out, release."""
        pool, tier = self._pool_for()
        try:
            r = self._call(self._acquire, pb.AcquireRequest(seq_id=seq_id, tier=tier))
        except ResourceExhausted:
            # No room to stage it in that tier (all leased or pinned): stream it instead.
            return self._restore_inline(seq_id, device, into)
        try:
            info = convert.info_from_pb(r.info)
            out = Outputs(info.tensors, device, into)
            segs = [(s.offset, s.length) for s in r.segments]
            for di, do, si, so, n in pieces([f.numel() for f in out.flats], [n for _, n in segs]):
                base = segs[si][0] + so
                out.flats[di][do : do + n].copy_(pool[base : base + n])
            copier.synchronize(pool.device)  # done reading before the lease ends
        finally:
            self._abort_quietly(r.lease_id)
        return out.finish()

    def _restore_inline(self, seq_id: str, device: Any, into: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        call = self._restore(pb.RestoreRequest(seq_id=seq_id), timeout=self.timeout)
        try:
            it = iter(call)
            first = next(it, None)
            if first is None:
                raise DataLoss(f"restore of {seq_id!r}: the daemon sent no header")
            head = pb.RestoreResponse.FromString(first)
            if head.WhichOneof("kind") != "header":
                raise DataLoss(f"restore of {seq_id!r}: stream did not start with a header")
            info = convert.info_from_pb(head.header.info)
            try:
                out = Outputs(info.tensors, device, into, staging_device="cpu")
            except KVParkError:
                call.cancel()
                raise
            dsts = [f.numpy() for f in out.flats]
            lens = [d.size for d in dsts]
            starts = np.cumsum([0, *lens[:-1]]).tolist() if lens else []
            pos = 0
            ti = 0
            for raw in it:
                chunk = decode_chunk(raw)
                if chunk is None:
                    raise DataLoss(f"restore of {seq_id!r}: unexpected non-chunk message")
                offset, data = chunk
                if offset != pos or pos + len(data) > info.nbytes:
                    raise DataLoss(f"restore of {seq_id!r}: chunk at {offset} (+{len(data)}), expected {pos}")
                src = np.frombuffer(data, dtype=np.uint8)
                done = 0
                while done < len(src):
                    while starts[ti] + lens[ti] <= pos:
                        ti += 1
                    within = pos - starts[ti]
                    n = min(lens[ti] - within, len(src) - done)
                    dsts[ti][within : within + n] = src[done : done + n]
                    done += n
                    pos += n
            if pos != info.nbytes:
                raise DataLoss(f"restore of {seq_id!r}: stream ended after {pos} of {info.nbytes} bytes")
        except grpc.RpcError as e:
            raise _translate(e) from None
        return out.finish()

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
