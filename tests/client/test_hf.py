"""HF adapter: a tiny random Llama parks its cache mid-generation, the daemon restarts, and
generation resumes with exactly the tokens of an uninterrupted run."""

from typing import Any, Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

from kvpark.client import Client, InvalidArgument, LayoutMismatch  # noqa: E402
from kvpark.client import hf  # noqa: E402
from kvpark.daemon.server import Daemon  # noqa: E402


def tiny_llama(dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_mistral(dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=8)
    return MistralForCausalLM(cfg).to(dtype).eval()


@torch.no_grad()
def step(model: Any, ids: torch.Tensor, cache: Any) -> int:
    return int(model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())


@torch.no_grad()
def generate(model: Any, prompt: list[int], n: int, cache: Any, pending: int | None = None
             ) -> tuple[list[int], int]:
    """Greedy: returns the n tokens emitted (all fed to the cache) and the next, not yet fed."""
    out = []
    nxt = step(model, torch.tensor([prompt]), cache) if pending is None else pending
    for _ in range(n):
        out.append(nxt)
        nxt = step(model, torch.tensor([[nxt]]), cache)
    return out, nxt


PROMPT = [5, 17, 99, 3, 42, 7, 7, 128, 64, 1, 250, 31, 8, 200, 13, 77, 2, 9, 44, 101]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make,tokens", [(tiny_llama, False), (tiny_llama, True), (tiny_mistral, False)])
def test_park_restart_restore_continue(daemon: Callable[..., Daemon], dtype: torch.dtype, make: Any,
                                       tokens: bool) -> None:
    model = make(dtype)
    want, _ = generate(model, PROMPT, 24, DynamicCache(config=model.config))

    # Step 1: generate 10 tokens, then park the cache mid-way; `pending` is not fed yet.
    cache = DynamicCache(config=model.config)
    first, pending = generate(model, PROMPT, 10, cache)
    fed = PROMPT + first
    d = daemon()
    with Client(d.address) as c:
        kw = {"tokens": fed, "block_size": 8} if tokens else {}
        info = hf.park_cache(c, "chat", cache, **kw)
        assert info.num_tensors >= 1
    del cache
    # Step 2: restart the daemon (graceful stop flushes to disk).
    d.stop()
    d2 = daemon()
    # Step 3: restore and continue; the tokens equal the uninterrupted run.
    with Client(d2.address) as c:
        restored = hf.restore_cache(c, "chat", config=model.config)
        assert restored.get_seq_length() == len(fed)
        rest, _ = generate(model, PROMPT, 14, restored, pending=pending)
    assert first + rest == want


def test_restore_without_config_rebuilds_sliding_layers(daemon: Callable[..., Daemon]) -> None:
    model = tiny_mistral(torch.float32)
    cache = DynamicCache(config=model.config)
    generate(model, PROMPT, 5, cache)
    d = daemon()
    with Client(d.address) as c:
        hf.park_cache(c, "s", cache)
        back = hf.restore_cache(c, "s")
    assert [type(l).__name__ for l in back.layers] == [type(l).__name__ for l in cache.layers]
    for a, b in zip(cache.layers, back.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.cumulative_length == b.cumulative_length


def test_prefix_blocks_are_shared_between_hf_sequences(daemon: Callable[..., Daemon]) -> None:
    model = tiny_llama(torch.float32)
    d = daemon()
    with Client(d.address) as c:
        for i in range(3):
            cache = DynamicCache(config=model.config)
            out, _ = generate(model, PROMPT + [i], 1, cache)
            hf.park_cache(c, f"s{i}", cache, tokens=PROMPT + [i] + out, block_size=8)
        # 21 tokens -> 2 full 8-token blocks shared by all three.
        infos = [c.info(f"s{i}") for i in range(3)]
        assert all(i.refs == infos[0].refs and len(i.refs) == 2 for i in infos)
        assert c.info(infos[0].refs[0]).refcount == 3


def test_unsupported_inputs(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        with pytest.raises(InvalidArgument, match="unsupported cache type"):
            hf.park_cache(c, "x", {"not": "a cache"})
        with pytest.raises(InvalidArgument, match="no layers|holds no KV"):
            hf.park_cache(c, "x", DynamicCache())
        model = tiny_mistral(torch.float32)
        cache = DynamicCache(config=model.config)
        generate(model, PROMPT, 2, cache)
        with pytest.raises(InvalidArgument, match="sliding"):
            hf.park_cache(c, "x", cache, tokens=PROMPT + [1])
        llama = DynamicCache(config=tiny_llama(torch.float32).config)
        out, _ = generate(tiny_llama(torch.float32), PROMPT, 1, llama)
        for bs in (0, -8):
            with pytest.raises(InvalidArgument, match="block_size must be > 0"):
                hf.park_cache(c, "x", llama, tokens=PROMPT + out, block_size=bs)
        c.park("plain", [torch.ones(2)])
        with pytest.raises(LayoutMismatch):
            hf.restore_cache(c, "plain")
        hf.park_cache(c, "m", cache)
        with pytest.raises(LayoutMismatch):
            hf.restore_cache(c, "m", config=tiny_llama(torch.float32).config)
