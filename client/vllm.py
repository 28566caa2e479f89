"""vLLM KV connector: kvpark as the offload tier and shared prefix store of a vLLM engine.

Load it with no vLLM patching::

    KVTransferConfig(kv_connector="KVParkConnector", kv_connector_module_path="kvpark.client.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"address": "127.0.0.1:50551"})

Primitives:
- ``KVParkConnector``: a ``KVConnectorBase_V1``; one instance per role (scheduler, worker).
- ``KVParkMetadata``: what the scheduler tells the worker each step (plain lists and
  ``Grant``s; it is pickled between processes in multi-process mode).
- ``layout_fingerprint(vllm_config, kv_cache_config) -> str``;
  ``block_bytes_of(kv_cache_config) -> int``.
- Re-exported from ``kvpark.client.vllm_io`` (the vLLM-free data path): ``STATS``,
  ``block_dim_of``, ``load_blocks``, ``save_blocks``, ``wait_for_saves(timeout=None)``.

What is stored: every *full* KV block a request computes, all layers together, as one
plain kvpark sequence whose id is a chained content hash (layout fingerprint, parent key,
the block's token ids). A later request, in this engine, another one, or after a daemon
restart, that starts with the same tokens finds those keys with one ``Lookup`` and loads
them into its freshly allocated blocks. Blocks are opaque bytes: the layout fingerprint
covers model, dtype, block size, KV heads, head size, layer count and the platform's
kernel layout, so bytes are never read under another layout.

Saves are off the step: ``wait_for_save`` snapshots the blocks the step filled (one
gather per layer into memory of its own) and hands them to a background thread, which
parks them over its own connection. Each save commits within ``save_timeout_s`` of its
step or is a counted, logged failure; ``shutdown`` (or the interpreter's exit) finishes
the accepted ones or reports them (``kvpark.client.vllm_io.BackgroundSaver``).

Loads take one round trip: the scheduler's ``Lookup`` also acquires the hit when it is
in the daemon's memory (bytes inline when small, else a lease on host arena slots) and
passes the ``Grant`` to the worker, which copies it out and releases the lease off its
path. Otherwise (a disk hit, no arena mapping) the worker restores the blocks itself.
The grant names the daemon instance that leased it: a worker whose arena mapping is of
an older start of the daemon re-maps before it copies, and a grant of a start that is
gone (or one the daemon restarts under mid-copy) is loaded the usual way instead, never
read from memory of another daemon instance.
Either way they are scattered into the engine's blocks inside ``start_load_kv``, before
the forward pass, so every attention path (full CUDA graphs too, which never call
``wait_for_layer_load``) reads loaded blocks. Loads and snapshots move at most
``stage_bytes`` of blocks at a time: the staging tensors live inside the engine's
memory budget.

A request sent with ``SamplingParams(extra_args={"kv_transfer_params": {"kvpark": "off"}})``
bypasses kvpark: it is neither looked up nor saved.

Extra config keys: ``address`` (default ``$KVPARK_ADDRESS`` or 127.0.0.1:50551),
``lookup_timeout_s`` (0.5), ``load_timeout_s`` (10), ``save_timeout_s`` (10),
``stage_bytes`` (256 MiB), ``save_queue_bytes`` (2 x ``stage_bytes``: snapshots waiting
for the saver), ``save_submit_wait_s`` (0.005: how long a step waits for room in that
queue before it drops the snapshot, counted), ``transport`` ("auto"; the workers' data
path, the scheduler always uses "inline"), ``cpu_amx_init`` (true); parsed and checked by ``kvpark.client.vllm_options``
(a bad value or an unknown key stops the engine's start with ``InvalidArgument``).

On vLLM's CPU platform the worker-role connector asks the kernel for AMX tile permission
when it starts (``kvpark.client.amx``): vLLM's CPU attention otherwise dies with SIGILL on
an AMX CPU when a fresh engine's first forward attends over loaded KV. ``STATS`` records
the outcome as ``amx.<result>``; ``cpu_amx_init = false`` turns it off (for reproducing
the vLLM bug only).

Failure semantics: any kvpark failure (daemon down, timeout, DATA_LOSS, layout mismatch)
becomes a cache miss: one log line per kind, a counter in ``STATS``, and the engine
recomputes. Lookups and loads run under deadlines. A failed load reports its blocks
through ``get_block_ids_with_load_errors``. The connector switches the engine's
``kv_load_failure_policy`` to "recompute" so that such a miss is recomputed, never
turned into an error.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpark.proto.layout import dtype_name
from kvpark.tiers import cuda

from kvpark.proto.errors import LeaseExpired, TransportUnavailable

from .amx import request_amx_permission
from .client import Client, Grant
from .transport import InstanceChanged
from .keys import extend as extend_keys
from . import vllm_options as options
from .vllm_io import (
    STATS,
    BackgroundSaver,
    Conn,
    block_dim_of,
    block_bytes,
    count,
    gather_blocks,
    load_blocks,
    miss,
    save_blocks,
    scatter_blocks,
    staging_for,
    wait_for_saves,
)

log = logging.getLogger("kvpark.vllm")

__all__ = ["KVParkConnector", "KVParkMetadata", "STATS", "block_bytes_of", "block_dim_of", "layout_fingerprint",
           "load_blocks", "save_blocks", "wait_for_saves"]



def _on_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - an unknown platform is not the CPU one
        return False


def _platform_name() -> str:
    """vLLM's device type for this platform ("cuda", "rocm", ...), read without
    initialising CUDA (vLLM decides it through NVML)."""
    try:
        from vllm.platforms import current_platform

        # device_name, not device_type: ROCm reports device_type "cuda" and name "rocm".
        return "cuda" if current_platform.is_cuda() else str(getattr(current_platform, "device_name", "")
                                                             or current_platform.device_type)
    except Exception:  # noqa: BLE001 - an unknown platform gets its own, never-matching name
        return "unknown"


def _opted_out(request: Any) -> bool:
    """A request sent with ``kv_transfer_params={"kvpark": "off"}`` bypasses kvpark."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and "kvpark" in params and not options.flag(params["kvpark"])



