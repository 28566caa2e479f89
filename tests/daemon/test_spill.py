"""Capacity pressure pushes cold sequences to disk; restore brings them back (promotion)."""

from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from ..conftest import wait_until

MiB = 1 << 20


def blob(i: int, n: int = MiB) -> torch.Tensor:
    return torch.full((n,), i % 251, dtype=torch.uint8)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_spill_to_disk_then_restore_with_promotion(daemon: Callable[..., Daemon], transport: str) -> None:
    # Step 1: a 16 MiB host tier gets 40 MiB of parks; the daemon must spill LRU to disk.
    d = daemon()
    with Client(d.address, transport=transport) as c:
        for i in range(40):
            c.park(f"s{i:02d}", [blob(i)])
        st = c.stat()
        assert st.sequences == 40
        assert st.tiers["host"].used_bytes <= 16 * MiB
        assert st.tiers["disk"].sequences >= 24
        # Step 2: the oldest went to disk first.
        assert c.info("s00").tier == "disk"
        assert c.info("s39").tier == "host"
        # Step 3: background demotion keeps the host tier under its high watermark.
        assert wait_until(lambda: c.stat().tiers["host"].used_bytes <= int(0.9 * 16 * MiB))
        # Step 4: restoring a disk-resident sequence serves it and promotes it to host
        # (over shm, a disk grant's promotion runs once the reads pause: awaited).
        assert torch.equal(c.restore("s00")[0], blob(0))
        assert wait_until(lambda: c.info("s00").tier == "host")
        # Step 5: every sequence is still bit-exact, wherever it lives.
        for i in range(40):
            assert torch.equal(c.restore(f"s{i:02d}")[0], blob(i)), i
    d.engine.check_invariants()


def test_no_promotion_when_disabled(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"policy.promote_on_restore": False})
    with Client(d.address, transport="inline") as c:
        for i in range(20):
            c.park(f"s{i}", [blob(i)])
        assert c.info("s0").tier == "disk"
        assert torch.equal(c.restore("s0")[0], blob(0))
        assert c.info("s0").tier == "disk"
    d.engine.check_invariants()


def test_restore_touch_makes_a_sequence_recent(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address, transport="inline") as c:
        for i in range(12):
            c.park(f"s{i}", [blob(i)])
        c.restore("s0")  # now most recently used
        for i in range(12, 20):
            c.park(f"s{i}", [blob(i)])
        assert c.info("s0").tier == "host"
        assert c.info("s1").tier == "disk"
    d.engine.check_invariants()


def test_priority_is_demoted_last(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address, transport="inline") as c:
        c.park("vip", [blob(1)], priority=10)
        for i in range(30):
            c.park(f"s{i}", [blob(i)])
        assert c.info("vip").tier == "host"
    d.engine.check_invariants()


def test_write_through_acknowledges_after_disk(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"policy.write": "write_through"})
    with Client(d.address) as c:
        c.park("wt", [blob(5, 3 * MiB + 11)])
        st = c.stat()
        assert st.tiers["disk"].sequences == 1 and st.tiers["disk"].used_bytes == 3 * MiB + 11
        assert st.tiers["host"].sequences == 1  # and still hot
        c.park("wt", [blob(6, 100)], overwrite=True)
        assert c.stat().tiers["disk"].used_bytes == 100
        assert c.drop("wt")
        st = c.stat()
        assert st.tiers["disk"].used_bytes == 0 and st.tiers["host"].used_bytes == 0
    d.engine.check_invariants()


def test_background_demotion_from_high_to_low_watermark(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        # 15 of 16 MiB fits without any synchronous demotion, but passes the 0.9 mark.
        for i in range(15):
            c.park(f"s{i:02d}", [blob(i)])
        assert wait_until(lambda: c.stat().tiers["host"].used_bytes <= int(0.8 * 16 * MiB))
        st = c.stat()
        assert st.tiers["host"].used_bytes >= 12 * MiB  # stopped at the low mark, not below
        assert st.tiers["disk"].sequences == 15 - st.tiers["host"].sequences
        assert c.info("s00").tier == "disk" and c.info("s14").tier == "host"
    d.engine.check_invariants()
