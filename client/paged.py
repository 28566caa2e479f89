"""Paged KV adapter: vLLM-style block pools, plus content-addressed prefix sharing.

``kv_caches`` is one tensor per layer shaped ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (vLLM's FlashAttention layout); a request owns some block ids.

Primitives:
- ``park_blocks(client, seq_id, kv_caches, block_ids, *, num_tokens, tokens=None, **park_kw) -> SeqInfo``
- ``restore_blocks(client, seq_id, kv_caches, block_ids, *, layerwise=False) -> int`` (num_tokens),
  or with ``layerwise=True`` an iterator of layer indices, each yielded once that layer is in place.
- ``lookup(client, kv_caches, tokens) -> int``: leading tokens stored (a multiple of block_size).
- ``restore_prefix(client, kv_caches, tokens, block_ids) -> int``: restore that prefix (as
  much of it as ``block_ids`` holds); returns the tokens restored.
- ``layout_of(kv_caches) -> PagedLayout``; ``block_keys(layout, tokens) -> list[str]``.

Packing: daemon-side, one *token block* is ``[num_layers, 2, block_size, heads, head_dim]``
(whole token block, all layers), so a block can be shared between sequences, and layer
``l`` of every block sits at a fixed offset inside it. Gather and scatter are one
``index_select`` / ``index_copy_`` per layer, never a Python loop per block.

Content addressing: with ``tokens``, each *full* token block is keyed by a chained hash
(xxh3-128) of the layout fingerprint, the parent block's key and the block's token ids,
so identical prefixes map to identical keys across processes and restarts. Those blocks
are parked once as shared, reference-counted daemon blocks; the sequence references them
and stores only its partial last block itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from kvpark.proto.errors import InvalidArgument, LayoutMismatch, NotFound
from kvpark.proto.layout import dtype_name
from kvpark.proto.types import SeqInfo

from .client import Client
from .keys import TokenIds, block_keys as chained_keys, tokens as token_ids

ADAPTER = "paged-fa-v1"


@dataclass(frozen=True)
class PagedLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def fingerprint(self) -> str:
        # Covers everything that decides how a block's bytes are to be read.
        return (f"{ADAPTER}:{dtype_name(self.dtype)}:L{self.num_layers}:bs{self.block_size}"
                f":h{self.num_kv_heads}:d{self.head_dim}")

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


def layout_of(kv_caches: Sequence[torch.Tensor]) -> PagedLayout:
    if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise InvalidArgument("kv_caches must be a non-empty list of per-layer tensors")
    first = kv_caches[0]
    for i, kv in enumerate(kv_caches):
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[0] != 2:
            raise InvalidArgument(
                f"kv_caches[{i}]: expected [2, num_blocks, block_size, num_kv_heads, head_dim], "
                f"got {getattr(kv, 'shape', type(kv).__name__)}"
            )
        if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
            raise InvalidArgument(f"kv_caches[{i}] differs from layer 0 in shape, dtype or device")
    _, nb, bs, h, d = first.shape
    return PagedLayout(len(kv_caches), nb, bs, h, d, first.dtype, first.device)


def block_keys(layout: PagedLayout, tokens: TokenIds, n_blocks: int | None = None) -> list[str]:
    """Chained content keys of the full token blocks of ``tokens`` (stable everywhere)."""
    return chained_keys(layout.fingerprint, tokens, layout.block_size, n_blocks)


def _ids(block_ids: Sequence[int] | torch.Tensor, layout: PagedLayout, n: int) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.long)
    if ids.dim() != 1 or len(ids) < n:
        raise InvalidArgument(f"need {n} block ids, got {len(ids)}")
    ids = ids[:n]
    if n and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_blocks):
        raise InvalidArgument(f"block ids must be in [0, {layout.num_blocks})")
    return ids.to(layout.device)


def gather(kv_caches: Sequence[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """``[n, L, 2, bs, h, d]``: one ``index_select`` per layer, then one packing copy."""
    stacked = torch.stack([kv.index_select(1, ids) for kv in kv_caches])  # [L, 2, n, bs, h, d]
    return stacked.permute(2, 0, 1, 3, 4, 5).contiguous()


def scatter_layer(kv: torch.Tensor, ids: torch.Tensor, data: torch.Tensor, layer: int) -> None:
    """Put layer ``layer`` of packed blocks ``data`` ([n, L, 2, bs, h, d]) into ``kv`` at ``ids``."""
    kv.index_copy_(1, ids, data[:, layer].transpose(0, 1).to(kv.device, non_blocking=True))


def park_blocks(client: Client, seq_id: str, kv_caches: Sequence[torch.Tensor],
                block_ids: Sequence[int] | torch.Tensor, *, num_tokens: int,
                tokens: Sequence[int] | torch.Tensor | None = None, **park_kw: object) -> SeqInfo:
    """Park a request's blocks (in block-table order); with ``tokens``, share full blocks."""
    lay = layout_of(kv_caches)
    if num_tokens < 0:
        raise InvalidArgument(f"num_tokens must be >= 0, got {num_tokens}")
    nb = math.ceil(num_tokens / lay.block_size)
    data = gather(kv_caches, _ids(block_ids, lay, nb))
    attrs = {"layout": lay.fingerprint, "num_tokens": str(num_tokens), "num_blocks": str(nb)}
    if tokens is None:
        return client.park(seq_id, [data], attrs=attrs, **park_kw)  # type: ignore[arg-type]
    arr = token_ids(tokens)
    if len(arr) < num_tokens:
        raise InvalidArgument(f"tokens has {len(arr)} ids for num_tokens={num_tokens}")
    keys = block_keys(lay, arr[:num_tokens])
    present = client.present(keys) if keys else []
    new = {k: [data[j]] for j, k in enumerate(keys) if not present[j]}
    attrs["shared_blocks"] = str(len(keys))
    return client.park(seq_id, [data[len(keys):]], attrs=attrs, refs=keys,  # type: ignore[arg-type]
                       new_blocks=new, **park_kw)


