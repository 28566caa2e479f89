"""Every fsync the docs promise, observed while the daemon keeps running.

The promises (docs/config.md "Write policy", docs/architecture.md, docs/operations.md
``kvpark flush``, README ``flush()``): under ``write_through`` every park (one message,
streamed, reserved over shm, batch, windowed, with shared blocks, an overwrite) is
written and fsynced before its reply; a pin is written into the disk manifest, fsynced
under write_through before its reply; ``Flush`` writes every memory-only sequence to
disk, fsynced before its reply.

``SyncObserver`` (``disk_seams.py``) overrides only ``sync()``: what each fsync covers
is read from LMDB itself, so the code under test runs as shipped. A reply that came
before its fsync finds its generation missing from ``durable``. No shutdown in between:
a stop syncs everything and would hide a missing fsync.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from .disk_seams import SyncObserver

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def gen_of(d: Daemon, seq_id: str) -> int:
    assert d.engine is not None
    with d.engine.catalog.lock:
        seq = d.engine.catalog.find(seq_id)
        assert seq is not None, seq_id
        return seq.manifest.gen


def durable(d: Daemon) -> dict[str, int]:
    assert d.engine is not None
    disk = d.engine.disk
    assert isinstance(disk, SyncObserver)
    with disk.rec_lock:
        return dict(disk.durable)


def test_write_through_parks_and_pins_are_fsynced_before_their_reply(daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=SyncObserver, **{"policy.write": "write_through", "policy.flush_on_shutdown": False})
    blk = full(300 * 1024, 4)
    for transport in ("shm", "inline"):
        with Client(d.address, transport=transport) as c:
            # one message, reserved (shm) or streamed (inline), windowed (larger than the
            # host tier: no shared blocks there)
            for i, size in enumerate((1000, 3 * MiB, 20 * MiB)):
                sid = f"{transport}{i}"
                refs = [f"B{transport}"] if size < 16 * MiB else []
                c.park(sid, [full(size, i + 1)], refs=refs, new_blocks={f"B{transport}": [blk]} if refs else None)
                got = durable(d)
                assert got.get(sid) == gen_of(d, sid), f"{sid}: replied before its fsync"
                assert got.get(f"B{transport}") == gen_of(d, f"B{transport}"), "shared block replied unsynced"
                c.park(sid, [full(size, 7)], refs=refs, overwrite=True)
                assert durable(d).get(sid) == gen_of(d, sid), f"{sid}: overwrite replied before its fsync"
            c.park_batch({f"{transport}-batch{k}": [full(5000, k)] for k in range(5)})
            got = durable(d)
            for k in range(5):
                sid = f"{transport}-batch{k}"
                assert got.get(sid) == gen_of(d, sid), f"{sid}: batch replied before its fsync"
    with Client(d.address) as c:
        # A pin is written into the disk manifest: that rewrite is synced before the reply.
        assert d.engine is not None
        before = d.engine.disk.syncs  # type: ignore[attr-defined]
        c.pin("shm0")
        assert d.engine.disk.syncs > before, "pin replied before its fsync"  # type: ignore[attr-defined]
    d.engine.check_invariants()


def test_flush_is_fsynced_before_its_reply(daemon: Callable[..., Daemon]) -> None:
    d = daemon(disk_factory=SyncObserver, **{"policy.flush_on_shutdown": False})
    with Client(d.address) as c:
        c.park_batch({f"b{i}": [full(4096, i)] for i in range(50)})
        c.park("big", [full(3 * MiB, 9)])
        assert durable(d) == {}  # write_back: nothing on disk yet
        assert c.flush() == 51
        got = durable(d)
        for sid in [f"b{i}" for i in range(50)] + ["big"]:
            assert got.get(sid) == gen_of(d, sid), f"{sid}: Flush replied before its closing fsync"
    assert d.engine is not None
    d.engine.check_invariants()
