"""vLLM KV connector: kvpark as the offload tier and shared prefix store of a vLLM engine.

Load it with no vLLM patching::

    KVTransferConfig(kv_connector="KVParkConnector", kv_connector_module_path="kvpark.client.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"address": "127.0.0.1:50551"})

Primitives:
- ``KVParkConnector``: a ``KVConnectorBase_V1``; one instance per role (scheduler, worker).
- ``KVParkMetadata``: what the scheduler tells the worker each step (plain lists; it is
  pickled between processes in multi-process mode).
- ``STATS``: process-wide counters (lookups, hit blocks, loads, saves, their microseconds,
  failures by kind).
- ``layout_fingerprint(vllm_config, kv_cache_config) -> str``.
- ``block_dim_of(layers, block_size) -> int | None``: where the block index sits in a KV
  layer (FlashAttention ``[2, blocks, block_size, heads, dim]``: 1; CPU backend: 0).
- ``load_blocks(client, layers, block_dim, ids, keys, stage_bytes)`` and
  ``save_blocks(client, layers, block_dim, ids, keys, attrs, stage_bytes)``: the worker's
  gather/scatter between the engine's KV layers and kvpark, in bounded chunks.

What is stored: every *full* KV block a request computes, all layers together, as one
plain kvpark sequence whose id is a chained content hash (layout fingerprint, parent key,
the block's token ids). A later request, in this engine, another one, or after a daemon
restart, that starts with the same tokens finds those keys with one ``Lookup`` and loads
them into its freshly allocated blocks. Blocks are opaque bytes: the layout fingerprint
covers model, dtype, block size, KV heads, head size, layer count and the platform's
kernel layout, so bytes are never read under another layout.

Loads are restored and scattered into the engine's blocks inside ``start_load_kv``,
before the forward pass, so every attention path (full CUDA graphs too, which never call
``wait_for_layer_load``) reads loaded blocks. Loads and saves move at most
``stage_bytes`` of blocks at a time: the staging tensors live inside the engine's memory
budget.

Extra config keys: ``address`` (default ``$KVPARK_ADDRESS`` or 127.0.0.1:50551),
``lookup_timeout_s`` (0.5), ``load_timeout_s`` (10), ``save_timeout_s`` (10),
``stage_bytes`` (256 MiB), ``transport`` ("auto"; the workers' data path, the scheduler
always uses "inline"), ``cpu_amx_init`` (true).

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
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpark.proto.errors import DeadlineExceeded, Unavailable
from kvpark.proto.layout import dtype_name
from kvpark.tiers import cuda

from .keys import extend as extend_keys
from .amx import request_amx_permission
from .client import Client

log = logging.getLogger("kvpark.vllm")
STATS: Counter[str] = Counter()
_logged: set[str] = set()


def _miss(kind: str, err: BaseException) -> None:
    """Count a failure and log it once per kind (then every 100th), never raise."""
    STATS[f"errors.{kind}"] += 1
    n = STATS[f"errors.{kind}"]
    if kind not in _logged or n % 100 == 0:
        _logged.add(kind)
        log.warning("kvpark %s failed (%s: %s); treated as a cache miss [%d so far]", kind, type(err).__name__,
                    err, n)


def _on_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - an unknown platform is not the CPU one
        return False


def _flag(value: Any) -> bool:
    """A boolean extra-config value; JSON configs may carry it as a string."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


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


