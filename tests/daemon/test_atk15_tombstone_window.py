"""Fresh-eyes attack 15 on "absence is durable when it is answered" (4f5a4df..f59e3ec):
with a remote tier, what keeps a dropped version from coming back at a restart is its
tombstone on disk (``RemoteTier.forget`` writes it before the drop is acknowledged; the
Redis copy is deleted in the background after that). A drop's claim on the version
(``Deletes.claim``) ends when its LMDB delete has been tried (``delete_all``), which in
``maintenance.finish_drop`` comes *before* ``forget_remote`` writes that tombstone. In
between, the version is out of the index, its local manifest gone, its tombstone only in
memory and its Redis copy still there: another client's ``present`` (or drop, restore,
info) finds nothing to wait for and answers that the id is gone. A SIGKILL right after
that answer leaves no tombstone on disk: the restart adopts the version from Redis and
the id is back. No fault at all: only the order of two steps of one drop (the test holds
the tombstone's disk write, an LMDB transaction, at a gate to hit the window)."""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.tiers.tombs import Tombs

from ..conftest import wait_until
from .disk_seams import crash_image
from .test_absence_before_durable import answer_then_crash, settle_or_answer
from .test_remote_tier import _new_ns, _remote

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def _never_deleted(self, m) -> None:
    """The Redis delete a killed daemon never made (and the restart's, so the test sees
    what the tombstone alone does): it fails, so no tombstone is let go for it."""
    from kvpark.proto.errors import Unavailable

    raise Unavailable("test: this Redis delete never happens")


def test_present_answered_while_a_drop_writes_its_tombstone_never_sees_x_come_back_from_redis(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = _new_ns()
    over = {"policy.write": "write_through", "policy.flush_on_shutdown": "false",
            **_remote(redis_server.url, ns, write="write_through")}
    entered, gate = threading.Event(), threading.Event()
    original = Tombs.add

    def slow_add(self: Tombs, manifests) -> None:  # a slow disk: the write lands, later
        if any(m.seq_id == "x" for m in manifests) and not gate.is_set():
            entered.set()
            assert gate.wait(60), "the test never opened the tombstone gate"
        original(self, manifests)

    monkeypatch.setattr(Tombs, "add", slow_add)
    d = daemon(**over)
    eng = d.engine
    assert eng is not None
    out: dict = {}
    with Client(d.address) as c, Client(d.address) as c2:
        c.park("x", [full(MiB, 5)])
        assert wait_until(lambda: eng.catalog.find("x").on_remote, timeout=30), "x never reached Redis"
        t = threading.Thread(target=lambda: out.setdefault("drop", c.drop("x", timeout=60)))
        t.start()
        try:
            assert entered.wait(30), "the drop never reached its tombstone write"
            # A SIGKILL right after the answer: this process never deletes x's Redis copy
            # (the drop does it in the background once its tombstone is written). Keep this
            # daemon from doing it.
            assert eng.remote is not None
            monkeypatch.setattr(type(eng.remote.store), "delete", _never_deleted)
            b, got = answer_then_crash(eng, lambda: c2.present(["x"], timeout=30), str(tmp_path / "crash"))
            settle_or_answer(b)  # answered at once (the flaw), or waiting for the drop (the fix)
        finally:
            gate.set()
        b.join(60)
        out.update(got)
        t.join(60)
    d.stop(0.5)
    # The restart, on what the SIGKILL left, with the same Redis.
    monkeypatch.setattr(Tombs, "add", original)
    d2 = daemon(**{**over, "tiers.disk.path": out["image"]})
    with Client(d2.address) as c3:
        after = c3.present(["x"])
    assert out["answer"] == [False], out["answer"]
    assert after == [False], (
        f"present(x) answered {out['answer']} while a drop of x was writing its tombstone; after a SIGKILL right "
        f"then, the restart's present(x)={after}: x adopted back from Redis")


def test_a_drop_whose_tombstone_write_failed_is_not_answered_absent_while_redis_holds_it(
        daemon: Callable[..., Daemon], redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The related case: the drop's tombstone write fails (the drop answers UNAVAILABLE)
    and its Redis delete has not landed (Redis down for deletes). The tombstone holds in
    memory only, so ``present`` used to answer ``[False]``; a restart then adopted x back
    from Redis. Now such an id answers UNAVAILABLE (``RemoteTier.loose``) until the Redis
    delete lands; then absence, durable (nothing left to adopt)."""
    import lmdb

    from kvpark.proto.errors import Unavailable

    ns = _new_ns()
    over = {"policy.write": "write_through", "policy.flush_on_shutdown": "false",
            **_remote(redis_server.url, ns, write="write_through")}
    original = Tombs.add

    def failing_add(self: Tombs, manifests) -> None:
        if any(m.seq_id == "x" for m in manifests):
            raise lmdb.Error("injected: EIO")
        original(self, manifests)

    d = daemon(**over)
    eng = d.engine
    assert eng is not None and eng.remote is not None
    with Client(d.address) as c:
        c.park("x", [full(MiB, 5)])
        assert wait_until(lambda: eng.catalog.find("x").on_remote, timeout=30), "x never reached Redis"
        store_cls = type(eng.remote.store)
        real_delete = store_cls.delete
        monkeypatch.setattr(store_cls, "delete", _never_deleted)
        monkeypatch.setattr(Tombs, "add", failing_add)
        with pytest.raises(Unavailable):
            c.drop("x", timeout=30)
        with pytest.raises(Unavailable):
            c.present(["x"], timeout=30)
        with pytest.raises(Unavailable):
            c.drop("x", timeout=30)
        # Redis deletes work again: the background retry lands, and absence is durable.
        monkeypatch.setattr(store_cls, "delete", real_delete)
        deadline = time.monotonic() + 30
        while eng.remote.loose(["x"]) and time.monotonic() < deadline:
            eng.remote._last_retry = 0.0  # noqa: SLF001 (the retry's pacing, not its work)
            eng.remote.retry_forgets()
            time.sleep(0.05)
        assert c.present(["x"], timeout=30) == [False]
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    monkeypatch.setattr(Tombs, "add", original)
    d2 = daemon(**{**over, "tiers.disk.path": image})
    with Client(d2.address) as c3:
        assert c3.present(["x"]) == [False]
