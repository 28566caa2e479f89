"""Fresh-eyes attacks on the per-direction copy engine through real daemons with the
CPU stand-in device tier."""

import functools
import random
import threading
import time
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError, Unavailable
from kvpark.daemon import mover as movermod
from kvpark.daemon.server import Daemon
from kvpark.tiers.copy import D2H

from ..conftest import run_threads, wait_until
from ..tiers.test_copy import Held
from .test_device_tier import DEV, MiB, ON_DEV, blob

def quiet_and_check(d: Daemon) -> None:
    with Client(d.address) as c:
        assert wait_until(lambda: c.stat().leases == 0, timeout=30)
    eng = d.engine
    assert eng is not None
    assert wait_until(lambda: not any(eng.copy._inflight.values()) and not any(eng.copy._queues.values()))
    eng.check_invariants()
    assert eng.catalog._claims == 0 and eng.catalog._copies == 0


@pytest.mark.parametrize("cfg", [ON_DEV, DEV], ids=["restore_to_device", "auto"])
def test_pressure_with_small_chunks_concurrent_clients_and_drops(daemon: Callable[..., Daemon], cfg: dict) -> None:
    d = daemon(**cfg)
    assert d.engine is not None
    d.engine.copy.chunk_bytes = 96 << 10  # many chunks per move, odd size
    d.engine.copy.max_inflight = 200 << 10
    truth: dict[str, torch.Tensor] = {}
    tlock = threading.Lock()
    sizes = [MiB, MiB + 333, 2 * MiB + 7, 256 << 10]
    with Client(d.address, transport="inline") as c:
        for i in range(20):
            t = blob(i, random.Random(i).choice(sizes))
            c.park(f"s{i}", [t])
            truth[f"s{i}"] = t
    stop = time.monotonic() + 5.0

    def reader(w: int, transport: str) -> None:
        rng = random.Random(w)
        with Client(d.address, transport=transport) as c:
            while time.monotonic() < stop:
                sid = f"s{rng.randrange(20)}"
                with tlock:
                    want = truth.get(sid)
                try:
                    got = c.restore(sid)[0]
                except KVParkError as e:
                    # A 16 MiB host full of other readers' leases refuses, typed: allowed.
                    if type(e).__name__ in ("NotFound", "ResourceExhausted"):
                        continue
                    raise
                with tlock:
                    now = truth.get(sid)
                if want is not None and now is want:
                    assert torch.equal(got, want), sid

    def many(w: int) -> None:
        rng = random.Random(100 + w)
        with Client(d.address, transport="shm") as c:
            while time.monotonic() < stop:
                ids = rng.sample([f"s{i}" for i in range(10, 20)], 4)
                try:
                    c.restore_many(ids)
                except KVParkError as e:
                    if type(e).__name__ not in ("NotFound", "ResourceExhausted"):
                        raise

    def churn() -> None:
        rng = random.Random(7)
        with Client(d.address, transport="inline") as c:
            i = 0
            while time.monotonic() < stop:
                sid = f"s{rng.randrange(20)}"
                if rng.random() < 0.3:
                    with tlock:
                        truth.pop(sid, None)
                    c.drop(sid)
                else:
                    t = blob(1000 + i, rng.choice(sizes))
                    with tlock:
                        truth.pop(sid, None)
                    c.park(sid, [t], overwrite=True)
                    with tlock:
                        truth[sid] = t
                i += 1

    def prefetcher() -> None:
        rng = random.Random(9)
        with Client(d.address) as c:
            while time.monotonic() < stop:
                try:
                    c.prefetch(f"s{rng.randrange(20)}", tier=rng.choice(["device", "host"]),
                               wait=rng.random() < 0.5, timeout=10)
                except KVParkError as e:
                    if type(e).__name__ not in ("NotFound", "DeadlineExceeded", "ResourceExhausted"):
                        raise

    targets = [functools.partial(reader, w, "inline" if w % 2 else "shm") for w in range(3)]
    targets += [functools.partial(many, w) for w in range(2)] + [churn, prefetcher]
    errors = run_threads(targets, timeout=120)
    assert not errors, repr(errors[0])
    quiet_and_check(d)
    with Client(d.address, transport="inline") as c:
        for sid, t in truth.items():
            assert torch.equal(c.restore(sid)[0], t), sid
    quiet_and_check(d)


