"""HF transformers adapter (transformers 5.x): park and restore a ``DynamicCache``.

Primitives:
- ``park_cache(client, seq_id, cache, *, tokens=None, block_size=32, **park_kw) -> SeqInfo``
- ``restore_cache(client, seq_id, *, config=None, device=None) -> DynamicCache``

Layer tensors are ``cache.layers[i].keys`` / ``.values``, shaped (batch, kv_heads, seq,
head_dim). Full-attention (``DynamicLayer``) and sliding-window
(``DynamicSlidingWindowLayer``) layers are covered; a sliding layer keeps its window
and its true ``cumulative_length`` (which the attention mask needs). Any other cache or
layer type is refused with ``InvalidArgument`` rather than rebuilt wrong.

Without ``tokens`` the payload is one tensor per layer and per K/V, so
``restore(..., layerwise=True)`` readiness is per layer. With ``tokens`` (full-attention
caches, batch 1), whole ``block_size``-token blocks are content-addressed exactly as in
``kvpark.client.paged`` and shared across sequences; the remainder is stored with the
sequence.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch
import xxhash

from kvpark.proto.errors import InvalidArgument, LayoutMismatch
from kvpark.proto.layout import dtype_name
from kvpark.proto.types import SeqInfo

from .client import Client
from .keys import TokenIds, block_keys as chained_keys, tokens as token_ids

ADAPTER = "hf-dynamic-v1"


def _classes() -> tuple[type, type, type]:
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    except ImportError as e:  # transformers is optional for kvpark itself
        raise InvalidArgument(f"kvpark.client.hf needs transformers >= 5: {e}") from None
    return DynamicCache, DynamicLayer, DynamicSlidingWindowLayer


def _describe(cache: Any) -> tuple[list[Any], list[dict]]:
    DynamicCache, DynamicLayer, Sliding = _classes()
    if not isinstance(cache, DynamicCache):
        raise InvalidArgument(f"unsupported cache type {type(cache).__name__}; kvpark handles DynamicCache")
    layers, kinds = list(cache.layers), []
    if not layers:
        raise InvalidArgument("the cache has no layers")
    for i, layer in enumerate(layers):
        if type(layer) is Sliding:
            kinds.append({"kind": "sliding", "window": int(layer.sliding_window),
                          "cumulative_length": int(layer.cumulative_length)})
        elif type(layer) is DynamicLayer:
            kinds.append({"kind": "full"})
        else:
            raise InvalidArgument(f"layer {i}: unsupported cache layer type {type(layer).__name__}")
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            raise InvalidArgument(f"layer {i} holds no KV yet")
    return layers, kinds


def _fingerprint(layers: list[Any], kinds: list[dict]) -> str:
    first = layers[0].keys
    detail = [(dtype_name(l.keys.dtype), l.keys.shape[1], l.keys.shape[3], k["kind"], k.get("window", 0))
              for l, k in zip(layers, kinds)]
    digest = xxhash.xxh3_64_hexdigest(json.dumps(detail).encode())
    return f"{ADAPTER}:{dtype_name(first.dtype)}:L{len(layers)}:{digest}"


def block_keys(fingerprint: str, tokens: TokenIds, block_size: int) -> list[str]:
    return chained_keys(fingerprint, tokens, block_size)


def park_cache(client: Client, seq_id: str, cache: Any, *, tokens: Sequence[int] | torch.Tensor | None = None,
               block_size: int = 32, **park_kw: Any) -> SeqInfo:
    layers, kinds = _describe(cache)
    fp = _fingerprint(layers, kinds)
    seq_len = int(layers[0].keys.shape[-2]) if kinds[0]["kind"] == "full" else int(kinds[0]["cumulative_length"])
    attrs = {"layout": fp, "layers": json.dumps(kinds), "seq_len": str(seq_len)}
    if tokens is None:
        tensors = [t for l in layers for t in (l.keys, l.values)]
        return client.park(seq_id, tensors, attrs=attrs, **park_kw)
    if any(k["kind"] != "full" for k in kinds):
        raise InvalidArgument("tokens= (prefix sharing) needs full-attention layers; this cache has sliding ones")
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be > 0, got {block_size}")
    k0 = layers[0].keys
    if k0.shape[0] != 1:
        raise InvalidArgument(f"tokens= (prefix sharing) needs batch size 1, got {k0.shape[0]}")
    if any(l.keys.shape != k0.shape for l in layers):
        raise InvalidArgument("tokens= (prefix sharing) needs every layer to have the same shape")
    arr = token_ids(tokens)
    if len(arr) != seq_len:
        raise InvalidArgument(f"tokens has {len(arr)} ids; the cache holds {seq_len} positions")
    # [L, 2, H, S, D], then whole token blocks [n, L, 2, H, bs, D] and the remainder.
    kv = torch.stack([torch.stack([l.keys[0], l.values[0]]) for l in layers])
    keys = block_keys(fp, arr, block_size)
    n = len(keys)
    L, _, H, S, D = kv.shape
    full = kv[:, :, :, : n * block_size].reshape(L, 2, H, n, block_size, D).permute(3, 0, 1, 2, 4, 5).contiguous()
    rest = kv[:, :, :, n * block_size :].contiguous()
    present = client.present(keys) if keys else []
    new = {k: [full[j]] for j, k in enumerate(keys) if not present[j]}
    attrs["block_size"] = str(block_size)
    attrs["shared_blocks"] = str(n)
    return client.park(seq_id, [rest], attrs=attrs, refs=keys, new_blocks=new, **park_kw)


def restore_cache(client: Client, seq_id: str, *, config: Any = None,
                  device: torch.device | str | None = None) -> Any:
    DynamicCache, _, _ = _classes()
    info, tensors = client.restore_many([seq_id], device=device)
    layout = info.attrs.get("layout", "")
    if not layout.startswith(ADAPTER):
        raise LayoutMismatch(f"sequence {seq_id!r} was not parked by kvpark.client.hf (layout {layout or '(none)'})")
    kinds = json.loads(info.attrs["layers"])
    if "shared_blocks" in info.attrs:
        pairs = _unblock(tensors, int(info.attrs["shared_blocks"]), len(kinds))
    else:
        pairs = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(len(kinds))]
    if config is None:
        # Layer types come from what was parked: a window tensor makes a sliding layer.
        data = [(k, v, torch.tensor(kind["window"])) if kind["kind"] == "sliding" else (k, v)
                for (k, v), kind in zip(pairs, kinds)]
        cache = DynamicCache(ddp_cache_data=data)
    else:
        cache = DynamicCache(config=config)
        _check_config(cache, kinds, seq_id)
        for i, (k, v) in enumerate(pairs):
            cache.update(k, v, layer_idx=i)
    for layer, kind in zip(cache.layers, kinds):
        if kind["kind"] == "sliding":
            layer.cumulative_length = int(kind["cumulative_length"])  # the mask needs the true length
    return cache


def _unblock(tensors: list[torch.Tensor], n: int, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rest = tensors[n]  # [L, 2, H, r, D]
    if n:
        blocks = torch.stack(tensors[:n])  # [n, L, 2, H, bs, D]
        _, L, _, H, bs, D = blocks.shape
        full = blocks.permute(1, 2, 3, 0, 4, 5).reshape(L, 2, H, n * bs, D)
        kv = torch.cat([full, rest], dim=3)
    else:
        kv = rest
    assert kv.shape[0] == num_layers
    return [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(num_layers)]


def _check_config(cache: Any, kinds: list[dict], seq_id: str) -> None:
    _, _, Sliding = _classes()
    have = ["sliding" if type(l) is Sliding else "full" for l in cache.layers]
    want = [k["kind"] for k in kinds]
    if have and have != want:
        raise LayoutMismatch(f"sequence {seq_id!r} has layer kinds {want}; the config builds {have}")
