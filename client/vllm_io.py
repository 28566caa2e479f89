"""The vLLM connector's data path: gather/scatter of KV blocks and the background saver.

Free of vLLM imports, so it runs (and is tested) wherever kvpark does.

Primitives:
- ``STATS``: process-wide counters of the connector (lookups, hit blocks, loads, saves,
  their microseconds, failures by kind). ``miss(kind, err)``: count and log a failure
  (one line per kind, then every 100th); never raises.
- ``block_dim_of(layers, block_size) -> int | None``: where the block index sits in a KV
  layer (FlashAttention ``[2, blocks, block_size, heads, dim]``: 1; CPU backend: 0).
- ``gather_blocks(layers, block_dim, ids) -> Tensor``: a snapshot of blocks ``ids``, all
  layers of a block together (``[n, L, *block]``), in memory of its own.
- ``scatter_blocks(layers, block_dim, ids, packed)``: the inverse.
- ``load_blocks(client, layers, block_dim, ids, keys, stage_bytes)`` and
  ``save_blocks(client, layers, block_dim, ids, keys, attrs, stage_bytes)``: synchronous
  restore/park in bounded chunks.
- ``Conn(address, transport, connect_timeout_s=5)``: a lazily (re)connected ``Client``
  that fails fast (for a two-second back-off) while the daemon is down. ``get(timeout)``;
  ``bounded(seconds)``: a block whose calls, the connect included, end within ``seconds``.
- ``BackgroundSaver(conn, timeout_s, max_pending_bytes, max_wait_s=0.005)``:
  ``submit(keys, packed, attrs, ready=None)`` (``ready``: ``cuda.record_event`` after the
  gather, None off CUDA) queues a snapshot and returns at once (or
  within ``max_wait_s`` when the queue is full, dropping it); one thread parks the
  snapshots in order. Each
  save has a deadline of ``timeout_s`` from its submission: it is committed by then, or
  it is a counted, logged failure. ``drain(timeout)``; ``close(timeout)``.
- ``wait_for_saves(timeout=None) -> bool``: drain every live saver of this process.

Why a snapshot: once the engine step that filled a block returns, the engine may free
and reuse it. The gather copies the blocks into memory the saver owns, so the park can
run after the step without holding any block and without ever reading a reused one.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from kvpark.proto.errors import DeadlineExceeded, Unavailable
from kvpark.tiers import cuda

from .client import Client

log = logging.getLogger("kvpark.vllm")
STATS: Counter[str] = Counter()
_logged: set[str] = set()
_stats_lock = threading.Lock()


def count(key: str, n: int = 1) -> None:
    """Add to a counter; the saver thread and the engine's thread both count."""
    with _stats_lock:
        STATS[key] += n


def miss(kind: str, err: BaseException) -> None:
    """Count a failure and log it once per kind (then every 100th), never raise."""
    with _stats_lock:
        STATS[f"errors.{kind}"] += 1
        n = STATS[f"errors.{kind}"]
        first = kind not in _logged
        _logged.add(kind)
    if first or n % 100 == 0:
        log.warning("kvpark %s failed (%s: %s); treated as a cache miss [%d so far]", kind, type(err).__name__,
                    err, n)


def block_dim_of(layers: list[torch.Tensor], block_size: int) -> int | None:
    """The dimension that indexes blocks in these KV layers, or None for an unknown layout."""
    shapes = {tuple(t.shape) for t in layers}
    if not layers or len(shapes) != 1:
        return None
    first = layers[0]
    if first.dim() == 5 and first.shape[0] == 2:
        return 1  # FlashAttention: [2, num_blocks, block_size, heads, head_dim]
    if first.dim() == 4 and first.shape[2] == block_size:
        return 0  # CPU backend: [num_blocks, heads, block_size, 2*head_dim]
    return None