def _check_layout(info: SeqInfo, lay: PagedLayout) -> int:
    have = info.attrs.get("layout", "")
    if have != lay.fingerprint:
        raise LayoutMismatch(f"sequence {info.seq_id!r} was parked with layout {have or '(none)'}; "
                             f"these kv_caches are {lay.fingerprint}")
    return int(info.attrs["num_blocks"])


def restore_blocks(client: Client, seq_id: str, kv_caches: Sequence[torch.Tensor],
                   block_ids: Sequence[int] | torch.Tensor, *, layerwise: bool = False
                   ) -> int | Iterator[int]:
    """Scatter a parked request into ``block_ids`` (may differ from the parking ids).

    Returns ``num_tokens``; with ``layerwise=True`` returns an iterator over layer
    indices, each yielded once that layer is in ``kv_caches`` (then ``num_tokens`` is in
    ``SeqInfo.attrs`` from ``client.info``).
    """
    lay = layout_of(kv_caches)
    info = client.info(seq_id)
    nb = _check_layout(info, lay)
    ids = _ids(block_ids, lay, nb)
    staging = torch.empty((nb, *lay.block_shape), dtype=lay.dtype, device=lay.device)
    client.restore_many([seq_id], into_flat=staging, expect_layout=lay.fingerprint)
    layers = _scatter(kv_caches, ids, staging)
    if layerwise:
        return layers
    for _ in layers:
        pass
    return int(info.attrs["num_tokens"])


def _scatter(kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, staging: torch.Tensor) -> Iterator[int]:
    for layer, kv in enumerate(kv_caches):
        scatter_layer(kv, ids, staging, layer)
        yield layer


def lookup(client: Client, kv_caches: Sequence[torch.Tensor], tokens: Sequence[int] | torch.Tensor) -> int:
    """How many leading tokens of ``tokens`` are stored (a multiple of block_size)."""
    lay = layout_of(kv_caches)
    keys = block_keys(lay, tokens)
    return client.lookup(keys, tokens_per_block=lay.block_size) * lay.block_size if keys else 0


def restore_prefix(client: Client, kv_caches: Sequence[torch.Tensor], tokens: Sequence[int] | torch.Tensor,
                   block_ids: Sequence[int] | torch.Tensor) -> int:
    """Restore the stored prefix of ``tokens`` into ``block_ids``; returns tokens restored."""
    lay = layout_of(kv_caches)
    keys = block_keys(lay, tokens)
    n = client.lookup(keys, tokens_per_block=lay.block_size) if keys else 0
    n = min(n, len(block_ids))  # restore as much of the match as the given blocks hold
    if n == 0:
        return 0
    ids = _ids(block_ids, lay, n)
    staging = torch.empty((n, *lay.block_shape), dtype=lay.dtype, device=lay.device)
    try:
        client.restore_many(keys[:n], into_flat=staging)
    except NotFound:
        return 0  # dropped between the lookup and the restore: a miss, not an error
    for _ in _scatter(kv_caches, ids, staging):
        pass
    return n * lay.block_size
