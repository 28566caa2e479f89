"""The data paths, as strategies chosen from a name registry.

gRPC carries control on every path; the bytes take the cheapest one the client reaches:

- ``CudaIpc``: the daemon's device pool, opened through CUDA IPC, on a GPU this process
  sees; copies are device to device into (out of) the slots the daemon reserved (leased).
- ``Shm``: the host arena file, mapped once (and page-locked once on a GPU machine).
- ``Inline``: clients that cannot map the arena (remote or untrusted). Bulk bytes go over
  the daemon's data channel when Hello offers one (``client/datachannel.py``: a raw
  socket, one-time tokens from Reserve/Acquire); else, or when it is refused, in ~1 MiB
  gRPC messages.

Payloads up to one message (inline) or ``SMALL_POOL_BYTES`` (shm, cuda_ipc) take one
unary round trip (``ParkSmall``, ``Get``, an ``Acquire`` that answers inline) on every path.
A payload larger than the daemon's pool moves through it one window at a time
(``Reserve``/``Acquire`` answer ``window_size``; ``Window`` moves to the next); inline
needs nothing of the kind (the daemon streams it to and from disk).

Primitives:
- ``Target``: where a restore's bytes go (``device``, ``into``, ``into_flat``) and the
  layout it must carry.
- ``Restoring``: a restore under way: ``info`` at once, then ``(index, tensor)`` pairs as
  each tensor lands; ``close()`` ends it (and its lease) early; it closes itself once
  exhausted. ``then(fn)`` runs ``fn`` after it ended.
- ``Transport``: ``name``; ``open(rpc, hello)`` (raises ``TransportUnavailable`` with the
  reason); ``park(header, flats) -> SeqInfo``; ``restore(ids, target) -> Restoring``;
  ``small_limit`` (payloads up to it take one round trip); ``holding(start)`` (a restore
  that holds a use of the mappings until it ends); ``close(error=None)``: unmaps once
  the last call copying through the mappings has ended (never under a copy), and a call
  begun after it raises ``error()`` (default ``Unavailable("client closed")``).
  A shm/cuda_ipc restore must know its read lease outlived its copies: a lease that
  ended first (reaped past ``leases.ttl_s``) may have had its slots reused under the
  copy, so the restore raises ``LeaseExpired`` instead of returning those bytes. On shm,
  copies that landed well before the lease's deadline (reckoned from when the Acquire
  was sent: ``_usable_until``) need no answer, so the Release is not waited for
  (``client/releases.py``: the next Acquire or Reserve carries it, any other call sends
  it first); otherwise, and on cuda_ipc, the Release must answer ``released``.
- ``InstanceChanged`` (an ``Unavailable``): the daemon restarted since this transport
  was opened. Every reply that hands out memory names the daemon instance that issued it
  (``instance``, as Hello does); a transport checks it *before* it copies a byte and
  raises this on a mismatch (releasing what the new daemon leased), and sends its own
  instance with every ``Commit`` and ``Window``, so a park written into the old arena is
  refused by the new daemon. ``Client`` then opens the new instance and retries once.
- ``TRANSPORTS``: name -> class; ``AUTO``: what ``auto`` tries at connect, in order;
  ``negotiate(rpc, hello, want) -> Transport``.
"""

from __future__ import annotations

import logging
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import grpc
import numpy as np
import torch

from kvpark.proto import convert
from kvpark.proto.errors import (DataLoss, DeadlineExceeded, KVParkError, LeaseExpired, ResourceExhausted,
                                 TransportUnavailable, Unavailable)
from kvpark.proto.types import SeqInfo
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.proto.wire import decode_chunk, encode_chunk, regroup
from kvpark.tiers import cuda, envs
from kvpark.tiers.shm import boot_id

from . import disk_reads, mappings
from .datachannel import DataChannel, DataChannelRefused, NoStatus, client_ssl_context
from .payload import Outputs, gather, pieces, runs
from .rpc import Rpc, translate
from .uses import Uses

log = logging.getLogger("kvpark.client")

# Payloads up to this size travel inside one unary RPC even on shm/cuda_ipc: one round
# trip beats two (reserve+commit, acquire+release) when the bytes are few
# (bench/transport.py: a unary round trip costs about as much as copying 200 KiB through gRPC).
SMALL_POOL_BYTES = 128 << 10
# How long before a read lease's deadline (as the client reckons it) a copy out of it
# must have landed for its Release to go without waiting (a quarter of the lease's life
# when that is shorter).
LEASE_MARGIN_S = 1.0


