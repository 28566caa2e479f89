"""Fresh-eyes attack 16 on "absence is durable when it is answered" (4f5a4df..f240d0f):
the overwrite's side of the tombstone window that attack 15 closed for drops.

Under ``write_through`` with a remote tier, an overwrite of x (v1 -> v2) retires v1 and
tombstones it in memory (``retire_remote``) in its publish step, claims it, deletes v1's
disk copy and ends the claim (``delete_all(..., claimed=True)``), and only then writes
v1's tombstone to disk (``engine.forget_remote(forget)`` in ``commit.py``; the same
order in ``window.py``). Redis still holds v1 (copied through after v1's park; v2's
copy to Redis is started after that tombstone write).

A drop of x by another client in that window retires v2, writes v2's tombstone, and
settles x: nothing of x is claimed, busy, queued or loose, so the drop answers True at
once. A SIGKILL right after that answer leaves v2's tombstone on disk but not v1's: the
restart finds v1 in Redis, untombstoned, and adopts it back: x, acknowledged dropped,
is present again with its *older* bytes. No fault at all: only a slow tombstone write
(one LMDB transaction; the test holds it at a gate to hit the window)."""

from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.tiers.tombs import Tombs

from ..conftest import wait_until
from .test_absence_before_durable import answer_then_crash, settle_or_answer
from .test_atk15_tombstone_window import _never_deleted
from .test_remote_tier import _new_ns, _remote

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


@pytest.mark.parametrize("nbytes", [MiB, 5 * MiB + 1], ids=["plain", "windowed"])
def test_a_drop_answered_while_an_overwrite_writes_the_old_versions_tombstone_never_sees_the_old_version_back(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """``plain``: ``commit.py``; ``windowed`` (larger than the 4 MiB host tier: through
    windows to disk): ``window.py``, the same order."""
    ns = _new_ns()
    over = {"policy.write": "write_through", "policy.flush_on_shutdown": "false", "tiers.host.capacity": "4MiB",
            **_remote(redis_server.url, ns, write="write_through")}
    entered, gate = threading.Event(), threading.Event()
    original = Tombs.add
    old_gen: list[int] = []

    def slow_add(self: Tombs, manifests) -> None:  # a slow disk: the write lands, later
        if old_gen and any(m.seq_id == "x" and m.gen == old_gen[0] for m in manifests) and not gate.is_set():
            entered.set()
            assert gate.wait(60), "the test never opened the tombstone gate"
        original(self, manifests)

    monkeypatch.setattr(Tombs, "add", slow_add)
    d = daemon(**over)
    eng = d.engine
    assert eng is not None and eng.remote is not None
    out: dict = {}
    with Client(d.address, transport="inline") as c, Client(d.address, transport="inline") as c2:
        c.park("x", [full(nbytes, 1)])
        assert wait_until(lambda: eng.catalog.find("x").on_remote, timeout=30), "x v1 never reached Redis"
        old_gen.append(eng.catalog.find("x").gen)
        assert bool(eng.catalog.find("x").res) == (nbytes < 4 * MiB), "windowed: straight to disk, never in memory"
        t = threading.Thread(target=lambda: out.setdefault("park", c.park("x", [full(nbytes, 2)], overwrite=True,
                                                                             timeout=60)))
        t.start()
        try:
            assert entered.wait(30), "the overwrite never reached v1's tombstone write"
            assert eng.catalog.find("x").gen != old_gen[0], "v2 is not published yet"
            # A SIGKILL right after the drop's answer: this process never deletes v1 from
            # Redis. Keep this daemon (and the restart) from doing it.
            monkeypatch.setattr(type(eng.remote.store), "delete", _never_deleted)
            b, got = answer_then_crash(eng, lambda: c2.drop("x", timeout=30), str(tmp_path / "crash"))
            settle_or_answer(b)  # answered at once (the flaw), or waiting for the overwrite (a fix)
        finally:
            gate.set()
        b.join(60)
        out.update(got)
        t.join(60)
    d.stop(0.5)
    monkeypatch.setattr(Tombs, "add", original)
    d2 = daemon(**{**over, "tiers.disk.path": out["image"]})
    with Client(d2.address, transport="inline") as c3:
        after = c3.present(["x"])
        back = c3.restore("x")[0][:4].tolist() if after == [True] else None
    assert out["answer"] is True, out["answer"]
    assert after == [False], (
        f"drop(x) answered {out['answer']} while the overwrite v1->v2 of x was writing v1's tombstone; after a "
        f"SIGKILL right then, the restart's present(x)={after} (restored bytes {back}: v1's): v1 adopted back "
        "from Redis, its tombstone never written to disk")
