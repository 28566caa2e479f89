"""Concurrent parks, restores and drops from several threads; accounting exact afterwards."""

import functools
import random
import threading
from typing import Callable

import pytest
import torch

from kvpark.client import Client, NotFound
from kvpark.daemon.server import Daemon

from ..conftest import run_threads, wait_until


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_threads_park_restore_drop(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon(**{"tiers.host.capacity": "24MiB"})
    kept: dict[str, torch.Tensor] = {}
    lock = threading.Lock()

    def worker(w: int) -> None:
        rng = random.Random(w)
        with Client(d.address, transport=transport) as c:
            for i in range(25):
                sid = f"w{w}-{i}"
                t = torch.randint(0, 255, (rng.choice([100, 70_000, 1 << 20, 1_500_000]),), dtype=torch.uint8)
                c.park(sid, [t, t[:7].clone()])
                back = c.restore(sid)
                assert torch.equal(back[0], t) and torch.equal(back[1], t[:7])
                if rng.random() < 0.4:
                    assert c.drop(sid)
                else:
                    with lock:
                        kept[sid] = t

    errors = run_threads([functools.partial(worker, w) for w in range(6)])
    assert not errors, errors[0]
    with Client(d.address, transport=transport) as c:
        assert {s.seq_id for s in c.list()} == set(kept)
        for sid, t in kept.items():
            assert torch.equal(c.restore(sid)[0], t)
        assert wait_until(lambda: c.stat().leases == 0)
        engine = d.engine
        assert engine is not None
        # Exact accounting: every tier charges what the resident sequences hold.
        engine.check_invariants()
        for sid in kept:
            assert c.drop(sid)
        st = c.stat()
        assert st.tiers["host"].used_bytes == 0 and st.tiers["disk"].used_bytes == 0 and st.sequences == 0
        with pytest.raises(NotFound):
            c.info(next(iter(kept)))
    engine.check_invariants()