@dataclass(frozen=True)
class Target:
    device: torch.device | str | None = None
    into: Sequence[torch.Tensor] | None = None
    into_flat: torch.Tensor | None = None
    expect_layout: str = ""

    def devices(self) -> set[torch.device]:
        """Where the restored bytes land."""
        if self.into_flat is not None:
            return {self.into_flat.device}
        if self.into is not None:
            return {t.device for t in self.into if isinstance(t, torch.Tensor)}
        return {torch.device(self.device) if self.device is not None else torch.device("cpu")}

    def outputs(self, info: SeqInfo, staging_device: str | None = None) -> Outputs:
        return Outputs(info.tensors, self.device, self.into, staging_device=staging_device, into_flat=self.into_flat)


class Restoring:
    """A restore under way: ``info`` now, tensors as they land; ``cleanup`` runs exactly once."""

    def __init__(self, info: SeqInfo, tensors: Iterator[tuple[int, torch.Tensor]],
                 cleanup: Callable[[], None] | None = None) -> None:
        self.info = info
        self._tensors = tensors
        self._cleanup = cleanup

    def __iter__(self) -> "Restoring":
        return self

    def __next__(self) -> tuple[int, torch.Tensor]:
        try:
            return next(self._tensors)
        except BaseException:  # exhausted or failed: the lease ends now either way
            self.close()
            raise

    def then(self, after: Callable[[], None]) -> "Restoring":
        """Run ``after`` once this restore has ended, after its own cleanup."""
        first = self._cleanup

        def both() -> None:
            try:
                if first is not None:
                    first()
            finally:
                after()

        self._cleanup = both
        return self

    def close(self) -> None:
        # The cleanup first: it waits for the copies still queued into the outputs. Closing
        # the generator drops its frame, and with it the last reference to outputs the
        # caller never took; freed before the wait, the caching allocator could hand that
        # memory to another thread while a side-stream copy still writes it.
        cleanup, self._cleanup = self._cleanup, None
        try:
            if cleanup is not None:
                cleanup()
        finally:
            self._tensors.close()  # type: ignore[attr-defined]

    def __del__(self) -> None:
        if self._cleanup is not None:  # abandoned half-way by a layer-wise consumer
            self.close()


def set_ids(req: Any, ids: list[str]) -> None:
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


def _window_plan(lengths: list[int], start: int,
                 segs: list[tuple[int, int]]) -> Iterator[tuple[int, int, int, int]]:
    """``(tensor, tensor offset, pool offset, n)`` for the payload bytes ``[start, start +
    sum(segs))`` that one window holds in ``segs``."""
    span = sum(n for _, n in segs)
    dst = [start, *(n for _, n in segs), sum(lengths) - start - span]
    for si, so, di, do, n in pieces(lengths, dst):
        if 0 < di <= len(segs):
            yield si, so, segs[di - 1][0] + do, n


def _segs(msg: Any) -> list[tuple[int, int]]:
    return [(s.offset, s.length) for s in msg.segments]


class InstanceChanged(Unavailable):
    """The daemon restarted: what this client mapped (arena, device pool, data channel)
    belongs to a start of it that is gone. ``stale``: the instance it was mapped from."""

    def __init__(self, message: str, stale: str) -> None:
        super().__init__(message)
        self.stale = stale


