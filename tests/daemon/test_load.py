"""Load, bounded: 16 client processes park, restore, prefetch and drop random sequences of
mixed sizes against small host and disk tiers (``tests/daemon/load.py``; ``bench/load.py``
runs longer ones and prints the figures).

At the end: no call passed its deadline, no unexpected error, no wrong bytes; every
sequence a client still holds restores bit-exact or was evicted by the disk tier after its
last park began; nothing dropped is present; the engine's accounting is exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .load import run_load

pytestmark = pytest.mark.slow


# Sixteen client processes importing torch on two busy cores take most of the time here.
@pytest.mark.timeout(600)
def test_sixteen_clients_under_memory_pressure(tmp_path: Path) -> None:
    res = run_load(tmp_path, clients=16, seconds=float(os.environ.get("KVPARK_LOAD_SECONDS", "10")),
                   keys=6, host="4MiB", disk="12MiB", seed=int(os.environ.get("KVPARK_LOAD_SEED", "0")))
    print("\n" + res.table())
    assert not res.problems, "\n".join(res.problems[:30])
    # The run did what it is for: every kind of call, under pressure, and checks at the end.
    assert all(res.lat[op] for op in ("park", "restore", "prefetch", "drop")), res.table()
    assert res.verified > 0, res.table()
    assert res.evicted > 0, "the disk tier never had to evict: no pressure\n" + res.table()
