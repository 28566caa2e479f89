"""A park retried after an interruption returns the version it stored, not AlreadyExists.

A park is visible once its commit reaches the daemon; a client interrupted after that
(Ctrl-C, a lost reply, a killed worker) retries into an id that already holds its own
bytes. The retry succeeds with the stored ``SeqInfo`` when the stored version is the same
park (layout, attrs, bytes), and stays ``AlreadyExists`` for anything else.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from typing import Callable

import pytest
import torch

from kvpark.client import AlreadyExists, Client
from kvpark.daemon.server import Daemon

KiB, MiB = 1 << 10, 1 << 20


def data(seed: int, n: int = 600 * KiB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (n,), dtype=torch.int8, generator=g),
            torch.randn(7, 333, generator=g).to(torch.bfloat16)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b))


def _to_disk(c: Client, seq_id: str) -> None:
    for i in range(40):
        if c.info(seq_id).tier == "disk":
            return
        c.park(f"fill{i}", [torch.full((2 * MiB,), 1, dtype=torch.uint8)], overwrite=True)
    assert c.info(seq_id).tier == "disk"


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("where", ["memory", "disk"])
@pytest.mark.parametrize("verify", [False, True], ids=["bytes", "digests"])
def test_a_retried_park_with_the_same_bytes_returns_the_stored_version(
        daemon: Callable[..., Daemon], transport: str, where: str, verify: bool) -> None:
    d = daemon(**{"tiers.host.capacity": "8MiB"})
    ts = data(1)
    with Client(d.address, transport=transport, verify=verify) as c:
        first = c.park("s", ts, attrs={"layout": "L1"})
        if where == "disk":
            _to_disk(c, "s")
        again = c.park("s", [t.clone() for t in ts], attrs={"layout": "L1"})
        assert again.seq_id == "s" and again.created_at == first.created_at and again.nbytes == first.nbytes
        assert same(c.restore("s"), ts)
    with Client(d.address, transport=transport, verify=not verify) as c:  # the other client kind
        assert c.park("s", ts, attrs={"layout": "L1"}).created_at == first.created_at


@pytest.mark.parametrize("verify", [False, True], ids=["bytes", "digests"])
def test_a_park_over_a_different_version_is_still_already_exists(daemon: Callable[..., Daemon],
                                                                 verify: bool) -> None:
    d = daemon()
    ts = data(2)
    flipped = [t.clone() for t in ts]
    flipped[1].view(torch.int16)[-1] ^= 1  # one bit of the last tensor's last element
    with Client(d.address, verify=verify) as c:
        c.park("s", ts, attrs={"layout": "L1"})
        for other, attrs in [
            (flipped, {"layout": "L1"}),  # the bytes
            ([ts[0].reshape(2, -1), ts[1]], {"layout": "L1"}),  # the shape, same bytes
            ([ts[0].view(torch.uint8), ts[1]], {"layout": "L1"}),  # the dtype, same bytes
            (ts, {"layout": "L2"}),  # the attrs
            (ts, {}),
            (ts[:1], {"layout": "L1"}),  # fewer tensors
            (ts + [ts[1]], {"layout": "L1"}),  # more
        ]:
            with pytest.raises(AlreadyExists):
                c.park("s", other, attrs=attrs)
        assert same(c.restore("s"), ts)
        # A composite is not compared: its payload is partly its blocks'.
        c.park("comp", [torch.zeros(64, dtype=torch.uint8)], refs=["blk"],
               new_blocks={"blk": [torch.ones(64, dtype=torch.uint8)]})
        with pytest.raises(AlreadyExists):
            c.park("comp", [torch.zeros(64, dtype=torch.uint8)], refs=["blk"])


def test_concurrent_parks_of_one_id_with_the_same_bytes_all_succeed(daemon: Callable[..., Daemon]) -> None:
    """Two workers (or a worker and its own retry) racing one create: with the same bytes
    every one succeeds with the one stored version; with different bytes exactly one does."""
    d = daemon(**{"tiers.host.capacity": "32MiB"})
    for round_ in range(4):
        ts = data(10 + round_, 300 * KiB)
        diff = round_ % 2 == 1
        results: list[object] = [None] * 4
        go = threading.Barrier(4)

        def park(i: int) -> None:
            mine = [t.clone() for t in ts]
            if diff:
                mine[0][0] = i  # each its own bytes
            with Client(d.address, transport="shm" if i % 2 else "inline") as c:
                go.wait()
                try:
                    results[i] = c.park(f"r{round_}", mine)
                except AlreadyExists as e:
                    results[i] = e

        threads = [threading.Thread(target=park, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        won = [r for r in results if not isinstance(r, AlreadyExists)]
        assert all(r is not None for r in results)
        if diff:
            assert len(won) == 1, results
        else:
            assert len(won) == 4 and len({r.created_at for r in won}) == 1, results  # type: ignore[union-attr]
        with Client(d.address) as c:
            got = c.restore(f"r{round_}")
            assert same(got[1:], ts[1:]) and torch.equal(got[0][1:], ts[0][1:])


CHILD = """
import sys, torch
from kvpark.client import Client
g = torch.Generator().manual_seed(int(sys.argv[2]))
ts = [torch.randint(-128, 127, (4 << 20,), dtype=torch.int8, generator=g)]
with Client(sys.argv[1], transport="shm") as c:
    print("parking", flush=True)
    c.park(sys.argv[3], ts)
    print("parked", flush=True)
"""


@pytest.mark.slow
def test_a_park_killed_at_any_point_and_retried_with_the_same_bytes_succeeds(
        daemon: Callable[..., Daemon]) -> None:
    """A worker SIGKILLed somewhere in its park (before, during or after the commit): its
    retry with the same bytes succeeds and the id holds exactly them."""
    d = daemon(**{"tiers.host.capacity": "64MiB", "leases.ttl_s": 2.0})
    rng = random.Random(5)
    for attempt in range(4):
        seed = 100 + attempt
        p = subprocess.Popen([sys.executable, "-c", CHILD, d.address, str(seed), f"victim{attempt}"], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "parking"
        threading.Event().wait(rng.uniform(0.0, 0.05))
        p.kill()
        p.wait(30)
        g = torch.Generator().manual_seed(seed)
        ts = [torch.randint(-128, 127, (4 << 20,), dtype=torch.int8, generator=g)]
        with Client(d.address, transport="shm" if attempt % 2 else "inline") as c:
            info = c.park(f"victim{attempt}", ts)
            assert info.nbytes == 4 << 20
            assert same(c.restore(f"victim{attempt}"), ts)
            # Retried once more: it meets the version stored by now, whoever stored it.
            assert c.park(f"victim{attempt}", ts).created_at == info.created_at
