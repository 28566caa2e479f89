"""Park a request's paged KV blocks, restore them into other block ids, and continue.

A toy single-layer-stack "engine" keeps KV in a vLLM-style paged pool
(``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer) and decodes with a tiny
random-weight Llama whose per-step KV it writes into those blocks. Halfway through, the
request's blocks are parked in a running kvpark daemon and freed; later they are
restored into *different* block ids and decoding resumes. Prints whether the tokens match
an uninterrupted run. A second request that shares the prompt then restores the prompt's
blocks from the shared prefix store.

    kvpark serve &
    python examples/paged_park.py
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvpark.client import Client
from kvpark.client import paged

BLOCK = 8


def to_blocks(cache: DynamicCache, kv_caches: list[torch.Tensor], block_ids: list[int]) -> int:
    """Copy an HF cache (batch 1) into paged blocks; returns the token count."""
    n = cache.get_seq_length()
    for layer, kv in zip(cache.layers, kv_caches):
        for side, t in enumerate((layer.keys[0], layer.values[0])):  # [H, S, D]
            padded = torch.zeros(t.shape[0], len(block_ids) * BLOCK, t.shape[2], dtype=t.dtype)
            padded[:, :n] = t
            # [H, nb*bs, D] -> [nb, bs, H, D] into the pool's blocks
            kv[side, block_ids] = padded.reshape(t.shape[0], len(block_ids), BLOCK, t.shape[2]).permute(1, 2, 0, 3)
    return n


def from_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], n: int, config: LlamaConfig) -> DynamicCache:
    cache = DynamicCache(config=config)
    for i, kv in enumerate(kv_caches):
        k, v = (kv[side, block_ids].permute(2, 0, 1, 3).reshape(kv.shape[3], -1, kv.shape[4])[:, :n] for side in (0, 1))
        cache.update(k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous(), layer_idx=i)
    return cache


@torch.no_grad()
def decode(model: LlamaForCausalLM, cache: DynamicCache, nxt: int, n: int) -> tuple[list[int], int]:
    out = []
    for _ in range(n):
        out.append(nxt)
        nxt = int(model(input_ids=torch.tensor([[nxt]]), cache=cache).logits[0, -1].argmax())
    return out, nxt


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    head_dim = config.hidden_size // config.num_attention_heads
    pool = [torch.zeros(2, 64, BLOCK, config.num_key_value_heads, head_dim) for _ in range(config.num_hidden_layers)]
    prompt = list(range(3, 3 + 24))

    ref_cache = DynamicCache(config=config)
    first = int(model(input_ids=torch.tensor([prompt]), cache=ref_cache).logits[0, -1].argmax())
    reference, _ = decode(model, ref_cache, first, 24)

    cache = DynamicCache(config=config)
    first = int(model(input_ids=torch.tensor([prompt]), cache=cache).logits[0, -1].argmax())
    head, pending = decode(model, cache, first, 12)
    blocks = [3, 17, 4, 40, 9]  # this request's block table
    n = to_blocks(cache, pool, blocks)
    with Client() as client:
        tokens = prompt + head
        info = paged.park_blocks(client, "example-req", pool, blocks, num_tokens=n, tokens=tokens)
        print(f"parked {n} tokens ({info.nbytes} bytes, {len(info.refs)} shared blocks) over {client.transport}")
        for kv in pool:
            kv.zero_()  # the engine reuses the memory
        new_blocks = [50, 51, 52, 53, 54]
        assert paged.restore_blocks(client, "example-req", pool, new_blocks) == n
        resumed = from_blocks(pool, new_blocks, n, config)
        tail, _ = decode(model, resumed, pending, 12)
        print("uninterrupted:", reference)
        print("parked/resumed:", head + tail)
        print("tokens match:", head + tail == reference)
        # Another request with the same prompt finds its prefix stored.
        hit = paged.lookup(client, pool, prompt + [1, 2, 3])
        print(f"a new request with the same prompt finds {hit} of its {len(prompt) + 3} tokens stored")
        client.drop("example-req")


if __name__ == "__main__":
    main()