def test_batched_promotion_held_in_flight_raced_by_drops_and_a_wait_that_gives_up(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon(**ON_DEV)
    eng = d.engine
    assert eng is not None
    monkeypatch.setattr(movermod.await_copy, "__defaults__", (1.0,))
    blocks = {f"blk{i}": [blob(i, 256 << 10)] for i in range(8)}
    with Client(d.address, transport="inline") as c:
        c.park_batch(blocks)
        assert all(c.info(b).tier == "device" for b in blocks)
    # Hold the D2H link: the batched promotion device->host queues behind this copy.
    Held.gate = threading.Event()
    scratch = torch.zeros(16, dtype=torch.uint8)
    hold = eng.copy.submit([(torch.zeros(16, dtype=torch.uint8).as_subclass(Held), scratch)],
                           restore=True, direction=D2H)
    out: list = []

    def restore() -> None:
        with Client(d.address, transport="shm") as c:
            try:
                out.append(c.restore_many(list(blocks), timeout=30))
            except KVParkError as e:
                out.append(e)

    th = threading.Thread(target=restore)
    th.start()
    assert wait_until(lambda: eng.catalog._copies > 0, timeout=10), "the batched promotion never started"
    th.join(30)
    assert out, "restore_many hung behind a held copy"
    # Now drop half of them while the batched copy still holds their move locks.
    with Client(d.address) as c:
        for i in range(0, 8, 2):
            assert c.drop(f"blk{i}")
    Held.gate.set()
    assert hold.wait(10)
    quiet_and_check(d)
    with Client(d.address, transport="shm") as c:
        for i in range(1, 8, 2):
            assert torch.equal(c.restore(f"blk{i}")[0], blocks[f"blk{i}"][0])
        assert {s.seq_id for s in c.list()} == {f"blk{i}" for i in range(1, 8, 2)}
    quiet_and_check(d)


def test_inline_landing_paths_and_quota(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**DEV)
    with Client(d.address, transport="inline") as c:
        assert c.park("a", [blob(1)]).tier == "host"
        assert c.park_batch({"b": [blob(2)], "c": [blob(3)]})
        assert all(c.info(s).tier == "host" for s in "abc")
        assert c.stat().tiers["device"].sequences == 0
        # A restore under restore_to = auto promotes to host only.
        assert torch.equal(c.restore("a")[0], blob(1))
        assert c.stat().tiers["device"].sequences == 0
    quiet_and_check(d)


def test_a_restore_behind_a_hung_batched_promotion_is_bounded_too(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    """After a batched promotion gives up (UNAVAILABLE), its move locks stay held until the
    hung copy ends. A later restore of one of its blocks must give up after MOVE_WAIT_S
    with a typed error, not block on the move lock for as long as the device hangs."""
    d = daemon(**ON_DEV)
    eng = d.engine
    assert eng is not None
    monkeypatch.setattr(movermod.await_copy, "__defaults__", (1.0,))
    monkeypatch.setattr(movermod, "MOVE_WAIT_S", 1.0)
    blocks = {f"blk{i}": [blob(i, 256 << 10)] for i in range(4)}
    with Client(d.address, transport="inline") as c:
        c.park_batch(blocks)
    Held.gate = threading.Event()
    scratch = torch.zeros(16, dtype=torch.uint8)
    hold = eng.copy.submit([(torch.zeros(16, dtype=torch.uint8).as_subclass(Held), scratch)],
                           restore=True, direction=D2H)
    try:
        with Client(d.address, transport="shm") as c:
            with pytest.raises(KVParkError):
                c.restore_many(list(blocks), timeout=30)
            err = None
            try:
                c.restore("blk1", timeout=20)
            except KVParkError as e:
                err = e
            # Not DeadlineExceeded after 20 s of waiting: the move lock's own bound, in words.
            assert isinstance(err, Unavailable) and "held by a move" in str(err), repr(err)
    finally:
        Held.gate.set()
        hold.wait(10)
    quiet_and_check(d)
