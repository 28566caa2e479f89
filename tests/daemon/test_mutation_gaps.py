"""Behaviour that a mutation-testing pass found unguarded (``docs/testing.md``, ``make
mutate``): each test here fails with one planted bug and passes on the tree.

Real daemons and engines, real LMDB in temp dirs, a real Redis; nothing of the project's
own is mocked.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Callable

import torch

from kvpark.client import Client
from kvpark.client.client import _header
from kvpark.daemon import reads
from kvpark.daemon.engine import Engine
from kvpark.daemon.server import Daemon
from kvpark.daemon.servicer import _spec

from ..conftest import make_config, wait_until
from ..redis_servers import RedisServer

MiB = 1 << 20
_ns = itertools.count()


def _blob(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_a_read_lease_already_ended_by_its_restore_is_not_ended_again(tmp_path: Path) -> None:
    """``LeaseTable.end`` answers False for a lease someone else ended first. A restore
    that fails after leasing its parts ends its lease itself (``end_read``: its readers
    go, it leaves the table); shutdown's ``close()`` or the reaper may have picked it up
    from the table just before. Their ``end`` must then be a no-op that says so: the
    reaper counts a lease expired (metrics, the tenant's quota settling) only on True.
    (A real engine whose maintenance thread is not started: the test plays both.)"""
    eng = Engine(make_config(tmp_path))
    try:
        data = _blob(1, 3 * MiB)
        r = eng.reserve(_spec(_header("x", [data])), inline=True)
        eng.write_chunk(r.lease_id, 0, memoryview(data.numpy()))
        eng.commit(r.lease_id, expect_nbytes=3 * MiB)
        h = eng.acquire("x")
        lease = h.lease
        assert lease is not None and eng.stat().leases == 1
        with eng.catalog.lock:
            eng.leases.end_read(lease)  # what a failing restore does with its own lease
        assert eng.stat().leases == 0
        assert eng.leases.end(lease) is False  # a second end: nothing left to end
        assert eng.release(h.lease_id) is False
        eng.check_invariants()
    finally:
        eng.close(flush=False)


def test_remote_blocks_splits_the_remote_copy_into_the_manifests_blocks(
        daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    """``reads.remote_blocks`` serves a disk part whose copy left for Redis between the
    lease and the read: it must yield exactly the manifest's blocks, in order, each its
    recorded length (the stream regroups them by payload offset). A payload of two full
    slots and a short tail, so every block's offset and length count."""
    ns = f"gap{os.getpid()}-{next(_ns)}"
    d = daemon(**{"tiers.remote.url": redis_server.url, "tiers.remote.namespace": ns,
                  "tiers.remote.write": "write_through", "tiers.remote.timeout_s": 5.0})
    assert d.engine is not None and d.engine.remote is not None
    data = _blob(2, 2 * MiB + 12345)
    with Client(d.address, transport="inline") as c:
        c.park("x", [data])
        assert wait_until(lambda: (st := c.stat().remote) is not None and st.pending_writes == 0, timeout=30)
    with d.engine.catalog.lock:
        seq = d.engine.catalog.get("x")
        assert seq.on_remote
        m = seq.manifest
    assert len(m.block_lengths) == 3
    blocks = [bytes(b) for b in reads.remote_blocks(d.engine, m)]
    assert [len(b) for b in blocks] == list(m.block_lengths)
    assert b"".join(blocks) == data.numpy().tobytes()
