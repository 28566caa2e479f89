"""The vLLM connector's own timeouts against a frozen daemon, without vLLM: its
scheduler-step lookups, worker-step loads and background saves each end by their own
timeout (``lookup_timeout_s``, ``load_timeout_s``, ``save_timeout_s``), never by the
connection's longer one (``connect_timeout_s``), the connect included.

The connector runs a lookup as ``with conn.bounded(lookup_timeout_s) as client:
client.lookup_acquire(...)`` and a load as ``with conn.bounded(load_timeout_s) as client:
load_blocks(client, ...)``; saves go through ``BackgroundSaver``. These tests run the same
calls with the connection's timeout far longer than the step's.
"""

from __future__ import annotations

import signal
import time
from typing import Callable, Iterator

import pytest
import torch

from kvpark.client import Client
from kvpark.client.vllm_io import STATS, BackgroundSaver, Conn, gather_blocks, load_blocks
from ..conftest import Proc
from .test_deadlines import LONG_S, SHORT_S, assert_cut_by_deadline, freeze

NUM_BLOCKS, HEADS, BS, DIM, L = 8, 2, 32, 64, 2  # CPU-backend layout: 16 KiB a block
ATTRS = {"layout": "test"}


def layers() -> list[torch.Tensor]:
    return [torch.randn(NUM_BLOCKS, HEADS, BS, 2 * DIM).to(torch.bfloat16) for _ in range(L)]


def keys(prefix: str, n: int) -> list[str]:
    return [f"kvblk-{prefix}-{i}" for i in range(n)]


@pytest.fixture(autouse=True)
def clean_stats() -> Iterator[None]:
    STATS.clear()
    yield
    STATS.clear()


@pytest.fixture
def daemon_proc(proc: Callable[..., Proc]) -> Iterator[Proc]:
    """A daemon process holding blocks ``kvblk-held-0..7``; thawed at teardown."""
    p = proc()
    kv = layers()
    with Client(p.address) as c:
        packed = gather_blocks(kv, 0, list(range(NUM_BLOCKS)))
        c.park_batch({k: [packed[j]] for j, k in enumerate(keys("held", NUM_BLOCKS))}, attrs=ATTRS)
    yield p
    p.popen.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("connected", [True, False], ids=["connected", "connecting"])
def test_a_scheduler_lookup_ends_by_the_lookup_timeout(daemon_proc: Proc, connected: bool) -> None:
    conn = Conn(daemon_proc.address, "inline", connect_timeout_s=LONG_S)
    if connected:
        conn.get()
    freeze(daemon_proc)

    def lookup() -> None:
        with conn.bounded(SHORT_S) as client:
            client.lookup_acquire(keys("held", NUM_BLOCKS), skip=0, max_ids=NUM_BLOCKS)

    assert_cut_by_deadline("lookup", lookup)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_worker_load_ends_by_the_load_timeout(daemon_proc: Proc, transport: str) -> None:
    conn = Conn(daemon_proc.address, transport, connect_timeout_s=LONG_S)
    conn.get()
    freeze(daemon_proc)
    kv = layers()

    def load() -> None:
        with conn.bounded(SHORT_S) as client:
            load_blocks(client, kv, 0, list(range(NUM_BLOCKS)), keys("held", NUM_BLOCKS), 1 << 20)

    assert_cut_by_deadline("load", load)


@pytest.mark.parametrize("connected", [True, False], ids=["connected", "connecting"])
def test_a_background_save_ends_by_the_save_timeout(daemon_proc: Proc, connected: bool) -> None:
    # 1. A saver whose connection's timeout is far longer than a save's.
    saver = BackgroundSaver(Conn(daemon_proc.address, "auto", connect_timeout_s=LONG_S), timeout_s=SHORT_S,
                            max_pending_bytes=1 << 30)
    kv = layers()
    if connected:
        assert saver.submit(keys("warm", 1), gather_blocks(kv, 0, [0]), ATTRS)
        assert saver.drain(LONG_S) and STATS["saves"] == 1
    # 2. Frozen: the next save fails (counted) by its own deadline, not the connection's.
    freeze(daemon_proc)
    start = time.monotonic()
    assert saver.submit(keys("cold", 2), gather_blocks(kv, 0, [1, 2]), ATTRS)
    assert saver.drain(3 * LONG_S)
    took = time.monotonic() - start
    assert took < LONG_S / 2, f"the save took {took:.1f}s: it ran under the connection's timeout"
    assert STATS["errors.save"] == 1
    daemon_proc.popen.send_signal(signal.SIGCONT)
    assert saver.close(LONG_S) == 0
