"""Deadlines everywhere: a frozen daemon (SIGSTOP) makes every call raise within its
deadline, never hang; after SIGCONT the same client works again."""

from __future__ import annotations

import math
import signal
import threading
import time
from typing import Callable, Iterator

import pytest
import torch

from kvpark.client import Client
from kvpark.client.rpc import DEFAULT_TIMEOUT_S, FLOOR_RATE, resolve_timeout
from kvpark.proto.errors import DeadlineExceeded, InvalidArgument, Unavailable
from ..conftest import Proc, wait_until


def test_timeout_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPARK_TIMEOUT", raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("KVPARK_TIMEOUT", "2.5")
    assert resolve_timeout(None) == 2.5
    assert resolve_timeout(7) == 7.0
    assert resolve_timeout(math.inf) is None  # explicitly no deadline
    for bad in (0, -1, math.nan, "soon"):
        with pytest.raises(InvalidArgument):
            resolve_timeout(bad)  # type: ignore[arg-type]
    monkeypatch.setenv("KVPARK_TIMEOUT", "never")
    with pytest.raises(InvalidArgument):
        resolve_timeout(None)


def test_data_deadline_grows_with_size(daemon) -> None:
    d = daemon()
    with Client(d.address, timeout=3.0) as c:
        assert c.rpc.data_timeout(0) == 3.0
        assert c.rpc.data_timeout(int(FLOOR_RATE)) == pytest.approx(4.0)
        with c.deadline(math.inf):
            assert c.rpc.data_timeout(1 << 30) is None
        with c.deadline(None):  # None inside deadline() is the connection's default
            assert c.rpc.timeout == 3.0


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_frozen_daemon_raises_then_recovers(proc, monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    # 1. A real daemon process; a client with default settings (the default deadline
    #    comes from KVPARK_TIMEOUT, kept short so the test is quick).
    p = proc()
    monkeypatch.setenv("KVPARK_TIMEOUT", "1.5")
    small = [torch.arange(64, dtype=torch.float32)]
    big = [torch.randn(1 << 20)]  # 4 MiB: a streamed / leased transfer
    with Client(p.address, transport=transport) as c:
        assert c.timeout == 1.5
        c.park("a", big)
        c.park("s", small)
        # 2. Freeze it: every kind of call raises a typed error instead of hanging.
        freeze(p)
        try:
            calls = {
                "park": lambda: c.park("b", big),
                "park_small": lambda: c.park("c", small),
                "restore": lambda: c.restore("a"),
                "restore_small": lambda: c.restore("s"),
                "info": lambda: c.info("a"),
                "stat": lambda: c.stat(),
                "lookup": lambda: c.lookup(["a"]),
                "per_call": lambda: c.list(timeout=0.5),
            }
            for name, fn in calls.items():
                box: list[BaseException | None] = []

                def run(fn=fn, box=box) -> None:
                    try:
                        fn()
                        box.append(None)
                    except BaseException as e:  # noqa: BLE001 - the test inspects it
                        box.append(e)

                t = threading.Thread(target=run, daemon=True)
                t.start()
                # Generous bound (load on a shared machine); a hang would never end.
                t.join(60)
                assert box, f"{name} hung on a frozen daemon"
                assert isinstance(box[0], (DeadlineExceeded, Unavailable)), f"{name}: {box[0]!r}"
        finally:
            # 3. Thaw it: the same client works again.
            p.popen.send_signal(signal.SIGCONT)
        out = c.restore("a")
        assert torch.equal(out[0], big[0])
        assert c.info("s").nbytes == small[0].numel() * 4


# ---------------------------------------------------------------------- deadline() bounds what is inside it

# The connection's default is large, so a call that ends well before it ended because of
# the tighter deadline it ran under, not because of the default.
LONG_S = 30.0
SHORT_S = 1.0


def freeze(p: Proc) -> None:
    """SIGSTOP the daemon and wait until it has stopped: the signal lands a moment later,
    and a call sent in that moment would still be answered."""
    p.popen.send_signal(signal.SIGSTOP)

    def stopped() -> bool:
        with open(f"/proc/{p.popen.pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")

    assert wait_until(stopped, timeout=30), "the daemon did not stop"


def frozen_call(fn: Callable[[], object], name: str = "the call") -> tuple[BaseException | None, float]:
    """Run ``fn`` on a thread; what it raised (None: it returned) and how long it took."""
    box: list[tuple[BaseException | None, float]] = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
            box.append((None, time.monotonic() - t0))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box.append((e, time.monotonic() - t0))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(3 * LONG_S)
    assert box, f"{name} hung on a frozen daemon"
    return box[0]


def assert_cut_by_deadline(name: str, fn: Callable[[], object]) -> None:
    err, took = frozen_call(fn, name)
    assert isinstance(err, (DeadlineExceeded, Unavailable)), f"{name}: {err!r}"
    # Far below the connection's default: the tighter deadline ended it.
    assert took < LONG_S / 2, f"{name} took {took:.1f}s: the call ran under the connection's default"


@pytest.fixture
def frozen(proc) -> Iterator[Callable[[str], tuple[Client, Proc]]]:
    """A ``kvpark serve`` process holding ``a`` (4 MiB) and ``s`` (small), and a client
    of it with a long default deadline; the daemon is frozen (SIGSTOP) until teardown."""
    opened: list[tuple[Client, Proc]] = []

    def start(transport: str) -> tuple[Client, Proc]:
        p = proc()
        c = Client(p.address, transport=transport, timeout=LONG_S)
        c.park("a", BIG)
        c.park("s", SMALL)
        freeze(p)
        opened.append((c, p))
        return c, p

    yield start
    for c, p in opened:
        p.popen.send_signal(signal.SIGCONT)
        c.close()


SMALL = [torch.arange(64, dtype=torch.float32)]
BIG = [torch.randn(1 << 20)]

# Every public call, as the caller writes it (no timeout= of its own).
PUBLIC_CALLS: dict[str, Callable[[Client], object]] = {
    "park": lambda c: c.park("b", BIG),
    "park_small": lambda c: c.park("c", SMALL),
    "park_batch": lambda c: c.park_batch({"d": BIG}),
    "restore": lambda c: c.restore("a"),
    "restore_small": lambda c: c.restore("s"),
    "restore_into": lambda c: c.restore("a", into=[torch.empty_like(BIG[0])]),
    "restore_many": lambda c: c.restore_many(["a", "s"]),
    "present": lambda c: c.present(["a"]),
    "lookup": lambda c: c.lookup(["a"]),
    "lookup_acquire": lambda c: c.lookup_acquire(["a"]),
    "prefetch": lambda c: c.prefetch("a", wait=True),
    "drop": lambda c: c.drop("s"),
    "info": lambda c: c.info("a"),
    "list": lambda c: c.list(),
    "stat": lambda c: c.stat(),
    "pin": lambda c: c.pin("a"),
    "flush": lambda c: c.flush(),
}


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_an_outer_deadline_bounds_every_public_call_inside_it(frozen, transport: str) -> None:
    # 1. A frozen daemon; the connection's default deadline is long.
    c, _ = frozen(transport)
    # 2. Each call, written without a timeout of its own, inside a short deadline():
    #    it ends (typed) by that deadline, not by the connection's default.
    for name, fn in PUBLIC_CALLS.items():
        def call(fn=fn) -> None:
            with c.deadline(SHORT_S):
                fn(c)

        assert_cut_by_deadline(name, call)


def test_a_sequence_of_calls_shares_one_deadline(frozen) -> None:
    c, p = frozen("inline")
    with c.deadline(SHORT_S):
        # 1. The first call waits out the whole deadline on the frozen daemon.
        with pytest.raises(DeadlineExceeded):
            c.lookup(["a"])
        # 2. The daemon answers again, at once; but nothing is left of this block's
        #    deadline, so the next call inside it is refused without waiting.
        p.popen.send_signal(signal.SIGCONT)
        with pytest.raises(DeadlineExceeded):
            c.lookup(["a"])
        with pytest.raises(DeadlineExceeded):
            c.lookup(["a"], timeout=LONG_S)  # a call's own timeout never widens the block's
    # 3. Outside the block the same client works: the deadline was the block's alone.
    assert c.lookup(["a"]) == 1


def test_a_calls_timeout_narrows_the_deadline_and_never_widens_it(frozen) -> None:
    c, _ = frozen("inline")
    cases = {
        # A call's own timeout narrows a looser block.
        "call_narrows": lambda: _within(c, LONG_S * 2, lambda: c.lookup(["a"], timeout=SHORT_S)),
        # A call's own timeout cannot widen a tighter block.
        "call_cannot_widen": lambda: _within(c, SHORT_S, lambda: c.lookup(["a"], timeout=LONG_S * 2)),
        # A nested block narrows the outer one.
        "nested_narrows": lambda: _within(c, LONG_S * 2, lambda: _within(c, SHORT_S, lambda: c.info("a"))),
        # A nested block cannot widen the outer one, not even to "no deadline".
        "nested_cannot_widen": lambda: _within(c, SHORT_S, lambda: _within(c, LONG_S * 2, lambda: c.info("a"))),
        "nested_inf": lambda: _within(c, SHORT_S, lambda: _within(c, math.inf, lambda: c.stat())),
    }
    for name, fn in cases.items():
        assert_cut_by_deadline(name, fn)


def _within(c: Client, seconds: float, fn: Callable[[], object]) -> object:
    with c.deadline(seconds):
        return fn()
