"""Three tiers together, with device = "cpu" as the stand-in for a GPU pool."""

import functools
import random
import time
from typing import Callable

import pytest
import torch

from kvpark.client import Client, DeadlineExceeded, InvalidArgument, NotFound
from kvpark.daemon.server import Daemon

from ..conftest import run_threads, wait_until

MiB = 1 << 20
DEV = {"tiers.device.enabled": "true", "tiers.device.device": "cpu", "tiers.device.capacity": "8MiB"}
# Inline parks land on the device pool only when restore_to says "device".
ON_DEV = {**DEV, "policy.restore_to": "device"}


def blob(i: int, n: int = MiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_inline_parks_land_on_host_unless_restore_to_is_device(daemon: Callable[..., Daemon]) -> None:
    # By default an inline park lands on host: the bytes pass through the daemon's
    # memory anyway, and the device pool is left to cuda_ipc users.
    d = daemon(**DEV)
    with Client(d.address, transport="inline") as c:
        assert c.park("h", [blob(3)]).tier == "host"
        assert c.stat().tiers["device"].sequences == 0


def test_parks_land_on_the_device_tier(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**ON_DEV)
    with Client(d.address, transport="inline") as c:
        assert c.park("a", [blob(1)]).tier == "device"
        st = c.stat()
        assert list(st.tiers) == ["device", "host", "disk"]
        assert st.tiers["device"].sequences == 1 and st.tiers["host"].sequences == 0
        assert torch.equal(c.restore("a")[0], blob(1))
    with Client(d.address, transport="shm") as c:
        # A shm client writes into the host arena, so its parks land on host.
        assert c.park("b", [blob(2)]).tier == "host"


def test_pressure_demotes_down_the_chain_bit_exact(daemon: Callable[..., Daemon]) -> None:
    # Step 1: 40 MiB through an 8 MiB device tier and a 16 MiB host tier.
    d = daemon(**ON_DEV, **{"policy.promote_on_restore": False})
    with Client(d.address, transport="inline") as c:
        for i in range(40):
            c.park(f"s{i:02d}", [blob(i)])
        st = c.stat()
        # Step 2: every tier holds some, none is over capacity.
        assert 0 < st.tiers["device"].used_bytes <= 8 * MiB
        assert 0 < st.tiers["host"].used_bytes <= 16 * MiB
        assert st.tiers["disk"].sequences >= 16
        tiers = {s.seq_id: s.tier for s in c.list()}
        assert tiers["s00"] == "disk" and tiers["s39"] == "device"
        assert "host" in tiers.values()
        # Step 3: bytes are exact at every level. Without promotion nothing moves up
        # (background demotion may still move things down meanwhile).
        for i in range(40):
            assert torch.equal(c.restore(f"s{i:02d}")[0], blob(i)), i
        rank = {"device": 0, "host": 1, "disk": 2}
        assert all(rank[s.tier] >= rank[tiers[s.seq_id]] for s in c.list())


def test_restore_promotes_to_device_and_prefetch_moves_up(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**DEV)
    with Client(d.address, transport="inline") as c:
        for i in range(30):
            c.park(f"s{i:02d}", [blob(i)])
        assert c.info("s00").tier == "disk"
        # Background demotion leaves headroom under the device and host high watermarks.
        assert wait_until(lambda: c.stat().tiers["device"].used_bytes <= 7 * MiB)
        assert wait_until(lambda: c.stat().tiers["host"].used_bytes <= 14 * MiB)
        # A streamed restore promotes into restore_to before serving: "auto" is the host
        # tier it reads from (a device copy would be made and then not read).
        assert torch.equal(c.restore("s00")[0], blob(0))
        assert c.info("s00").tier == "host"
        # Prefetch without waiting starts the move; with wait it is there on return.
        assert c.info("s01").tier == "disk"
        c.prefetch("s01", tier="host")
        assert wait_until(lambda: c.info("s01").tier in ("host", "device"))
        assert c.prefetch("s02", tier="device", wait=True, timeout=30) == "device"
        assert c.info("s02").tier == "device"
        assert torch.equal(c.restore("s02")[0], blob(2))
        with pytest.raises(NotFound):
            c.prefetch("ghost", wait=True)
        with pytest.raises(InvalidArgument):
            c.prefetch("s03", tier="tape")


def test_restore_to_device_promotes_streamed_restores_there(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**DEV, **{"policy.restore_to": "device"})
    with Client(d.address, transport="inline") as c:
        for i in range(30):
            c.park(f"s{i:02d}", [blob(i)])
        assert wait_until(lambda: c.info("s00").tier == "disk")
        assert wait_until(lambda: c.stat().tiers["device"].used_bytes <= 7 * MiB)
        assert torch.equal(c.restore("s00")[0], blob(0))
        assert c.info("s00").tier == "device"


def test_prefetch_timeout(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{**DEV, "tiers.host.capacity": "64MiB", "tiers.device.capacity": "64MiB"})
    with Client(d.address, transport="inline") as c:
        c.park("big", [blob(1, 48 * MiB)])
        c.park("filler", [blob(2, 40 * MiB)])  # pushes "big" off device
        assert wait_until(lambda: c.info("big").tier != "device")
        with pytest.raises(DeadlineExceeded):
            c.prefetch("big", tier="device", wait=True, timeout=1e-6)


def test_prefetch_needs_an_enabled_tier(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address) as c:
        c.park("x", [blob(1)])
        with pytest.raises(InvalidArgument, match="device tier is not enabled"):
            c.prefetch("x", tier="device")
        assert c.prefetch("x", tier="host", wait=True) == "host"


def test_pinned_sequences_stay_and_priorities_go_last(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**ON_DEV)
    with Client(d.address, transport="inline") as c:
        c.park("pin", [blob(1)], pinned=True)
        c.park("vip", [blob(2)], priority=9)
        for i in range(40):
            c.park(f"s{i}", [blob(i)])
        assert c.info("pin").tier == "device"
        assert c.info("vip").tier in ("device", "host")
        assert c.info("s0").tier == "disk"
        assert torch.equal(c.restore("pin")[0], blob(1))


def test_ttl_drops_expired_sequences(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**DEV, **{"leases.ttl_s": 0.4})
    with Client(d.address) as c:
        c.park("short", [blob(1)], ttl_s=0.3)
        c.park("long", [blob(2)])
        assert c.info("short").seq_id == "short"
        assert wait_until(lambda: [s.seq_id for s in c.list()] == ["long"], timeout=10)
        with pytest.raises(InvalidArgument):
            c.park("bad", [blob(1)], ttl_s=-1)


def test_restores_racing_demotions_never_see_half_copied_blocks(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**DEV)
    truth = {f"s{i}": blob(i, random.Random(i).choice([MiB, MiB + 333, 2 * MiB + 7])) for i in range(24)}
    with Client(d.address, transport="inline") as c:
        for sid, t in truth.items():
            c.park(sid, [t])
    stop = time.monotonic() + 4.0

    def reader(w: int, transport: str) -> None:
        rng = random.Random(w)
        with Client(d.address, transport=transport) as c:
            while time.monotonic() < stop:
                sid = rng.choice(list(truth))
                assert torch.equal(c.restore(sid)[0], truth[sid]), sid

    def churn() -> None:
        with Client(d.address, transport="inline") as c:
            i = 0
            while time.monotonic() < stop:
                c.park(f"churn{i % 12}", [blob(100 + i)], overwrite=True)
                i += 1

    readers = [functools.partial(reader, w, "inline" if w % 2 else "shm") for w in range(4)]
    errors = run_threads([*readers, churn], timeout=60)
    assert not errors, errors[0]
    with Client(d.address) as c:
        assert wait_until(lambda: c.stat().leases == 0)
        engine = d.engine
        assert engine is not None
        engine.check_invariants()


def test_restore_many_promotes_its_blocks_in_one_copy_job(daemon: Callable[..., Daemon]) -> None:
    # Step 1: eight 256 KiB blocks parked inline land on the (CPU stand-in) device tier.
    d = daemon(**ON_DEV)
    assert d.engine is not None
    blocks = {f"blk{i}": [blob(i, 256 << 10)] for i in range(8)}
    with Client(d.address, transport="inline") as c:
        c.park_batch(blocks)
        assert all(c.info(b).tier == "device" for b in blocks)
    # Step 2: an shm reader needs them in the host arena: one job moves all eight.
    jobs = d.engine.copy.completed
    with Client(d.address, transport="shm") as c:
        info, back = c.restore_many(list(blocks))
        assert d.engine.copy.completed - jobs == 1
        assert all(torch.equal(t, blocks[b][0]) for t, b in zip(back, blocks))
        assert all(c.info(b).tier == "device" for b in blocks)  # still also on device
        assert d.engine.stat().tiers["host"].sequences == 8