def layout_fingerprint(vllm_config: Any, kv_cache_config: Any) -> str:
    """Everything that decides how a block's bytes are laid out. Same in both roles."""
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if len(groups) != 1:
        raise ValueError(f"kvpark supports one KV cache group; this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    # vLLM's platform, not torch.cuda.is_available(): this also runs in the scheduler's
    # process, where initialising CUDA would break every later fork of it.
    if _on_cpu_platform():
        platform = f"cpu-{torch.backends.cpu.get_cpu_capability()}"
    else:
        platform = _platform_name()
    parts = [
        "vllm-v1",
        str(vllm_config.model_config.model),
        dtype_name(spec.dtype),
        f"bs{spec.block_size}",
        f"h{spec.num_kv_heads}",
        f"d{spec.head_size}",
        f"L{len(groups[0].layer_names)}",
        platform,
    ]
    return ":".join(parts)


def block_bytes_of(kv_cache_config: Any) -> int:
    """Bytes of one block, all layers, from the engine's KV cache config (0: unknown)."""
    try:
        group = kv_cache_config.kv_cache_groups[0]
        return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    except Exception:  # noqa: BLE001 - an unknown config: no folded acquire
        return 0


@dataclass
class KVParkMetadata(KVConnectorMetadata):
    # (req, block ids, keys, what the lookup acquired for the leading ids, if anything)
    loads: list[tuple[str, list[int], list[str], Grant | None]] = field(default_factory=list)
    saves: list[tuple[str, list[int], list[str]]] = field(default_factory=list)


class KVParkConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        opts = options.parse(self._kv_transfer_config.kv_connector_extra_config)
        transport = opts.transport
        if role == KVConnectorRole.SCHEDULER:
            transport = "inline"  # it only sends lookups: no arena mapping, no CUDA context
        self._conn = Conn(opts.address, transport)
        self._lookup_timeout = opts.lookup_timeout_s
        self._load_timeout = opts.load_timeout_s
        self._save_timeout = opts.save_timeout_s
        self._stage_bytes = opts.stage_bytes
        # Snapshots not yet parked may hold this much before a step waits for the saver.
        self._save_queue_bytes = opts.save_queue_bytes
        # ... and a step waits at most this long for room, then drops the snapshot.
        self._save_submit_wait = opts.save_submit_wait_s
        self._saver: BackgroundSaver | None = None
        self.block_size = int(vllm_config.cache_config.block_size)
        try:
            self.fingerprint = layout_fingerprint(vllm_config, kv_cache_config)
        except ValueError as e:
            miss("setup", e)
            self.fingerprint = ""
        if role == KVConnectorRole.WORKER and _on_cpu_platform() and opts.cpu_amx_init:
            # Before the engine's first forward, which may attend over KV we load.
            count(f"amx.{request_amx_permission()}", 1)
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A kvpark failure must be a miss the engine recomputes, never a failed request.
            log.info("kvpark: setting kv_load_failure_policy=recompute")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        # Scheduler state.
        self._reqs: dict[str, Any] = {}
        self._blocks: dict[str, list[int]] = {}
        self._chain: dict[str, list[str]] = {}
        self._stored: dict[str, int] = {}  # full blocks known to be in kvpark
        self._local: dict[str, int] = {}  # local prefix-cache hit (tokens) at lookup time
        self._pending_loads: dict[str, tuple[list[int], list[str], Grant | None]] = {}
        self._grants: dict[str, Grant] = {}  # acquired by a lookup, not yet handed to the worker
        # Most blocks one lookup acquires: a grant is copied out through one staging
        # tensor, which must stay within stage_bytes (0: never fold the acquire in).
        per_block = block_bytes_of(kv_cache_config)
        self._grant_max = self._stage_bytes // per_block if per_block else 0
        # Worker state.
        self._layers: list[torch.Tensor] = []
        self._block_dim = 0
        self._failed: set[int] = set()
        self._releaser: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ keys

    def _keys(self, rid: str, tokens: Any, n: int) -> list[str]:
        """Chained content keys of the first ``n`` full blocks (cached per request)."""
        chain = self._chain.setdefault(rid, [])
        bs = self.block_size
        if len(chain) < n:
            extend_keys(chain, self.fingerprint, np.asarray(tokens[len(chain) * bs : n * bs], dtype="<i8"), bs)
        return chain[:n]

    # ------------------------------------------------------------------ scheduler side

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: the engine never waits on kvpark to produce KV

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._local[rid] = num_computed_tokens
        if _opted_out(request):
            return 0, False  # neither looked up nor saved (and never tracked in _reqs)
        self._reqs[rid] = request
        if not self.fingerprint:
            return 0, False
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // self.block_size  # the last token is always computed by the engine
        if limit <= num_computed_tokens // self.block_size:
            return 0, False
        keys = self._keys(rid, tokens, limit)
        count("lookups", 1)
        self._drop_grant(rid)  # asked again (not scheduled last time): a fresh answer
        skip = num_computed_tokens // self.block_size
        try:
            with self._conn.bounded(self._lookup_timeout) as client:
                if self._grant_max > 0:
                    # One round trip: the lookup also acquires the hit (inline when small).
                    hit, grant = client.lookup_acquire(keys, skip=skip, max_ids=self._grant_max,
                                                        tokens_per_block=self.block_size)
                    if grant is not None:
                        self._grants[rid] = grant
                else:
                    hit = client.lookup(keys, tokens_per_block=self.block_size)
        except Exception as e:  # noqa: BLE001 - never break the engine
            self._conn_error("lookup", e)
            return 0, False
        self._stored[rid] = max(self._stored.get(rid, 0), hit)
        ext = hit * self.block_size - num_computed_tokens
        if ext <= 0:
            return 0, False
        count("hit_blocks", ext // self.block_size)
        return ext, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if _opted_out(request):
            return
        self._reqs[rid] = request
        if num_external_tokens <= 0:
            self._drop_grant(rid)
            return
        ids = list(blocks.get_block_ids()[0])
        start = self._local.get(rid, 0) // self.block_size
        n = num_external_tokens // self.block_size
        keys = self._chain.get(rid, [])[start : start + n]
        grant = self._grants.pop(rid, None)
        if grant is not None and grant.count > n:
            self._release(grant)
            grant = None
        self._pending_loads[rid] = (ids[start : start + n], keys, grant)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KVParkMetadata()
        for rid, (ids, keys, grant) in self._pending_loads.items():
            meta.loads.append((rid, ids, keys, grant))
        self._pending_loads.clear()
        for nr in scheduler_output.scheduled_new_reqs:
            self._blocks[nr.req_id] = list(nr.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if rid in resumed:
                self._blocks[rid] = list(new[0]) if new else []  # a resumed request gets a whole new table
            elif new:
                self._blocks.setdefault(rid, []).extend(new[0])
        bs = self.block_size
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self._reqs.get(rid)
            if req is None or not self.fingerprint:
                continue
            tokens = req.all_token_ids
            full = min(req.num_computed_tokens + n, len(tokens)) // bs
            start = self._stored.get(rid, 0)
            table = self._blocks.get(rid, [])
            full = min(full, len(table))
            if full > start:
                meta.saves.append((rid, table[start:full], self._keys(rid, tokens, full)[start:full]))
                self._stored[rid] = full
        for rid in scheduler_output.finished_req_ids:
            self._forget(rid)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Saves happen eagerly each step, so nothing is pending here: free at once.
        self._forget(request.request_id)
        return False, None

    def _forget(self, rid: str) -> None:
        self._drop_grant(rid)
        pending = self._pending_loads.get(rid)
        if pending is not None and pending[2] is not None:
            self._release(pending[2])
        for d in (self._reqs, self._blocks, self._chain, self._stored, self._local, self._pending_loads):
            d.pop(rid, None)  # type: ignore[attr-defined]

    def _conn_error(self, kind: str, e: BaseException) -> None:
        self._conn.failed(kind, e)

    def _drop_grant(self, rid: str) -> None:
        grant = self._grants.pop(rid, None)
        if grant is not None:
            self._release(grant)

    def _release(self, grant: Grant) -> None:
        """End a grant's lease off the calling path (the daemon's lease deadline is the
        backstop when even that fails)."""
        if not grant.lease_id:
            return
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(1, thread_name_prefix="kvpark-release")

        def release() -> None:
            try:
                self._conn.get().release_grant(grant)
            except Exception:  # noqa: BLE001 - the lease expires on its own
                pass

        self._releaser.submit(release)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = list(kv_caches.values())
        dim = block_dim_of(layers, self.block_size)
        if dim is None:
            miss("setup", ValueError(f"unknown KV layout {sorted({tuple(t.shape) for t in layers})}"))
            self.fingerprint = ""
            return
        self._block_dim = dim
        first = layers[0]
        self._layers = layers
        log.info("kvpark connector: %d layers of %s (%s layout), address %s", len(layers), tuple(first.shape),
                 "flash-attn" if self._block_dim else "cpu", self._conn.address)
        if first.device.type == "cuda":
            self._pin_arena(first.device)

    def _pin_arena(self, device: torch.device) -> None:
        """Page-lock this process's arena mapping now, at the connector's start, not inside
        the first ``start_load_kv``. The saver's client shares the mapping. A daemon that
        is down now is not a failure: the first GPU call pins it instead."""
        try:
            with self._conn.bounded(self._load_timeout) as client:
                pinned = client.pin_arena(device)
        except Exception as e:  # noqa: BLE001 - pinned on first use instead
            log.info("kvpark connector: arena not page-locked at start (%s: %s); it will be on first use",
                     type(e).__name__, e)
            return
        count("arena_pinned" if pinned else "arena_unpinned", 1)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Restore this step's loads and scatter them into their blocks now, before the
        forward pass: the engine may never call ``wait_for_layer_load`` (full CUDA graphs)."""
        meta = self._meta()
        if meta is None or not meta.loads or not self._layers:
            return
        for rid, ids, keys, grant in meta.loads:
            if not ids:
                continue
            t0 = time.perf_counter()
            done = 0
            try:
                with self._conn.bounded(self._load_timeout) as client:
                    if grant is not None:
                        done = self._load_grant(client, ids[: grant.count], grant)
                    done += load_blocks(client, self._layers, self._block_dim, ids[done:], keys[done:],
                                        self._stage_bytes) if done < len(ids) else 0
            except Exception as e:  # noqa: BLE001 - a failed load is a miss, recomputed by the engine
                self._conn_error("load", e)
                count("load_failures", 1)
                self._failed.update(ids[done:])
                continue
            count("loads", 1)
            count("loaded_blocks", done)
            count("load_us", int((time.perf_counter() - t0) * 1e6))

    def _load_grant(self, client: Client, ids: list[int], grant: Grant) -> int:
        """Scatter what the scheduler's lookup acquired: no round trip before the copy
        (the lease ends afterwards, off this path). Returns the blocks loaded: 0 when
        this worker cannot read the grant (no shm, or it is too old to read safely) and
        loads them the usual way."""
        try:
            staging = staging_for(self._layers, self._block_dim, len(ids))
            try:
                client.restore_grant(grant, into_flat=staging, release=False)
            except (TransportUnavailable, LeaseExpired, InstanceChanged):
                return 0  # loaded the usual way instead (a restarted daemon: on the new mapping)
            scatter_blocks(self._layers, self._block_dim, ids, staging)
        finally:
            self._release(grant)
        count("grant_loads", 1)
        return len(ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load was scattered in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks (all layers) are saved together in wait_for_save

    def wait_for_save(self) -> None:
        """Snapshot the blocks this step filled and hand them to the background saver.

        The step waits for the gather (one copy of the new blocks) and nothing else: the
        park runs on the saver's thread, after the step, from memory the saver owns."""
        meta = self._meta()
        if meta is None or not meta.saves or not self._layers:
            return
        ids = [i for _rid, bids, _keys in meta.saves for i in bids]
        keys = [k for _rid, _bids, bkeys in meta.saves for k in bkeys]
        saver = self._get_saver()
        t0 = time.perf_counter()
        step = max(1, self._stage_bytes // max(1, block_bytes(self._layers, self._block_dim)))
        try:
            for lo in range(0, len(ids), step):
                packed = gather_blocks(self._layers, self._block_dim, ids[lo : lo + step])
                # The saver reads the snapshot on its own thread and stream: it waits for
                # this event, recorded after the gather on the stream that ran it.
                saver.submit(keys[lo : lo + step], packed, {"layout": self.fingerprint},
                             cuda.record_event(packed.device))
        except Exception as e:  # noqa: BLE001 - a failed save only costs a future miss
            miss("save", e)
        count("save_step_us", int((time.perf_counter() - t0) * 1e6))

    def _get_saver(self) -> BackgroundSaver:
        if self._saver is None:
            # Its own connection: a save never queues behind (or resets) this step's loads.
            conn = Conn(self._conn.address, self._conn.transport, connect_timeout_s=min(5.0, self._save_timeout))
            self._saver = BackgroundSaver(conn, self._save_timeout, self._save_queue_bytes,
                                          max_wait_s=self._save_submit_wait)
        return self._saver

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads and saves complete within their step

    def _meta(self) -> KVParkMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVParkMetadata) else None

    def shutdown(self) -> None:
        """Finish the accepted saves (each within ``save_timeout_s``), report any that did
        not finish, then disconnect."""
        if self._saver is not None:
            self._saver.close()
            self._saver.conn.reset()
        if self._releaser is not None:
            self._releaser.shutdown(wait=True)
        for rid in list(self._grants):
            self._drop_grant(rid)
        self._conn.reset()
