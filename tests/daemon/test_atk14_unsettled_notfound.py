"""Fresh-eyes attack on 4f5a4df (absence answered only once durable): two NOT_FOUND
answers the change did not route through ``Engine.absent`` / ``Deletes.settle``.

A drop retires an id and is held in its disk delete (the manifest still in LMDB). In
that window another client is told the id is not parked by a path that never settles,
and a SIGKILL right after that answer brings the id back.

- a tenant's prefetch with a quota on the target tier: ``TenantView.prefetch`` calls
  ``engine.info`` (settled) and then ``catalog.get`` directly (not settled);
- a park naming the id as a shared-block reference: ``Catalog.plan_commit`` answers
  NOT_FOUND "referenced shared block ... is not parked" (commit path, not settled).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import NotFound
from kvpark.tiers.disk import DiskStore, Manifest

from .disk_seams import crash_image, waiting_in
from .test_tenants import TOKENS, tenants

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


class HeldDelete(DiskStore):
    """The next ``delete`` of an id ending in ``suffix`` waits at ``gate`` (``entered`` set)."""

    suffix = ""
    entered = threading.Event()
    gate = threading.Event()

    def delete(self, m: Manifest, sync: bool = False) -> None:
        cls = HeldDelete
        if cls.suffix and m.seq_id.endswith(cls.suffix):
            cls.suffix = ""
            cls.entered.set()
            assert cls.gate.wait(60), "the test never opened the delete gate"
        super().delete(m, sync=sync)


def _reset() -> None:
    HeldDelete.suffix = ""
    HeldDelete.entered.clear()
    HeldDelete.gate.clear()


def _settled_or_answered(out: dict) -> None:
    """Until the asking thread answered or waits in ``Deletes.settle`` (a fixed daemon)."""
    deadline = time.monotonic() + 30
    while "answer" not in out and not waiting_in("settle", "deletes.py") and time.monotonic() < deadline:
        time.sleep(0.01)


def _present_after_crash(daemon: Callable[..., Daemon], image: str, sid: str, **over: object) -> list[bool]:
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false", **over})
    with Client(d2.address, **({"token": TOKENS["alice"]} if over else {})) as c:
        return c.present([sid])


def test_a_tenant_prefetch_answering_not_found_while_a_drops_delete_is_under_way_never_sees_it_come_back(
        daemon: Callable[..., Daemon], tmp_path) -> None:
    """write_through, tenant alice with a host quota. alice's "x" is on disk only. alice
    prefetches x to host: ``TenantView.prefetch`` asks ``engine.info`` (x is there), and
    right then another client of alice drops x, held in its disk delete. The prefetch's
    own ``catalog.get`` raises NOT_FOUND, answered at once (no ``settle``). SIGKILL at
    that answer: the restart finds x's manifest and x is parked again."""
    _reset()
    over = {**tenants(**{"alice.quota": {"host": "64MiB"}}), "policy.write": "write_through",
            "policy.flush_on_shutdown": "false", "policy.promote_on_restore": "false"}
    d = daemon(disk_factory=HeldDelete, **over)
    eng = d.engine
    assert eng is not None
    out: dict = {}
    try:
        with Client(d.address, token=TOKENS["alice"]) as c, Client(d.address, token=TOKENS["alice"]) as c2:
            c.park("x", [full(MiB, 5)])
            full_id = next(s.seq_id for s in eng.list() if s.seq_id.endswith("x"))
            assert eng.mover.demote(full_id, "host")  # on disk only
            real_info = eng.info
            dropper: list[threading.Thread] = []

            def info_then_drop(seq_id: str):
                got = real_info(seq_id)
                if seq_id == full_id and not dropper:
                    # Between the tenant's info and its catalog.get: another client drops x.
                    HeldDelete.suffix = full_id
                    t = threading.Thread(target=lambda: c2.drop("x", timeout=60))
                    dropper.append(t)
                    t.start()
                    assert HeldDelete.entered.wait(30), "the drop never reached its disk delete"
                return got

            eng.info = info_then_drop  # type: ignore[method-assign]

            def ask() -> None:
                try:
                    out["answer"] = c.prefetch("x", tier="host", wait=True, timeout=60)
                except BaseException as e:  # noqa: BLE001
                    out["answer"] = e
                out["image"] = crash_image(eng.disk, str(tmp_path / "crash"))

            a = threading.Thread(target=ask)
            a.start()
            _settled_or_answered(out)
            HeldDelete.gate.set()
            a.join(60)
            for t in dropper:
                t.join(60)
            del eng.info
    finally:
        HeldDelete.gate.set()
        _reset()
    d.stop(0.5)
    after = _present_after_crash(daemon, out["image"], "x", **tenants(**{"alice.quota": {"host": "64MiB"}}))
    assert isinstance(out["answer"], NotFound), out["answer"]
    assert after == [False], (
        f"prefetch(x) answered {out['answer']!r} while the drop of x was deleting it; after a SIGKILL right "
        f"then present(x)={after}: x came back")


def test_a_park_told_its_shared_block_is_not_parked_never_sees_the_block_come_back(
        daemon: Callable[..., Daemon], tmp_path) -> None:
    """write_through. "p" references shared block "b"; a drop of p retires b with it (its
    last user) and is held in b's disk delete. Another client parks "q" with refs=["b"]: NOT_FOUND "referenced shared
    block 'b' is not parked", answered at once (``plan_commit``, no ``settle``). SIGKILL
    at that answer: b is parked again after the restart."""
    _reset()
    d = daemon(disk_factory=HeldDelete, **{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    out: dict = {}
    try:
        with Client(d.address) as c, Client(d.address) as c2:
            c.park("p", [full(4096, 1)], refs=["b"], new_blocks={"b": [full(4096, 2)]})
            HeldDelete.suffix = "b"
            t = threading.Thread(target=lambda: c.drop("p", timeout=60))
            t.start()
            assert HeldDelete.entered.wait(30), "the drop of p never reached b's disk delete"

            def ask() -> None:
                try:
                    out["answer"] = c2.park("q", [full(4096, 3)], refs=["b"], timeout=60)
                except BaseException as e:  # noqa: BLE001
                    out["answer"] = e
                out["image"] = crash_image(eng.disk, str(tmp_path / "crash"))

            a = threading.Thread(target=ask)
            a.start()
            _settled_or_answered(out)
            HeldDelete.gate.set()
            a.join(60)
            t.join(60)
    finally:
        HeldDelete.gate.set()
        _reset()
    d.stop(0.5)
    after = _present_after_crash(daemon, out["image"], "b")
    assert isinstance(out["answer"], NotFound), out["answer"]
    assert after == [False], (
        f"park(q, refs=[b]) answered {out['answer']!r} while the drop of p was deleting b; after a SIGKILL "
        f"right then present(b)={after}: b came back")
