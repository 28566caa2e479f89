"""The connector's gather/scatter on both KV layouts, with real tensors and a real daemon.

A vLLM engine on CPU always uses the CPU backend's layout, so the FlashAttention branch
(``[2, num_blocks, block_size, heads, head_dim]``) is driven here directly through the
connector's own ``save_blocks``/``load_blocks``, in chunks smaller than the payload.
Runs where vLLM is installed (`make test-vllm`); the GPU variant also needs CUDA.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

pytest.importorskip("vllm")

from kvpark.client import Client  # noqa: E402
from kvpark.client.vllm import block_dim_of, load_blocks, save_blocks  # noqa: E402
from kvpark.daemon.server import Daemon  # noqa: E402

from ..conftest import Proc  # noqa: E402

L, NUM_BLOCKS, BS, HEADS, DIM = 4, 12, 32, 4, 64  # 128 KiB a block: chunks use the shared pool
SAVE_IDS = [7, 2, 9, 4, 11]
LOAD_IDS = [0, 1, 3, 5, 6]
KEYS = [f"kvblk-{i:02d}" for i in range(len(SAVE_IDS))]


def layers(layout: str, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BS, HEADS, DIM) if layout == "flash" else (NUM_BLOCKS, HEADS, BS, 2 * DIM)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(L)]


def block(kv: torch.Tensor, dim: int, i: int) -> torch.Tensor:
    return kv.select(dim, i)


def round_trip(c: Client, layout: str, device: str) -> None:
    src = layers(layout, 1, device)
    dst = [torch.zeros_like(t) for t in src]
    dim = block_dim_of(src, BS)
    assert dim == (1 if layout == "flash" else 0)
    per_block = sum(t.numel() * t.element_size() for t in src) // NUM_BLOCKS
    stage = 2 * per_block  # two blocks per chunk: five blocks go in three chunks each way (over the
    # small-payload threshold, so shm and cuda_ipc chunks go through reserved slots)
    # Step 1: gather block SAVE_IDS[i] of every layer and park it as KEYS[i].
    save_blocks(c, src, dim, SAVE_IDS, KEYS, {"layout": f"test-{layout}"}, stage)
    # Step 2: each stored block is all layers of one engine block, [L, *block].
    (stored,) = c.restore(KEYS[0])
    assert tuple(stored.shape) == (L, *block(src[0], dim, 0).shape)
    for layer in range(L):
        assert torch.equal(stored[layer], block(src[layer], dim, SAVE_IDS[0]).cpu())
    # Step 3: restore them into other block ids of fresh layers, through the staging chunks.
    assert load_blocks(c, dst, dim, LOAD_IDS, KEYS, stage) == len(KEYS)
    for layer in range(L):
        for s, t in zip(SAVE_IDS, LOAD_IDS):
            assert torch.equal(block(dst[layer], dim, t), block(src[layer], dim, s)), (layer, s, t)
        for b in set(range(NUM_BLOCKS)) - set(LOAD_IDS):
            assert not block(dst[layer], dim, b).any(), (layer, b)  # nothing else written


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_blocks_round_trip_in_chunks(daemon: Callable[..., Daemon], layout: str, transport: str) -> None:
    d = daemon()
    with Client(d.address, transport=transport) as c:
        round_trip(c, layout, "cpu")


def test_unknown_layouts_are_refused() -> None:
    assert block_dim_of([], BS) is None
    assert block_dim_of([torch.zeros(3, NUM_BLOCKS, BS, HEADS, DIM)], BS) is None
    assert block_dim_of([torch.zeros(2, 4, BS, 2), torch.zeros(2, 5, BS, 2)], BS) is None


@pytest.mark.cuda
def test_flash_attention_layout_on_gpu_through_the_device_pool(proc: Callable[..., Proc]) -> None:
    # A daemon process with a CUDA device tier: blocks on the same GPU travel cuda_ipc.
    d = proc("--set", "tiers.device.enabled=true", "--set", "tiers.device.device=cuda:0",
             "--set", "tiers.device.capacity=64MiB")
    with Client(d.address) as c:
        round_trip(c, "flash", "cuda:0")
        assert c.info(KEYS[0]).tier == "device"  # parked through the device pool, not the arena


def test_the_layout_fingerprint_never_asks_torch_about_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's process computes the fingerprint too, and vLLM forks workers from
    processes like it: ``torch.cuda.is_available()`` there initialises CUDA's driver
    state, which a forked child cannot use. The platform comes from vLLM instead."""
    from types import SimpleNamespace

    from kvpark.client import vllm as connector
    from vllm.platforms import current_platform

    current_platform.is_cpu()  # vLLM resolves its platform once, before the check below

    def refuse() -> bool:
        raise AssertionError("torch.cuda.is_available() called while fingerprinting")

    monkeypatch.setattr(torch.cuda, "is_available", refuse)
    spec = SimpleNamespace(dtype=torch.bfloat16, block_size=16, num_kv_heads=2, head_size=64)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["a", "b"])])
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="m"))
    fp = connector.layout_fingerprint(vllm_config, kv_cache_config)
    assert fp == f"vllm-v1:m:bfloat16:bs16:h2:d64:L2:cpu-{torch.backends.cpu.get_cpu_capability()}"