class Transport(ABC):
    name: ClassVar[str]
    small_limit: int

    def __init__(self, rpc: Rpc, hello: pb.HelloResponse) -> None:
        self.rpc = rpc
        self.hello = hello
        self.chunk_size = int(hello.chunk_size) or (1 << 20)
        self.packed = "packed" in hello.features  # compact tensor lists in replies
        # The daemon ends the leases an Acquire or Reserve names (an older one would drop
        # the field, and the leases would live until their TTL): else they are sent first.
        self.carries = "carry_release" in hello.features
        self.instance = hello.instance  # the start of the daemon whose memory this maps
        self._uses = Uses()  # calls copying through the mappings: close unmaps after the last

    @classmethod
    def open(cls, rpc: Rpc, hello: pb.HelloResponse) -> "Transport":
        return cls(rpc, hello)

    def close(self, error: Callable[[], Exception] | None = None) -> None:
        """Unmap once no call is copying through the mappings (now, when none is); a call
        begun after this raises ``error()`` (default ``Unavailable("client closed")``)."""
        self._uses.close(self._unmap, error or (lambda: Unavailable("client closed")))

    def _unmap(self) -> None:
        """Let go of what this transport mapped; runs once, with no call using it."""

    def park(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        with self._uses.held():
            return self._park(header, flats)

    def restore(self, ids: list[str], target: Target) -> Restoring:
        return self.holding(lambda: self._restore(ids, target))

    def holding(self, start: Callable[[], Restoring]) -> Restoring:
        """``start()``, holding a use of the mappings until the restore it returns ends."""
        self._uses.enter()
        try:
            r = start()
        except BaseException:
            self._uses.exit()
            raise
        return r.then(self._uses.exit)

    @abstractmethod
    def _park(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo: ...

    @abstractmethod
    def _restore(self, ids: list[str], target: Target) -> Restoring: ...

    # ---------------------------------------------------------------- daemon instance

    def _changed(self, what: str) -> InstanceChanged:
        return InstanceChanged(f"{what}: the daemon restarted (instance {self.instance[:8]}... is gone); "
                               "this client's mappings are of the old one", self.instance)

    def check(self, reply: Any, what: str, lease_id: str = "") -> None:
        """Refuse a reply of another daemon instance before touching any memory it names;
        the lease it carries (the new daemon's) is given back."""
        if reply.instance != self.instance:
            self.rpc.release_quietly(lease_id)
            raise self._changed(what)

    def restarted(self) -> bool:
        """Whether the daemon answering now is another instance than the mapped one (a
        daemon that cannot be asked counts as not restarted: the caller's error stands)."""
        try:
            return self.rpc.call(self.rpc.hello, pb.HelloRequest()).instance != self.instance
        except KVParkError:
            return False

    def _commit(self, lease_id: str, packed: bool = False) -> SeqInfo:
        """Commit naming the instance whose memory holds the bytes: any other refuses."""
        try:
            return convert.info_from_pb(self.rpc.call(self.rpc.commit, pb.CommitRequest(
                lease_id=lease_id, packed=packed, instance=self.instance)))
        except LeaseExpired:
            if self.restarted():
                raise self._changed("commit") from None
            raise

    def _release_read(self, lease_id: str, what: str) -> None:
        """End a read lease whose slots were just copied out, learning whether it was
        still alive. The daemon cannot see a copy out of a mapping: a lease that expired
        (and was reaped) before its Release may have had its slots freed and reused under
        the copy, so those bytes are refused (``LeaseExpired``), never handed over as right."""
        if not self.rpc.call(self.rpc.release, pb.ReleaseRequest(lease_id=lease_id)).released:
            raise LeaseExpired(f"restore of {what!r}: its read lease ended before the copy out of the "
                               "mapping was released (past leases.ttl_s); the bytes copied are discarded, "
                               "restore it again")

    def _window(self, lease_id: str, index: int, nbytes: int) -> list[tuple[int, int]]:
        try:
            w = self.rpc.call(self.rpc.window, pb.WindowRequest(lease_id=lease_id, index=index, instance=self.instance),
                              timeout=self.rpc.data_timeout(nbytes))
        except LeaseExpired:
            if self.restarted():
                raise self._changed("window") from None
            raise
        self.check(w, "window")
        return _segs(w)

    # ---------------------------------------------------------------- shared by every path

    def _park_small(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        data = b"".join(memoryview(f.cpu().numpy()) for f in flats if f.numel())
        return convert.info_from_pb(self.rpc.call(self.rpc.park_small, pb.ParkSmallRequest(header=header, data=data)))

    @staticmethod
    def _from_bytes(info_pb: pb.SeqInfo, data: bytes, target: Target) -> Restoring:
        info = convert.info_from_pb(info_pb)
        if len(data) != info.nbytes:
            raise DataLoss(f"restore of {info.seq_id!r}: {len(data)} bytes for a {info.nbytes}-byte payload")
        out = target.outputs(info, staging_device="cpu")
        src = np.frombuffer(data, dtype=np.uint8)

        def tensors() -> Iterator[tuple[int, torch.Tensor]]:
            pos = 0
            for i, f in enumerate(out.flats):
                n = f.numel()
                f.numpy()[:] = src[pos : pos + n]
                pos += n
                if out.flat is None:
                    yield i, out.finish_one(i)
            out.finish_flat()

        return Restoring(info, tensors())

    def _restore_stream(self, ids: list[str], target: Target, nbytes: int | None = None) -> Restoring:
        """A server-streamed Restore: the header, then ~1 MiB chunks written straight into the outputs.

        Its deadline covers the whole stream, so it is sized from ``nbytes`` (asked with
        ``info`` when the caller does not know it)."""
        req = pb.RestoreRequest(expect_layout=target.expect_layout)
        set_ids(req, ids)
        what = ",".join(ids)
        if nbytes is None:
            nbytes = sum(int(self.rpc.call(self.rpc.info, pb.InfoRequest(seq_id=i)).nbytes) for i in ids)
        call = self.rpc.restore(req, timeout=self.rpc.data_timeout(nbytes))
        try:
            it = iter(call)
            first = next(it, None)
            if first is None:
                raise DataLoss(f"restore of {what!r}: the daemon sent no header")
            head = pb.RestoreResponse.FromString(first)
            if head.WhichOneof("kind") != "header":
                raise DataLoss(f"restore of {what!r}: stream did not start with a header")
            info = convert.info_from_pb(head.header.info)
            out = target.outputs(info, staging_device="cpu")
        except grpc.RpcError as e:
            raise translate(e) from None
        except BaseException:
            call.cancel()
            raise

        def tensors() -> Iterator[tuple[int, torch.Tensor]]:
            try:
                if out.flat is not None:
                    dst = out.flat.numpy()
                    pos = 0
                    for src in _chunks(it, info.nbytes, what):
                        dst[pos : pos + len(src)] = src
                        pos += len(src)
                    out.finish_flat()
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
                        while ti < len(lens) and pos >= ends[ti]:  # complete (and any empty ones after it)
                            yield ti, out.finish_one(ti)
                            ti += 1
            except grpc.RpcError as e:
                raise translate(e) from None

        return Restoring(info, tensors(), call.cancel)


class Inline(Transport):
    """Bytes in ~1 MiB gRPC messages, framed from memoryviews of the tensors."""

    name = "inline"

    def __init__(self, rpc: Rpc, hello: pb.HelloResponse) -> None:
        super().__init__(rpc, hello)
        dc = hello.data_channel
        self.channel = (DataChannel(dc, rpc.address, client_ssl_context(*rpc.tls))
                        if hello.HasField("data_channel") and dc.address else None)

    @property
    def small_limit(self) -> int:
        return self.chunk_size

    def _unmap(self) -> None:
        if self.channel is not None:
            self.channel.close()

    def _socket(self) -> socket.socket | None:
        """A data channel connection, or None: no channel, or refused (then gRPC streams)."""
        if self.channel is None or not self.channel.usable:
            return None
        try:
            return self.channel.connect()
        except DataChannelRefused:
            # A restarted daemon's channel may be at another address (a new port).
            if self.restarted():
                raise self._changed("data channel") from None
            return None

    def _park(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        if sum(f.numel() for f in flats) <= self.small_limit:
            return self._park_small(header, flats)
        # One D2H per device tensor; CPU tensors are framed straight from their memory.
        views = [memoryview(f.cpu().numpy()) for f in flats if f.numel()]
        size = self.chunk_size
        total = sum(len(v) for v in views)
        sock = self._socket()
        if sock is not None:
            done = self._park_channel(sock, header, views, total)
            if done is not None:
                return done

        def stream() -> Iterator[bytes]:
            yield pb.ParkRequest(header=header).SerializeToString()
            for off, vs in regroup(views, size):
                yield encode_chunk(off, *vs)
            yield pb.ParkRequest(commit=pb.ParkCommit(nbytes=total)).SerializeToString()

        timeout = self.rpc.data_timeout(total)
        call = self.rpc.park.future(stream(), timeout=timeout)
        try:
            # Waited on with a bound of our own: the blocking form can outlive its
            # deadline when the daemon stops reading mid-stream (it waits on every queued send).
            return convert.info_from_pb(call.result(timeout=None if timeout is None else timeout + 1.0))
        except grpc.FutureTimeoutError:
            call.cancel()
            raise DeadlineExceeded(f"park of {header.seq_id!r}: the stream stalled past its "
                                   f"{timeout:.1f}s deadline") from None
        except grpc.RpcError as e:
            raise translate(e) from None

    def _park_channel(self, sock: socket.socket, header: pb.ParkHeader, views: list[memoryview],
                      total: int) -> SeqInfo | None:
        """Reserve (token), the bytes on the data channel, then commit: three steps, as shm.
        None: the daemon wants this park on the gRPC stream (a windowed park)."""
        rpc, channel = self.rpc, self.channel
        assert channel is not None
        try:
            r = rpc.call(rpc.reserve, pb.ReserveRequest(header=header, tier="host", data_channel=True))
        except TransportUnavailable:
            channel.done(sock)
            return None
        except BaseException:
            channel.done(sock)
            raise
        if r.instance != self.instance:
            channel.discard(sock)  # a pooled connection may be to the old daemon
            self.check(r, "reserve", r.lease_id)
        try:
            channel.put(sock, r.token, views, total, rpc.data_timeout(total))
        except NoStatus:
            # Turned away unanswered (a crowded channel), or the daemon is gone: nothing of
            # this reservation was committed, so the gRPC stream parks it afresh (and
            # fails the same way if the daemon is gone).
            channel.discard(sock)
            rpc.release_quietly(r.lease_id)
            return None
        except BaseException:
            channel.discard(sock)
            rpc.release_quietly(r.lease_id)  # the daemon aborts it on errors it sees; this covers the rest
            raise
        channel.done(sock)
        return self._commit(r.lease_id, self.packed)

    def _restore_channel(self, sock: socket.socket, ids: list[str], target: Target) -> Restoring | None:
        """Acquire (bytes inline when small, else a token), then the bytes on the data
        channel straight into the outputs; the daemon ends the lease with the transfer.
        None: the daemon turned the connection away unanswered (the gRPC path serves it)."""
        rpc, channel = self.rpc, self.channel
        assert channel is not None
        req = pb.AcquireRequest(tier="host", expect_layout=target.expect_layout, inline_max=self.chunk_size,
                                packed=self.packed, data_channel=True)
        set_ids(req, ids)
        try:
            r = rpc.call(rpc.acquire, req)
        except ResourceExhausted:
            channel.done(sock)  # no room to stage it on host: the gRPC stream serves it
            return self._restore_stream(ids, target)
        except BaseException:
            channel.done(sock)
            raise
        if r.inlined:
            channel.done(sock)
            return self._from_bytes(r.info, r.data, target)
        if r.instance != self.instance:
            channel.discard(sock)
            self.check(r, "acquire", r.lease_id)
        try:
            info = convert.info_from_pb(r.info)
            out = target.outputs(info, staging_device="cpu")
        except BaseException:
            channel.discard(sock)
            rpc.release_quietly(r.lease_id)
            raise
        dsts = [memoryview(f.numpy()) for f in out.flats]
        try:
            got = channel.get(sock, r.token, info.nbytes, dsts, rpc.data_timeout(info.nbytes))
        except NoStatus:
            # Nothing of the lease was read: end it, and read the bytes over gRPC.
            channel.discard(sock)
            rpc.release_quietly(r.lease_id)
            return None
        except BaseException:
            channel.discard(sock)
            rpc.release_quietly(r.lease_id)
            raise

        def tensors() -> Iterator[tuple[int, torch.Tensor]]:
            ok = False
            try:
                for i in got:
                    if out.flat is None:
                        yield i, out.finish_one(i)
                out.finish_flat()
                ok = True
            finally:
                # A connection left mid-transfer (an error, a consumer that stopped early)
                # is closed: the daemon then ends the lease itself.
                (channel.done if ok else channel.discard)(sock)

        return Restoring(info, tensors())

    def _restore(self, ids: list[str], target: Target) -> Restoring:
        sock = self._socket()
        if sock is not None:
            done = self._restore_channel(sock, ids, target)
            if done is not None:
                return done
        g = pb.GetRequest(expect_layout=target.expect_layout, max_bytes=self.chunk_size)
        set_ids(g, ids)
        got = self.rpc.call(self.rpc.get, g)
        if not got.too_large:
            return self._from_bytes(got.info, got.data, target)
        return self._restore_stream(ids, target, int(got.info.nbytes))


def _park_copier(sources: set[torch.device], pool: torch.device) -> cuda.LayerCopier | None:
    """A park's copies on the side stream of their direction when one GPU is involved
    (into a page-locked mapping they are real asynchronous DMA, queued behind nothing the
    model runs); None: plain copies on the current streams (CPU only, or tensors on
    several GPUs, or on several kinds of device)."""
    gpus = {cuda.indexed(d) for d in sources | {pool} if d.type == "cuda"}
    kinds = {d.type for d in sources}
    if len(gpus) != 1 or len(kinds) != 1:
        return None
    return cuda.LayerCopier(next(iter(sources)), pool)


def _sources_ready(devices: set[torch.device]) -> None:
    """Wait for the work already queued on the current streams of ``devices`` before a
    reservation or read lease is asked for.

    A lease lives ``leases.ttl_s`` from its grant, and the daemon cannot see a copy queued
    on a GPU: a copy queued behind seconds of model work could outlive its lease and
    write slots the daemon has handed to another park. Waiting first ties the lease's
    life to the copy itself (the later ``wait_stream`` then orders nothing new)."""
    gpus = {d for d in devices if d.type == "cuda"}
    if gpus:
        cuda.Fence(*gpus).wait()


def _copy(copies: cuda.LayerCopier | None, dst: torch.Tensor, src: torch.Tensor) -> None:
    if copies is None:
        dst.copy_(src)
    else:
        copies.copy(dst, src)


def _landed(copies: cuda.LayerCopier | None, devices: set[torch.device]) -> None:
    """Every copy queued so far has landed."""
    if copies is None:
        cuda.Fence(*devices).wait()
    else:
        copies.synchronize()


class _Pool(Transport):
    """A daemon memory pool this process maps: reserve/commit and acquire/release around plain copies."""

    tier: ClassVar[str]
    # Whether a restore whose copies landed well within the lease's life sends its Release
    # without waiting for the answer. Only for a mapping whose bytes stay as they were
    # whatever the daemon does after the lease (a file's pages); not for a CUDA IPC
    # pool, whose memory a dying daemon may take with it.
    releases_behind: ClassVar[bool] = False

    def __init__(self, rpc: Rpc, hello: pb.HelloResponse, pool: torch.Tensor) -> None:
        super().__init__(rpc, hello)
        self.pool = pool
        # Where a restore goes when this pool's tier has no room to stage it (all leased
        # or pinned): the client's shm mapping when it has one (a copy from page-locked
        # host memory), else the gRPC stream (about 1 GB/s).
        self.fallback: Transport | None = None

    small_limit = SMALL_POOL_BYTES

    def _park(self, header: pb.ParkHeader, flats: list[torch.Tensor]) -> SeqInfo:
        if sum(f.numel() for f in flats) <= self.small_limit:
            return self._park_small(header, flats)
        pool, rpc = self.pool, self.rpc
        sources = {f.device for f in flats if f.numel()}
        self.prepare(sources)
        _sources_ready(sources)
        r = rpc.call(rpc.reserve, pb.ReserveRequest(header=header, tier=self.tier), carry=self.carries)
        self.check(r, "reserve", r.lease_id)  # before a byte goes into the mapping
        devices = {pool.device, *(f.device for f in flats)}
        copies = _park_copier(sources, pool.device)
        try:
            if r.window_size:
                self._park_windows(r, flats, devices, copies)
                return self._commit(r.lease_id)
            segs = [(s.offset, s.length) for s in r.segments]
            if copies is not None or not gather(flats, pool, segs):
                for src, base, n in runs(flats, segs):
                    _copy(copies, pool[base : base + n], src)
            # The daemon reads the slots right after Commit: every copy into them has
            # landed by then. An event on the stream that ran them, not a device-wide
            # synchronize that would also wait for unrelated queued work.
            _landed(copies, devices)
        except BaseException:
            # Copies already queued may still be writing the slots: they land before the
            # lease (and with it the slots) goes back to the daemon for reuse.
            try:
                _landed(copies, devices)
            except Exception:  # noqa: BLE001 - a broken context runs no more copies
                pass
            rpc.release_quietly(r.lease_id)
            raise
        return self._commit(r.lease_id, self.packed)

    def _park_windows(self, r: pb.ReserveResponse, flats: list[torch.Tensor], devices: set[torch.device],
                      copies: cuda.LayerCopier | None) -> None:
        """Fill each window; asking for the next one hands the daemon the one just written."""
        pool, size = self.pool, int(r.window_size)
        lengths = [f.numel() for f in flats]
        total, segs, k = sum(lengths), _segs(r), 0
        while True:
            for ti, to, base, n in _window_plan(lengths, k * size, segs):
                _copy(copies, pool[base : base + n], flats[ti][to : to + n])
            _landed(copies, devices)  # landed before the daemon reads the window
            k += 1
            if k * size >= total:
                return
            segs = self._window(r.lease_id, k, size)

    def prepare(self, devices: set[torch.device]) -> None:
        """Called with the devices of a call's tensors before its copies."""

    def _restore(self, ids: list[str], target: Target) -> Restoring:
        self.prepare(target.devices())
        _sources_ready(target.devices())
        req = pb.AcquireRequest(tier=self.tier, expect_layout=target.expect_layout, inline_max=SMALL_POOL_BYTES,
                                packed=self.packed, disk=self._disk_grants(target))
        set_ids(req, ids)
        sent = time.monotonic()  # before the daemon can have started the lease's clock
        try:
            r = self.rpc.call(self.rpc.acquire, req, carry=self.carries)
            if r.disk_parts:
                self.check(r, "acquire")
                try:
                    return self._restore_disk(r, target)
                except disk_reads.Miss:
                    # Gone from disk since the grant, or not readable here: the daemon
                    # answers again as for any restore (the bytes, NOT_FOUND, DATA_LOSS).
                    req.disk = False
                    r = self.rpc.call(self.rpc.acquire, req)
        except ResourceExhausted:
            # No room to stage it in that tier (all leased or pinned): the fallback path.
            if self.fallback is not None:
                return self.fallback.restore(ids, target)
            return self._restore_stream(ids, target)
        if r.inlined:
            return self._from_bytes(r.info, r.data, target)
        self.check(r, "acquire", r.lease_id)  # before a byte is read out of the mapping
        if r.window_size:
            return self._restore_windows(r, target)
        return self._restore_leased(r, target, usable_until=self._usable_until(sent, r.expires_in_s))

    def _usable_until(self, sent: float, expires_in_s: float) -> float | None:
        """Until when (``time.monotonic()``) a copy out of a lease granted to a request
        sent at ``sent`` has surely ended before the lease could: the daemon starts the
        lease's ``expires_in_s`` after it got the request, on the same host's clock, and
        reaps it only past that. None: this path always asks at Release."""
        if not self.releases_behind or expires_in_s <= 0:
            return None
        return sent + expires_in_s - min(LEASE_MARGIN_S, expires_in_s / 4)

    def _disk_grants(self, target: Target) -> bool:
        """Whether to ask for a disk grant (``disk_reads.py``) for a restore into ``target``."""
        return False

    def _restore_disk(self, r: pb.AcquireResponse, target: Target) -> Restoring:
        raise disk_reads.Miss("this transport reads no disk grants")

    def _restore_windows(self, r: pb.AcquireResponse, target: Target) -> Restoring:
        """Copy each window out of the leased slots, then ask the daemon for the next;
        a tensor is handed over once the windows holding it are copied."""
        pool, rpc, size = self.pool, self.rpc, int(r.window_size)
        try:
            info = convert.info_from_pb(r.info)
            out = target.outputs(info)
        except BaseException:
            rpc.release_quietly(r.lease_id)
            raise
        devices = {pool.device, *(f.device for f in out.flats)}

        def tensors() -> Iterator[tuple[int, torch.Tensor]]:
            lengths = [f.numel() for f in out.flats]
            ends = np.cumsum(lengths).tolist() if lengths else []
            segs, k, ti = _segs(r), 0, 0
            while True:
                for i, o, base, n in _window_plan(lengths, k * size, segs):
                    out.flats[i][o : o + n].copy_(pool[base : base + n])
                cuda.Fence(*devices).wait()  # read before the daemon overwrites the window
                done = min((k + 1) * size, info.nbytes)
                while out.flat is None and ti < len(lengths) and ends[ti] <= done:
                    yield ti, out.finish_one(ti)
                    ti += 1
                if done >= info.nbytes:
                    break
                k += 1
                segs = self._window(r.lease_id, k, size)
            released[0] = True  # whatever the answer: a lease is released once
            self._release_read(r.lease_id, info.seq_id)
            out.finish_flat()

        def end() -> None:
            if not released[0]:
                rpc.release_quietly(r.lease_id)

        released = [False]
        return Restoring(info, tensors(), end)

    def _restore_leased(self, r: pb.AcquireResponse, target: Target, release: bool = True,
                        usable_until: float | None = None) -> Restoring:
        """Copy straight out of the leased slots, one readiness mark per tensor. With
        ``release=False`` the lease outlives the copies; the caller ends it. Copies that
        landed before ``usable_until`` cannot have been under a reaped lease: its Release
        is then sent without waiting for the answer; later, or with no ``usable_until``,
        the answer decides (``_release_read``)."""
        pool = self.pool
        copies: cuda.LayerCopier | None = None
        released = not release  # the lease ends here (once), or the caller ends it

        def end() -> None:
            # Every queued copy has read its slots before the lease ends, also when a
            # layer-wise consumer stops early. They all run on the copier's stream, so
            # one event there covers them (no device-wide synchronize).
            nonlocal released
            try:
                if copies is not None:
                    copies.synchronize()
            finally:
                if not released:
                    released = True
                    self.rpc.release_quietly(r.lease_id)

        def verify() -> None:
            """Every copy has landed: release the lease, refusing the bytes if it had ended."""
            nonlocal released
            if not released:
                assert copies is not None
                copies.synchronize()
                released = True
                if usable_until is not None and time.monotonic() < usable_until:
                    self.rpc.releases.add(r.lease_id)
                else:
                    self._release_read(r.lease_id, info.seq_id)

        try:
            info = convert.info_from_pb(r.info)
            out = target.outputs(info)
            segs = [(s.offset, s.length) for s in r.segments]
            by_tensor: list[list[tuple[int, int, int]]] = [[] for _ in out.flats]
            for di, do, si, so, n in pieces([f.numel() for f in out.flats], [n for _, n in segs]):
                by_tensor[di].append((do, segs[si][0] + so, n))
            copies = cuda.LayerCopier(pool.device, out.device)
            marks = []
            for di, plan in enumerate(by_tensor):
                for do, base, n in plan:
                    copies.copy(out.flats[di][do : do + n], pool[base : base + n])
                marks.append(copies.mark())
        except BaseException:
            end()
            raise

        def tensors() -> Iterator[tuple[int, torch.Tensor]]:
            assert copies is not None
            if out.flat is not None:
                copies.wait(marks[0])
                verify()
                out.finish_flat()
                return
            for i, mark in enumerate(marks):
                copies.wait(mark)
                yield i, out.finish_one(i)
            # A caller that takes the whole list gets it only past this check; a layer-wise
            # consumer learns here that what it was handed may be wrong.
            verify()

        return Restoring(info, tensors(), end)


class Shm(_Pool):
    """The host arena file, mapped once; page-locked once on a GPU machine."""

    name = "shm"
    tier = "host"
    releases_behind = True

    def __init__(self, rpc: Rpc, hello: pb.HelloResponse, mapping: mappings.Mapping) -> None:
        super().__init__(rpc, hello, mapping.arena.tensor)
        self.mapping = mapping
        self.arena = mapping.arena
        self.pinned = False
        # Where the daemon's disk tier lies, when it grants direct reads of it ("" if not).
        self.disk_path = hello.disk.path

    def _disk_grants(self, target: Target) -> bool:
        # Into CPU tensors only: a GPU target is better served from the page-locked arena
        # (one asynchronous DMA) than by copies out of pageable file pages.
        return bool(self.disk_path) and all(d.type == "cpu" for d in target.devices())

    def _restore_disk(self, r: pb.AcquireResponse, target: Target) -> Restoring:
        """Read a disk grant's records into the outputs, whole, before handing any over."""
        info = convert.info_from_pb(r.info)
        out = target.outputs(info)
        try:
            disk_reads.read_into(self.disk_path, r.disk_parts, out.flats)
        except disk_reads.Unreadable as e:
            log.warning("disk grants off for this client: %s", e)
            self.disk_path = ""
            raise
        except disk_reads.Miss:
            envs.refresh(self.disk_path)  # a data file replaced under a reader opened earlier
            raise

        def tensors() -> Iterator[tuple[int, torch.Tensor]]:
            if out.flat is not None:
                out.finish_flat()
                return
            for i in range(len(out.flats)):
                yield i, out.finish_one(i)

        return Restoring(info, tensors())

    def prepare(self, devices: set[torch.device]) -> None:
        if not self.pinned:
            gpu = next((d for d in devices if d.type == "cuda"), None)
            if gpu is not None:
                # Page-lock the mapping, once per process (the mapping is shared by its
                # clients), on the first call that moves GPU tensors through it or at a
                # connector's start, so D2H/H2D go straight in and out; a CPU-only user
                # never creates a CUDA context for it.
                self.pinned = self.mapping.pin(cuda.indexed(gpu))

    @classmethod
    def open(cls, rpc: Rpc, hello: pb.HelloResponse) -> "Transport":
        a = hello.arena
        if "shm" not in hello.transports or not a.path:
            raise TransportUnavailable("the daemon has no shared-memory arena")
        if a.hostname != socket.gethostname() or (a.boot_id and a.boot_id != boot_id()):
            raise TransportUnavailable(f"the daemon runs on another host ({a.hostname})")
        try:
            mapping = mappings.open_arena(a.path, a.size)
        except OSError as e:
            raise TransportUnavailable(f"cannot map arena {a.path}: {e}") from None
        return cls(rpc, hello, mapping)

    def _unmap(self) -> None:
        self.pinned = False
        self.mapping.close()  # the process's last use unpins and unmaps it


class CudaIpc(_Pool):
    """The daemon's device pool, opened through CUDA IPC on the same GPU."""

    name = "cuda_ipc"
    tier = "device"

    @classmethod
    def open(cls, rpc: Rpc, hello: pb.HelloResponse) -> "Transport":
        d = hello.device
        if "cuda_ipc" not in hello.transports or not d.ipc_handle:
            raise TransportUnavailable("the daemon has no CUDA device tier")
        device = cuda.local_device_for(d.uuid)
        if device is None:
            raise TransportUnavailable(f"this process cannot see the daemon's GPU ({d.device}, {d.uuid})")
        try:
            pool = cuda.open_ipc(d.ipc_handle, d.size, device)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise TransportUnavailable(f"cannot open the device pool's IPC handle: {e}") from None
        return cls(rpc, hello, pool)


TRANSPORTS: dict[str, type[Transport]] = {t.name: t for t in (CudaIpc, Shm, Inline)}
# What ``auto`` opens at connect, in order (inline always opens). cuda_ipc is not among
# them: under auto it is used per call, for tensors on the daemon's GPU (``Client``
# opens it on the first such call), so a process that never hands over CUDA tensors
# never creates a CUDA context for it.
AUTO = ("shm", "inline")


def negotiate(rpc: Rpc, hello: pb.HelloResponse, want: str) -> Transport:
    """The transport ``want`` names, or with ``auto`` the first of ``AUTO`` that opens (silently)."""
    for name in AUTO if want == "auto" else (want,):
        try:
            return TRANSPORTS[name].open(rpc, hello)
        except TransportUnavailable as e:
            if want != "auto":
                raise TransportUnavailable(f"transport {name!r} is not possible: {e}") from None
    raise KVParkError("no transport opened")  # unreachable: inline always opens
