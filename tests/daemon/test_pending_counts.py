"""``Pending`` counts its holders: an id two commits hold at once stays pending until both
have published (``commit.Pending.add``/``done``). Under write_back a plain overwrite waits
for no pending commit, so it can hold an id that a windowed create holds already (count
2); when the overwrite publishes, the windowed create is still between its commit point
and its disk commit. A create of the id after a drop must still wait for it: the drop was
between the windowed create's validation and its publish, so it is ordered before that
create (``Catalog.publish_commit``), and of two creates after it exactly one wins
(docs/protocol.md, "Exactly one create wins"). Counting the holders as a set (a count of 2
left at 1) let the later create go ahead: both creates were acknowledged as new."""

from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch

from kvpark.client import AlreadyExists, Client
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

from ..conftest import wait_until
from .disk_seams import waiting_in

SMALL = {"tiers.host.capacity": "4MiB"}
BIG = 5 * (1 << 20) + 1  # larger than the host tier: a windowed park


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class HeldStage(DiskStore):
    """While ``armed``: the first ``stage_commit`` of "x" waits at ``gate`` before its
    transaction (``entered`` set): the windowed park is past its commit point, unpublished."""

    armed = False
    entered = threading.Event()
    gate = threading.Event()

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        cls = HeldStage
        if cls.armed and m.seq_id == "x":
            cls.armed = False
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the gate"
        return super().stage_commit(m, replace, sync=sync)


@pytest.fixture
def held():
    HeldStage.entered.clear()
    HeldStage.gate.clear()
    HeldStage.armed = False
    yield HeldStage
    HeldStage.armed = False
    HeldStage.gate.set()


def test_create_after_drop_waits_for_a_windowed_create_an_overwrite_also_held(
        daemon: Callable[..., Daemon], held: type[HeldStage]) -> None:
    """write_back. W, a windowed create of "x", is held past its commit point. P, a plain
    overwrite of "x", holds it too, publishes and is answered; "x" is dropped. C, a plain
    create of "x", must wait for W: W then publishes (the drop is ordered before it) and C
    gets ALREADY_EXISTS; "x" reads back as W's bytes."""
    d = daemon(disk_factory=held, **SMALL)
    eng = d.engine
    assert eng is not None
    out: dict[str, object] = {}

    def park(tag: str, n: int, v: int) -> None:
        try:
            with Client(d.address, transport="inline") as cw:
                cw.park("x", [full(n, v)])
            out[tag] = None
        except BaseException as e:  # noqa: BLE001
            out[tag] = e

    held.armed = True
    tw = threading.Thread(target=park, args=("W", BIG, 1))
    tw.start()
    assert held.entered.wait(60), "W never reached its disk commit"
    with Client(d.address, transport="inline") as c:
        c.park("x", [full(4096, 2)], overwrite=True)  # P: an overwrite waits for nothing
        assert eng.drop("x")
        tc = threading.Thread(target=park, args=("C", 4096, 3))
        tc.start()
        wait_until(lambda: "C" in out or waiting_in("wait", "commit.py"), timeout=30)  # either is the finding
        c_early = out.get("C", "waiting")
        held.gate.set()
        tw.join(60)
        tc.join(60)
        assert not tw.is_alive() and not tc.is_alive()
        assert out["W"] is None, f"W: {out['W']!r}"
        assert isinstance(out["C"], AlreadyExists), f"C: {out['C']!r} (two creates of 'x' acknowledged)"
        (t,) = c.restore("x")
        assert t.numel() == BIG and bool((t == 1).all()), "'x' is not W's version"
        assert c_early == "waiting", f"C answered ({c_early!r}) while W's create of 'x' was still pending"