def _per_chunk(layers: list[torch.Tensor], block_dim: int, stage_bytes: int) -> int:
    per_block = sum(t.numel() * t.element_size() // t.shape[block_dim] for t in layers)
    return max(1, stage_bytes // max(1, per_block))


def _block_shape(layers: list[torch.Tensor], block_dim: int) -> tuple[int, ...]:
    s = list(layers[0].shape)
    del s[block_dim]
    return tuple(s)


def load_blocks(client: Client, layers: list[torch.Tensor], block_dim: int, ids: list[int], keys: list[str],
                stage_bytes: int) -> int:
    """Restore ``keys`` and scatter them into block ``ids`` of every layer, a bounded chunk
    at a time through one reused staging tensor. Returns how many blocks landed; raises
    on the first failure (blocks from there on are not loaded)."""
    step = _per_chunk(layers, block_dim, stage_bytes)
    L, dev = len(layers), layers[0].device
    staging = torch.empty((min(step, len(ids)), L, *_block_shape(layers, block_dim)), dtype=layers[0].dtype,
                          device=dev)
    done = 0
    for lo in range(0, len(ids), step):
        n = min(step, len(ids) - lo)
        chunk = staging[:n]
        client.restore_many(keys[lo : lo + n], into_flat=chunk)
        idx = torch.as_tensor(ids[lo : lo + n], dtype=torch.long, device=dev)
        for layer, kv in enumerate(layers):
            src = chunk[:, layer]
            if block_dim == 1:
                src = src.transpose(0, 1)  # [n, 2, ...] -> [2, n, ...]
            kv.index_copy_(block_dim, idx, src)
        done += n
    return done


def save_blocks(client: Client, layers: list[torch.Tensor], block_dim: int, ids: list[int], keys: list[str],
                attrs: dict[str, str], stage_bytes: int) -> int:
    """Gather block ``ids`` of every layer and park each as ``keys[i]`` (all layers of one
    block together, ``[L, *block]``), a bounded chunk at a time. Returns bytes new to kvpark."""
    step = _per_chunk(layers, block_dim, stage_bytes)
    dev = layers[0].device
    new = 0
    for lo in range(0, len(ids), step):
        idx = torch.as_tensor(ids[lo : lo + step], dtype=torch.long, device=dev)
        per_layer = [kv.index_select(block_dim, idx) for kv in layers]
        if block_dim == 1:
            per_layer = [t.transpose(0, 1) for t in per_layer]
        packed = torch.stack(per_layer, dim=1)  # [n, L, *block]
        new += client.park_batch({key: [packed[j]] for j, key in enumerate(keys[lo : lo + step])}, attrs=attrs)
    return new


def layout_fingerprint(vllm_config: Any, kv_cache_config: Any) -> str:
    """Everything that decides how a block's bytes are laid out. Same in both roles."""
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if len(groups) != 1:
        raise ValueError(f"kvpark supports one KV cache group; this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if cuda.cuda_available():
        platform = "cuda"
    else:
        platform = f"cpu-{torch.backends.cpu.get_cpu_capability()}"
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


@dataclass
class KVParkMetadata(KVConnectorMetadata):
    loads: list[tuple[str, list[int], list[str]]] = field(default_factory=list)  # (req, block ids, keys)
    saves: list[tuple[str, list[int], list[str]]] = field(default_factory=list)


class _Conn:
    """A lazily (re)connected client; while the daemon is down, calls fail fast."""

    def __init__(self, address: str, transport: str) -> None:
        self.address = address
        self.transport = transport
        self._client: Client | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def get(self) -> Client:
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._retry_at:
                raise ConnectionError(f"kvpark daemon at {self.address} was unreachable; retrying later")
            try:
                self._client = Client(self.address, timeout=5.0, transport=self.transport)
            except Exception:
                self._retry_at = time.monotonic() + 2.0
                raise
            return self._client

    def reset(self) -> None:
        with self._lock:
            if self._client is not None:
                try:
                    self._client.close()
                except Exception:  # noqa: BLE001 - closing a broken channel
                    pass
            self._client = None
            self._retry_at = time.monotonic() + 2.0


class KVParkConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        address = extra.get("address") or os.environ.get("KVPARK_ADDRESS") or "127.0.0.1:50551"
        transport = str(extra.get("transport", "auto"))
        if role == KVConnectorRole.SCHEDULER:
            transport = "inline"  # it only sends lookups: no arena mapping, no CUDA context
        self._conn = _Conn(address, transport)
        self._lookup_timeout = float(extra.get("lookup_timeout_s", 0.5))
        self._load_timeout = float(extra.get("load_timeout_s", 10.0))
        self._save_timeout = float(extra.get("save_timeout_s", 10.0))
        self._stage_bytes = int(extra.get("stage_bytes", 256 << 20))
        self.block_size = int(vllm_config.cache_config.block_size)
        try:
            self.fingerprint = layout_fingerprint(vllm_config, kv_cache_config)
        except ValueError as e:
            _miss("setup", e)
            self.fingerprint = ""
        if role == KVConnectorRole.WORKER and _on_cpu_platform() and _flag(extra.get("cpu_amx_init", True)):
            # Before the engine's first forward, which may attend over KV we load.
            STATS[f"amx.{request_amx_permission()}"] += 1
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
        self._pending_loads: dict[str, tuple[list[int], list[str]]] = {}
        # Worker state.
        self._layers: list[torch.Tensor] = []
        self._block_dim = 0
        self._failed: set[int] = set()

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
        self._reqs[rid] = request
        self._local[rid] = num_computed_tokens
        if not self.fingerprint:
            return 0, False
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // self.block_size  # the last token is always computed by the engine
        if limit <= num_computed_tokens // self.block_size:
            return 0, False
        keys = self._keys(rid, tokens, limit)
        STATS["lookups"] += 1
        try:
            client = self._conn.get()
            with client.deadline(self._lookup_timeout):
                hit = client.lookup(keys) if keys else 0
        except Exception as e:  # noqa: BLE001 - never break the engine
            self._conn_error("lookup", e)
            return 0, False
        self._stored[rid] = max(self._stored.get(rid, 0), hit)
        ext = hit * self.block_size - num_computed_tokens
        if ext <= 0:
            return 0, False
        STATS["hit_blocks"] += ext // self.block_size
        return ext, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        self._reqs[rid] = request
        if num_external_tokens <= 0:
            return
        ids = list(blocks.get_block_ids()[0])
        start = self._local.get(rid, 0) // self.block_size
        n = num_external_tokens // self.block_size
        keys = self._chain.get(rid, [])[start : start + n]
        self._pending_loads[rid] = (ids[start : start + n], keys)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KVParkMetadata()
        for rid, (ids, keys) in self._pending_loads.items():
            meta.loads.append((rid, ids, keys))
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
        for d in (self._reqs, self._blocks, self._chain, self._stored, self._local, self._pending_loads):
            d.pop(rid, None)  # type: ignore[attr-defined]

    def _conn_error(self, kind: str, e: BaseException) -> None:
        _miss(kind, e)
        if isinstance(e, (Unavailable, DeadlineExceeded)):
            self._conn.reset()  # reconnect later (after a back-off), not on every request

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = list(kv_caches.values())
        dim = block_dim_of(layers, self.block_size)
        if dim is None:
            _miss("setup", ValueError(f"unknown KV layout {sorted({tuple(t.shape) for t in layers})}"))
            self.fingerprint = ""
            return
        self._block_dim = dim
        first = layers[0]
        self._layers = layers
        log.info("kvpark connector: %d layers of %s (%s layout), address %s", len(layers), tuple(first.shape),
                 "flash-attn" if self._block_dim else "cpu", self._conn.address)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Restore this step's loads and scatter them into their blocks now, before the
        forward pass: the engine may never call ``wait_for_layer_load`` (full CUDA graphs)."""
        meta = self._meta()
        if meta is None or not meta.loads or not self._layers:
            return
        for rid, ids, keys in meta.loads:
            if not ids:
                continue
            t0 = time.perf_counter()
            try:
                client = self._conn.get()
                with client.deadline(self._load_timeout):
                    done = load_blocks(client, self._layers, self._block_dim, ids, keys, self._stage_bytes)
            except Exception as e:  # noqa: BLE001 - a failed load is a miss, recomputed by the engine
                self._conn_error("load", e)
                STATS["load_failures"] += 1
                self._failed.update(ids)
                continue
            STATS["loads"] += 1
            STATS["loaded_blocks"] += done
            STATS["load_us"] += int((time.perf_counter() - t0) * 1e6)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load was scattered in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks (all layers) are saved together in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is None or not meta.saves or not self._layers:
            return
        ids = [i for _rid, bids, _keys in meta.saves for i in bids]
        keys = [k for _rid, _bids, bkeys in meta.saves for k in bkeys]
        t0 = time.perf_counter()
        try:
            client = self._conn.get()
            with client.deadline(self._save_timeout):
                save_blocks(client, self._layers, self._block_dim, ids, keys, {"layout": self.fingerprint},
                            self._stage_bytes)
        except Exception as e:  # noqa: BLE001 - a failed save only costs a future miss
            self._conn_error("save", e)
            return
        STATS["saves"] += 1
        STATS["saved_blocks"] += len(set(keys))
        STATS["save_us"] += int((time.perf_counter() - t0) * 1e6)

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
        self._conn.reset()
