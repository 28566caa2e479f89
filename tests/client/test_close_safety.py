"""Closing a client (or remapping it) under a call another thread is running.

Each case runs in a child process, because the bug it guards against is a SIGSEGV (the
arena unmapped under a copy), which would take the test runner down with it. The child
pins the interleaving at the transport's boundary before its first byte moves (a
subclass registered under the transport's name): the call has its lease (or socket) in
hand, then the main thread closes the client, then the copy runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Callable

import pytest
import torch

from kvpark.client import Client, LeaseExpired
from kvpark.client import transport as tr
from kvpark.daemon.server import Daemon
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import wait_until

MiB = 1 << 20

_CHILD = textwrap.dedent(
    """
    import sys, threading, torch
    from kvpark.client import Client, KVParkError, Unavailable
    from kvpark.client import transport as tr

    address, path, op = sys.argv[1:4]
    entered, closed = threading.Event(), threading.Event()

    def pause():  # the call holds what it needs; the close lands now, before any byte moves
        if threading.current_thread().name == "caller":
            entered.set()
            assert closed.wait(60)

    class PausedShm(tr.Shm):
        def check(self, reply, what, lease_id=""):
            pause()
            return super().check(reply, what, lease_id)

    class PausedInline(tr.Inline):
        def _socket(self):
            pause()
            return super()._socket() if path == "channel" else None  # None: the gRPC stream

    tr.TRANSPORTS["shm"], tr.TRANSPORTS["inline"] = PausedShm, PausedInline
    payload = torch.arange(4 << 20, dtype=torch.int64).to(torch.uint8)
    c = Client(address, transport="inline" if path != "shm" else "shm")
    if op != "park":
        c.park("x", [payload])
    got = []

    def call():
        try:
            if op != "park":
                got.append(bool(torch.equal(c.restore("x")[0], payload)))
            else:
                c.park("y", [payload])
                got.append(True)
        except KVParkError as e:
            got.append(type(e).__name__)

    t = threading.Thread(target=call, name="caller")
    t.start()
    assert entered.wait(60)
    if op == "remap":
        # What a daemon restart makes another thread do: drop this client's mappings and
        # open fresh ones (here of the same daemon), while the call still copies through the old.
        c._remap(c.server.instance)
        closed.set()
        t.join(60)
        assert got == [True], got
        assert torch.equal(c.restore("x")[0], payload)
        c.close()
        print("ok", got[0], flush=True)
        sys.exit(0)
    c.close()
    closed.set()
    t.join(60)
    assert got in ([True], ["Unavailable"], ["Cancelled"]), got
    for late in (lambda: c.restore("x"), lambda: c.park("z", [payload]), c.stat):
        try:
            late()
            raise AssertionError("a call after close went through")
        except Unavailable:
            pass
    print("ok", got[0], flush=True)
    """
)


@pytest.mark.parametrize("path,op", [(p, o) for p in ("shm", "channel", "grpc") for o in ("restore", "park")]
                         + [("shm", "remap")])
def test_closing_a_client_under_a_running_call_never_crashes_and_later_calls_raise_typed_errors(
        daemon: Callable[..., Daemon], path: str, op: str) -> None:
    # remap: the client drops its mappings (as after a daemon restart) under the running restore.
    d = daemon()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
    r = subprocess.run([sys.executable, "-c", _CHILD, d.address, path, op], env=env, timeout=180,
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    # The close waited for nothing: the running call ended on its own, with the right bytes.
    assert r.stdout.split() == ["ok", "True"], r.stdout
    with Client(d.address) as c:
        if op == "park":
            assert c.info("y").nbytes == 4 * MiB
        assert wait_until(lambda: c.stat().leases == 0)


class _ExpiresBeforeItsCopy(tr.Shm):
    """A reader whose copy out of the arena starts only once its lease was reaped and
    another park took the slots (a client descheduled for longer than ``leases.ttl_s``)."""

    reuse: Callable[[], None] = staticmethod(lambda: None)

    def _restore_leased(self, r: pb.AcquireResponse, target: tr.Target, release: bool = True,
                        usable_until: float | None = None) -> tr.Restoring:
        type(self).reuse()
        return super()._restore_leased(r, target, release, usable_until)


def test_a_shm_restore_whose_lease_expired_under_its_copy_never_returns_wrong_bytes(
        daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    # An empty host tier, below its watermarks throughout (nothing is demoted meanwhile):
    # the park after the drop lands in the slots the expired lease held.
    d = daemon(**{"leases.ttl_s": 0.3, "tiers.host.capacity": "8MiB"})
    old = torch.full((3 * MiB,), 1, dtype=torch.uint8)
    new = torch.full((3 * MiB,), 2, dtype=torch.uint8)
    with Client(d.address, transport="inline") as other:
        other.park("a", [old])
        other.flush()

        def reuse() -> None:
            assert wait_until(lambda: other.stat().leases == 0, timeout=30)  # reaped
            other.drop("a")
            # The slots are free once the reaper's end of the lease has run all through.
            assert wait_until(lambda: other.stat().tiers["host"].used_bytes == 0, timeout=30)
            other.park("b", [new])
            assert other.info("b").tier == "host"

        monkeypatch.setattr(_ExpiresBeforeItsCopy, "reuse", staticmethod(reuse))
        monkeypatch.setitem(tr.TRANSPORTS, "shm", _ExpiresBeforeItsCopy)
        with Client(d.address, transport="shm") as c:
            try:
                got = c.restore("a")[0]
            except LeaseExpired:
                return  # refused: the bytes copied were not the lease's any more
            assert torch.equal(got, old), "a restore returned another sequence's bytes"
