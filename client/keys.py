"""Chained content keys of token blocks, shared by the HF, paged and vLLM adapters.

A full block of ``block_size`` token ids is keyed by xxh3-128 of (parent key, the block's
token ids as little-endian int64); the first block's parent is the hash of the layout
fingerprint. The same tokens under the same layout give the same keys in every process
and after restarts, so equal prefixes share blocks (dedup) and ``lookup`` finds them.

Primitives:
- ``tokens(ids) -> np.ndarray``: normalise a list, tensor or array of token ids (1-D
  little-endian int64); ``InvalidArgument`` otherwise.
- ``block_keys(fingerprint, ids, block_size, n_blocks=None) -> list[str]``.
- ``extend(chain, fingerprint, ids, block_size)``: append the keys of the full blocks
  in ``ids`` (the tokens after those ``chain`` already covers) to ``chain``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import xxhash

from kvpark.proto.errors import InvalidArgument

PREFIX = "kvblk-"

TokenIds = Sequence[int] | torch.Tensor | np.ndarray


def tokens(ids: TokenIds) -> np.ndarray:
    arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgument("tokens must be a 1-D sequence of token ids")
    return arr.astype("<i8", copy=False)


def extend(chain: list[str], fingerprint: str, ids: TokenIds, block_size: int) -> list[str]:
    arr = tokens(ids)
    parent = bytes.fromhex(chain[-1][len(PREFIX):]) if chain else xxhash.xxh3_128_digest(fingerprint.encode())
    for j in range(len(arr) // block_size):  # inherently sequential: each key chains its parent
        parent = xxhash.xxh3_128_digest(parent + arr[j * block_size : (j + 1) * block_size].tobytes())
        chain.append(PREFIX + parent.hex())
    return chain


def block_keys(fingerprint: str, ids: TokenIds, block_size: int, n_blocks: int | None = None) -> list[str]:
    """Chained keys of the full token blocks of ``ids`` (at most ``n_blocks`` of them)."""
    arr = tokens(ids)
    if n_blocks is not None:
        arr = arr[: max(0, n_blocks) * block_size]
    return extend([], fingerprint, arr, block_size)
