"""Park a conversation's KV cache mid-generation, restore it, and continue.

Runs a tiny random-weight Llama (built from LlamaConfig; nothing is downloaded),
generates greedily, parks the DynamicCache in a running kvpark daemon halfway, drops
the local cache, restores it and finishes. Prints whether the tokens match an
uninterrupted run.

    kvpark serve &                     # or: make serve
    python examples/hf_chat_park.py    # KVPARK_ADDRESS picks another daemon
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvpark.client import Client
from kvpark.client.hf import park_cache, restore_cache


@torch.no_grad()
def greedy(model: LlamaForCausalLM, feed: list[int], n: int, cache: DynamicCache) -> tuple[list[int], int]:
    nxt = int(model(input_ids=torch.tensor([feed]), cache=cache).logits[0, -1].argmax())
    out = []
    for _ in range(n):
        out.append(nxt)
        nxt = int(model(input_ids=torch.tensor([[nxt]]), cache=cache).logits[0, -1].argmax())
    return out, nxt


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    prompt = [1, 42, 7, 300, 12, 99, 5, 64, 250, 3, 17, 8]

    reference, _ = greedy(model, prompt, 32, DynamicCache(config=config))

    cache = DynamicCache(config=config)
    first, pending = greedy(model, prompt, 16, cache)
    with Client() as client:
        info = park_cache(client, "example-chat", cache, tokens=prompt + first, block_size=8)
        print(f"parked {info.nbytes} bytes in the {info.tier} tier over {client.transport}")
        del cache  # the worker frees its memory while the user thinks
        restored = restore_cache(client, "example-chat", config=config)
        client.drop("example-chat")
    rest, _ = greedy_from(model, pending, 16, restored)
    tokens = first + rest
    print("uninterrupted:", reference)
    print("parked/resumed:", tokens)
    print("tokens match:", tokens == reference)


@torch.no_grad()
def greedy_from(model: LlamaForCausalLM, pending: int, n: int, cache: DynamicCache) -> tuple[list[int], int]:
    out, nxt = [], pending
    for _ in range(n):
        out.append(nxt)
        nxt = int(model(input_ids=torch.tensor([[nxt]]), cache=cache).logits[0, -1].argmax())
    return out, nxt


if __name__ == "__main__":
    main()