def block_bytes(layers: list[torch.Tensor], block_dim: int) -> int:
    """Bytes of one block, all layers."""
    return sum(t.numel() * t.element_size() // t.shape[block_dim] for t in layers)


def _per_chunk(layers: list[torch.Tensor], block_dim: int, stage_bytes: int) -> int:
    return max(1, stage_bytes // max(1, block_bytes(layers, block_dim)))


def _block_shape(layers: list[torch.Tensor], block_dim: int) -> tuple[int, ...]:
    s = list(layers[0].shape)
    del s[block_dim]
    return tuple(s)


def gather_blocks(layers: list[torch.Tensor], block_dim: int, ids: list[int]) -> torch.Tensor:
    """Blocks ``ids`` of every layer, copied into one new ``[n, L, *block]`` tensor."""
    dev = layers[0].device
    idx = cuda.as_index(ids, dev)  # no stream sync on a GPU
    packed = torch.empty((len(ids), len(layers), *_block_shape(layers, block_dim)), dtype=layers[0].dtype,
                         device=dev)
    for layer, kv in enumerate(layers):
        src = kv.index_select(block_dim, idx)
        if block_dim == 1:
            src = src.transpose(0, 1)  # [2, n, ...] -> [n, 2, ...]
        packed[:, layer].copy_(src)
    return packed


def scatter_blocks(layers: list[torch.Tensor], block_dim: int, ids: list[int], packed: torch.Tensor) -> None:
    """Write ``packed`` (``[n, L, *block]``) into blocks ``ids`` of every layer."""
    idx = cuda.as_index(ids, layers[0].device)
    for layer, kv in enumerate(layers):
        src = packed[:, layer]
        if block_dim == 1:
            src = src.transpose(0, 1)  # [n, 2, ...] -> [2, n, ...]
        kv.index_copy_(block_dim, idx, src)


def staging_for(layers: list[torch.Tensor], block_dim: int, n: int) -> torch.Tensor:
    """An uninitialised ``[n, L, *block]`` tensor on the layers' device."""
    return torch.empty((n, len(layers), *_block_shape(layers, block_dim)), dtype=layers[0].dtype,
                       device=layers[0].device)


def load_blocks(client: Client, layers: list[torch.Tensor], block_dim: int, ids: list[int], keys: list[str],
                stage_bytes: int) -> int:
    """Restore ``keys`` and scatter them into block ``ids`` of every layer, a bounded chunk
    at a time through one reused staging tensor. Returns how many blocks landed; raises
    on the first failure (blocks from there on are not loaded)."""
    step = _per_chunk(layers, block_dim, stage_bytes)
    staging = staging_for(layers, block_dim, min(step, len(ids)))
    done = 0
    for lo in range(0, len(ids), step):
        n = min(step, len(ids) - lo)
        chunk = staging[:n]
        client.restore_many(keys[lo : lo + n], into_flat=chunk)
        scatter_blocks(layers, block_dim, ids[lo : lo + n], chunk)
        done += n
    return done


def save_blocks(client: Client, layers: list[torch.Tensor], block_dim: int, ids: list[int], keys: list[str],
                attrs: dict[str, str], stage_bytes: int) -> int:
    """Gather block ``ids`` of every layer and park each as ``keys[i]`` (all layers of one
    block together, ``[L, *block]``), a bounded chunk at a time. Returns bytes new to kvpark."""
    step = _per_chunk(layers, block_dim, stage_bytes)
    new = 0
    for lo in range(0, len(ids), step):
        packed = gather_blocks(layers, block_dim, ids[lo : lo + step])
        new += client.park_batch({key: [packed[j]] for j, key in enumerate(keys[lo : lo + step])}, attrs=attrs)
    return new


class Conn:
    """A lazily (re)connected client; while the daemon is down, calls fail fast."""

    def __init__(self, address: str, transport: str, connect_timeout_s: float = 5.0) -> None:
        self.address = address
        self.transport = transport
        self.connect_timeout_s = connect_timeout_s
        self._client: Client | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def get(self, timeout: float | None = None) -> Client:
        """The client; connecting, when there is none, within ``timeout`` (at most
        ``connect_timeout_s``)."""
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._retry_at:
                raise ConnectionError(f"kvpark daemon at {self.address} was unreachable; retrying later")
            budget = self.connect_timeout_s if timeout is None else min(self.connect_timeout_s, timeout)
            try:
                client = Client(self.address, timeout=budget, transport=self.transport)
            except Exception:
                self._retry_at = time.monotonic() + 2.0
                raise
            # The Hello had the caller's budget; calls outside a deadline (lease
            # releases) get the connection's own.
            client.rpc.default_timeout = self.connect_timeout_s
            self._client = client
            return client

    @contextmanager
    def bounded(self, seconds: float) -> Iterator[Client]:
        """The client, and every call inside the block, the connect included, ends within
        ``seconds``: a step's lookup or load never waits longer than its own timeout."""
        end = time.monotonic() + seconds
        client = self.get(seconds)
        left = end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"connecting to {self.address} took all of {seconds:.2f}s")
        with client.deadline(left):
            yield client

    def reset(self) -> None:
        with self._lock:
            if self._client is not None:
                try:
                    self._client.close()
                except Exception:  # noqa: BLE001 - closing a broken channel
                    pass
            self._client = None
            self._retry_at = time.monotonic() + 2.0

    def failed(self, kind: str, e: BaseException) -> None:
        """Count a failed call; after a dead or hung daemon, reconnect later (after a
        back-off), not on every request."""
        miss(kind, e)
        if isinstance(e, (Unavailable, DeadlineExceeded)):
            self.reset()


@dataclass
class _Save:
    keys: list[str]
    packed: torch.Tensor  # [n, L, *block]: the snapshot, owned by the saver
    attrs: Mapping[str, str]
    deadline: float  # time.monotonic(): committed by then or failed
    ready: Any = None  # a CUDA event recorded after the gather, on the stream that ran it

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


_SAVERS: "weakref.WeakSet[BackgroundSaver]" = weakref.WeakSet()


class BackgroundSaver:
    """Parks snapshots from one thread, in submission order, each under its own deadline.

    ``submit`` never waits on the daemon. It waits only while the snapshots not yet
    parked hold more than ``max_pending_bytes`` (one snapshot is always accepted), and
    then at most ``max_wait_s`` (a few ms: it runs inside the engine's step) and never
    past that snapshot's own deadline: then the snapshot is dropped and counted
    (``saves_dropped``, ``errors.save``).

    A snapshot on a GPU carries ``ready``, an event recorded after the gather on the
    stream that ran it: the saver waits on it before reading a byte, whatever stream
    either side runs on, so a half-gathered snapshot is never saved. The saver's CUDA
    calls run under the snapshot's device (a thread that never chose one would open a
    context on GPU 0). A save that fails (daemon down, timeout, an error) is logged and counted
    (``errors.save``); it never reaches the engine and never leaves a partial block
    behind (a park commits all of its blocks or none).
    """

    def __init__(self, conn: Conn, timeout_s: float, max_pending_bytes: int, max_wait_s: float = 0.005) -> None:
        self.conn = conn
        self.timeout_s = float(timeout_s)
        self.max_pending_bytes = int(max_pending_bytes)
        self.max_wait_s = float(max_wait_s)
        self._queue: deque[_Save] = deque()
        self._pending_bytes = 0  # queued + the one being parked
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvpark-saver", daemon=True)
        self._thread.start()
        _SAVERS.add(self)

    def submit(self, keys: list[str], packed: torch.Tensor, attrs: Mapping[str, str], ready: Any = None) -> bool:
        """Queue a snapshot (``packed[j]`` is ``keys[j]``; ``ready``: the event after its
        gather, for one on a GPU); returns whether it was accepted."""
        now = time.monotonic()
        save = _Save(keys, packed, dict(attrs), now + self.timeout_s, ready)
        give_up = min(save.deadline, now + self.max_wait_s)
        with self._cv:
            while (not self._closed and self._pending_bytes
                   and self._pending_bytes + save.nbytes > self.max_pending_bytes):
                left = give_up - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            if self._closed or (self._pending_bytes and
                                self._pending_bytes + save.nbytes > self.max_pending_bytes):
                why = "the saver is closed" if self._closed else "the save queue stayed full"
                count("saves_dropped")
                miss("save", TimeoutError(f"{len(keys)} blocks not saved: {why}"))
                return False
            self._queue.append(save)
            self._pending_bytes += save.nbytes
            self._cv.notify_all()
        count("saves_queued")
        return True

    @property
    def pending(self) -> int:
        """Snapshots accepted and not yet committed or failed."""
        with self._cv:
            return len(self._queue) + int(self._busy)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every accepted snapshot is committed or has failed; False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float | None = None) -> int:
        """Finish the accepted snapshots (each within its own deadline), then stop.

        Returns how many were still unfinished at ``timeout`` (default: the save
        deadline); those are logged and counted as failed saves, never silently lost."""
        with self._cv:
            if self._closed:
                return 0
            self._closed = True
            self._cv.notify_all()
        self.drain(self.timeout_s + 1.0 if timeout is None else timeout)
        with self._cv:
            left = len(self._queue) + int(self._busy)
            abandoned = list(self._queue)
            self._queue.clear()
            self._pending_bytes -= sum(s.nbytes for s in abandoned)
            self._cv.notify_all()
        if left:
            count("saves_abandoned", left)
            miss("save", TimeoutError(f"{left} saves ({sum(len(s.keys) for s in abandoned)} blocks queued) "
                                      "unfinished at shutdown"))
        self._thread.join(1.0)
        return left

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return  # closed and drained
                save = self._queue.popleft()
                self._busy = True
            try:
                self._park(save)
            finally:
                with self._cv:
                    self._busy = False
                    self._pending_bytes -= save.nbytes
                    self._cv.notify_all()

    def _park(self, save: _Save) -> None:
        left = save.deadline - time.monotonic()
        t0 = time.perf_counter()
        try:
            if left <= 0:
                raise DeadlineExceeded(f"{len(save.keys)} blocks waited {self.timeout_s:.1f}s to be saved")
            # Its own current stream: the park's lease waits and copies then queue behind
            # nothing but the saver's own work, not the model's on the default stream.
            dev = save.packed.device
            with cuda.on_device(dev), cuda.on_stream(dev, "saver"):
                if save.ready is not None:
                    save.ready.synchronize()  # the gather has landed (a blocking event: no spin)
                with self.conn.bounded(left) as client:  # the connect counts against the save's deadline too
                    client.park_batch({key: [save.packed[j]] for j, key in enumerate(save.keys)}, attrs=save.attrs)
        except Exception as e:  # noqa: BLE001 - a failed save only costs a future miss
            self.conn.failed("save", e)
            return
        count("saves")
        count("saved_blocks", len(set(save.keys)))
        count("save_us", int((time.perf_counter() - t0) * 1e6))


def wait_for_saves(timeout: float | None = None) -> bool:
    """Wait until every save this process's connectors accepted is committed or failed."""
    end = None if timeout is None else time.monotonic() + timeout
    ok = True
    for saver in list(_SAVERS):
        ok = saver.drain(None if end is None else max(0.0, end - time.monotonic())) and ok
    return ok


@atexit.register
def _close_all() -> None:
    # An engine that exits without shutting its connector down still finishes (or
    # reports) the saves it accepted: the saver thread is a daemon thread, alive until
    # interpreter teardown, which runs after this.
    for saver in list(_SAVERS):
        saver.close()
