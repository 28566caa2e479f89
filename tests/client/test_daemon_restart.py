"""Live clients across a daemon restart: every mapping names its daemon instance.

A worker keeps its ``Client`` while the daemon restarts (an upgrade, systemd restarting a
crashed one). gRPC reconnects by itself; the client's shared-memory mapping, its CUDA
IPC pool and its data-channel sockets belong to the daemon that is gone. Every later
call must either work with exactly the parked bytes or raise a typed ``KVParkError``:
never copy into or out of the old daemon's memory.

The daemons are real ``kvpark serve`` processes on one unix socket (the address outlives
the process) over one data directory, with ``policy.write = write_through`` so that
sequences survive SIGKILL. Every byte a live client gets back is also checked against
what a fresh client restores.
"""

from __future__ import annotations

import pickle
import socket
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvpark.client import Client, KVParkError, LeaseExpired
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..conftest import Proc, wait_until

pytestmark = pytest.mark.slow
KiB, MiB = 1 << 10, 1 << 20

# (name, transport, daemon flags): shm maps the arena; inline moves bytes on the data
# channel's sockets or, with the channel off, on gRPC streams (nothing to go stale).
PATHS = {
    "shm": ("shm", ()),
    "inline-datachannel": ("inline", ("--set", "server.data_channel=true")),
    "inline-grpc": ("inline", ("--set", "server.data_channel=false")),
}


def data(seed: int, n: int = 600 * KiB) -> list[torch.Tensor]:
    """Large enough for the reserve/commit and acquire/release paths (past one round trip)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (n,), dtype=torch.int8, generator=g),
            torch.randn(7, 333, generator=g).to(torch.bfloat16)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


class Daemons:
    """One address and data directory; ``restart(kill)`` stops the daemon (SIGKILL or
    SIGTERM) and starts a new one in its place."""

    def __init__(self, tmp_path: Path, flags: tuple[str, ...]) -> None:
        self.tmp_path = tmp_path
        self.flags = ("--listen", f"unix://{tmp_path / 'kvpark.sock'}", "--set", "policy.write=write_through",
                      *flags)
        self.procs: list[Proc] = []
        self.start()

    @property
    def address(self) -> str:
        return self.procs[-1].address

    def start(self) -> None:
        self.procs.append(Proc.start(self.tmp_path, *self.flags))

    def restart(self, kill: bool) -> None:
        p = self.procs[-1]
        if kill:
            p.kill()
        else:
            assert p.terminate() == 0
        self.start()

    def close(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.kill()


@pytest.fixture
def daemons(tmp_path: Path) -> Any:
    made: list[Daemons] = []

    def make(flags: tuple[str, ...] = ()) -> Daemons:
        d = Daemons(tmp_path, flags)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def reachable(c: Client) -> Callable[[], bool]:
    """The client's channel has reconnected (a call that hands out no memory answers)."""
    def ok() -> bool:
        try:
            c.stat(timeout=2.0)
            return True
        except KVParkError:
            return False
    return ok


class Outcomes:
    """Each call after the restart: right bytes, or a typed error; wrong bytes are listed."""

    def __init__(self) -> None:
        self.wrong: list[str] = []
        self.typed: list[str] = []

    def run(self, what: str, fn: Callable[[], Any], check: Callable[[Any], bool] = lambda _: True) -> None:
        try:
            got = fn()
        except KVParkError as e:
            self.typed.append(f"{what}: {type(e).__name__}: {e}")
            return
        if not check(got):
            self.wrong.append(what)


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.view(torch.uint8).flatten() for t in ts])


def grant_bytes(c: Client, seq_id: str) -> torch.Tensor | None:
    """A lookup that acquires, then the grant copied out (None: nothing was acquired, or a
    leased grant on a client without the arena, which is TransportUnavailable by design)."""
    _, g = c.lookup_acquire([seq_id])
    if g is None:
        return None
    if not g.inlined and c.transport != "shm":
        c.release_grant(g)
        return None
    out = torch.empty(g.nbytes, dtype=torch.uint8)
    c.restore_grant(g, into_flat=out)
    return out


# Each call after the restart, in this order: (name, call, check of what it returns).
OPS: list[tuple[str, Callable[[Client], Any], Callable[[Any], bool]]] = [
    ("restore old (from disk)", lambda c: c.restore("old"), lambda t: same(t, data(1))),
    ("park new", lambda c: c.park("new", data(2), overwrite=True), lambda _: True),
    ("restore new", lambda c: c.restore("new"), lambda t: same(t, data(2))),
    ("restore_many", lambda c: c.restore_many(["old", "filler1"])[1], lambda t: same(t, data(1) + data(101))),
    ("prefetch, restore", lambda c: (c.prefetch("filler2", tier="host", wait=True, timeout=10.0),
                                     c.restore("filler2"))[1], lambda t: same(t, data(102))),
    ("lookup_acquire", lambda c: grant_bytes(c, "old"), lambda f: f is None or torch.equal(f, flat(data(1)))),
]


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_live_client_never_touches_the_memory_of_a_restarted_daemon(daemons: Any, path: str, kill: bool) -> None:
    """One live client per call, so that each kind of call is the first its client makes
    after the restart (the one that meets the stale mapping); then one client makes them
    all again, and a fresh client checks what the daemon holds."""
    transport, flags = PATHS[path]
    d = daemons(flags)
    clients = [Client(d.address, transport=transport, timeout=20.0) for _ in OPS]
    try:
        c = clients[0]
        assert c.transport == transport
        # Fillers first: the old arena's first slots then hold bytes of their own, so a
        # stale mapping read at the new daemon's offsets can never look right by chance.
        for i in range(4):
            c.park(f"filler{i}", data(100 + i))
        c.park("old", data(1))
        for k in clients:
            assert same(k.restore("old"), data(1))  # each has used its mapping (or data channel)
        d.restart(kill)
        for k in clients:
            assert wait_until(reachable(k), timeout=30.0), "a client's channel never reconnected"

        out = Outcomes()
        for k, (what, call, check) in zip(clients, OPS):
            out.run(f"{what} (first call)", lambda: call(k), check)
        for what, call, check in OPS:
            out.run(f"{what} (again)", lambda: call(c), check)
        out.run("park after", lambda: c.park("after", data(3)))
        with Client(d.address, transport=transport) as fresh:  # what the daemon really holds
            for sid, seed in (("old", 1), ("new", 2), ("after", 3), ("filler0", 100)):
                out.run(f"fresh restore {sid}", lambda: fresh.restore(sid), lambda t: same(t, data(seed)))
        assert not out.wrong, f"wrong bytes from {out.wrong} (typed errors: {out.typed})"
        # Nothing here needs an error: a stale mapping is dropped and the call retried.
        assert not out.typed, out.typed
    finally:
        for k in clients:
            k.close()



def test_a_park_written_to_the_old_arena_is_never_committed_by_the_new_daemon(daemons: Any) -> None:
    """The daemon restarts between the client's copy into the arena and its Commit: the
    new daemon refuses that commit (its lease is another instance's), and the client
    parks again, whole, on the new mapping."""
    d = daemons()
    c = Client(d.address, transport="shm", timeout=20.0)
    try:
        c.park("warm", data(5))
        real = c.rpc.commit
        restarted: list[bool] = []

        def commit_after_restart(req: pb.CommitRequest, **kw: Any) -> Any:
            if not restarted:  # the bytes are in the old arena now; the old daemon goes
                restarted.append(True)
                d.restart(kill=True)
                assert wait_until(reachable(c), timeout=30.0)
            return real(req, **kw)

        c.rpc.commit = commit_after_restart
        c.park("gap", data(6))
        assert restarted
        with Client(d.address, transport="shm") as fresh:
            assert same(fresh.restore("gap"), data(6))
        assert same(c.restore("gap"), data(6))
    finally:
        c.close()


def test_a_commit_naming_another_daemon_instance_is_refused(daemons: Any) -> None:
    d = daemons()
    with Client(d.address, transport="shm") as c:
        h = c.rpc.call(c.rpc.hello, pb.HelloRequest())
        assert len(h.instance) == 32
        spec = pb.ParkHeader(seq_id="x", nbytes=256 * KiB, tensors=[pb.TensorMeta(dtype="uint8", shape=[256 * KiB],
                                                                                  nbytes=256 * KiB)])
        r = c.rpc.call(c.rpc.reserve, pb.ReserveRequest(header=spec, tier="host"))
        assert r.instance == h.instance
        with pytest.raises(LeaseExpired, match="instance"):
            c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id, instance="0" * 32))
        with pytest.raises(LeaseExpired, match="instance"):
            c.rpc.call(c.rpc.window, pb.WindowRequest(lease_id=r.lease_id, index=1, instance="0" * 32))
        assert c.present(["x"]) == [False]
        c.rpc.release_quietly(r.lease_id)


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_a_grant_handed_to_a_worker_with_a_stale_mapping_is_read_from_the_new_arena(daemons: Any,
                                                                                     kill: bool) -> None:
    """The vLLM handoff: the scheduler's lookup acquires from the new daemon; the worker,
    whose mapping is of the old one, re-maps before it copies (or falls back typed)."""
    d = daemons()
    worker = Client(d.address, transport="shm", timeout=20.0)
    try:
        for i in range(4):
            worker.park(f"filler{i}", data(100 + i))
        worker.park("blk", data(7))
        assert same(worker.restore("blk"), data(7))
        d.restart(kill)
        assert wait_until(reachable(worker), timeout=30.0)
        with Client(d.address, transport="inline") as scheduler:
            worker.prefetch("blk", tier="host", wait=True, timeout=10.0)  # a memory hit: the lookup acquires it
            _, grant = scheduler.lookup_acquire(["blk"])
            assert grant is not None and not grant.inlined
            grant = pickle.loads(pickle.dumps(grant))  # as it crosses to the worker process
            flat = torch.empty(grant.nbytes, dtype=torch.uint8)
            worker.restore_grant(grant, into_flat=flat)
            assert torch.equal(flat, torch.cat([t.view(torch.uint8).flatten() for t in data(7)]))
    finally:
        worker.close()


def test_a_grant_of_a_daemon_that_is_gone_is_refused_typed(daemons: Any) -> None:
    """A grant issued before the restart, read by a worker that has re-mapped since: its
    lease died with its daemon, so it is ``LeaseExpired`` (the worker loads the usual way)."""
    d = daemons()
    worker = Client(d.address, transport="shm", timeout=20.0)
    try:
        worker.park("blk", data(8))
        with Client(d.address, transport="inline") as scheduler:
            _, grant = scheduler.lookup_acquire(["blk"])
        assert grant is not None and not grant.inlined
        d.restart(kill=True)
        assert wait_until(reachable(worker), timeout=30.0)
        assert same(worker.restore("blk"), data(8))  # re-maps onto the new daemon
        flat = torch.empty(grant.nbytes, dtype=torch.uint8)
        with pytest.raises(LeaseExpired, match="instance"):
            worker.restore_grant(grant, into_flat=flat)
    finally:
        worker.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_inline_client_uses_the_data_channel_of_the_restarted_daemon(daemons: Any) -> None:
    """On a TCP address the data channel takes a free port at every start: a live inline
    client follows the new daemon's channel (no stale address, no fall back to the gRPC
    streams), and its bytes are right either way."""
    d = daemons(("--listen", f"127.0.0.1:{free_port()}"))
    c = Client(d.address, transport="inline", timeout=20.0)
    try:
        c.park("old", data(1))
        assert same(c.restore("old"), data(1))
        first = c.server.data_channel.address
        d.restart(kill=True)
        assert wait_until(reachable(c), timeout=30.0)
        now = c.rpc.call(c.rpc.hello, pb.HelloRequest())
        assert now.data_channel.address != first  # a new port (else this test shows nothing)
        c.park("new", data(2))
        assert same(c.restore("old"), data(1)) and same(c.restore("new"), data(2))
        assert c.server.instance == now.instance
        assert c.server.data_channel.address == now.data_channel.address
        channel = c._transport.channel  # type: ignore[attr-defined]
        assert channel is not None and channel.usable, "the client gave up the data channel"
    finally:
        c.close()


GPU_FLAGS = ("--set", "tiers.device.enabled=true", "--set", "tiers.device.device=cuda:0",
             "--set", "tiers.device.capacity=64MiB")


@pytest.mark.cuda
@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_a_live_client_never_touches_the_device_pool_of_a_restarted_daemon(daemons: Any, kill: bool) -> None:
    """cuda_ipc: the device pool opened through CUDA IPC is the old daemon's; the client
    reopens the new one's before any device-to-device copy."""
    d = daemons(GPU_FLAGS)
    c = Client(d.address, timeout=20.0)
    try:
        old = [t.cuda() for t in data(1)]
        for i in range(4):
            assert c.park(f"filler{i}", [t.cuda() for t in data(100 + i)]).tier == "device"
        assert c.park("old", old).tier == "device"
        assert same([t.cpu() for t in c.restore("old", device="cuda:0")], data(1))
        d.restart(kill)
        assert wait_until(reachable(c), timeout=30.0)
        c.prefetch("old", tier="device", wait=True, timeout=30.0)
        assert same([t.cpu() for t in c.restore("old", device="cuda:0")], data(1))
        c.park("new", [t.cuda() for t in data(2)])
        with Client(d.address) as fresh:
            assert same(fresh.restore("new"), data(2))
            assert same([t.cpu() for t in fresh.restore("new", device="cuda:0")], data(2))
    finally:
        c.close()


def _arenas_mapped() -> set[str]:
    """The daemon arena files this process has mapped now (Linux: /proc/self/maps)."""
    with open("/proc/self/maps") as fh:
        return {line.split(None, 5)[5].strip().removesuffix(" (deleted)") for line in fh
                if ".arena" in line and len(line.split(None, 5)) == 6}


def test_a_remap_lets_go_of_the_old_daemons_arena(daemons: Any) -> None:
    """Once a live client has moved to the restarted daemon, it no longer maps the old
    daemon's arena: a worker that lives across many restarts would otherwise keep every
    old arena (a file the size of the host tier, deleted but held) mapped."""
    d = daemons(PATHS["shm"][1])
    with Client(d.address, transport="shm", timeout=20.0) as c:
        c.park("s", data(1))
        assert same(c.restore("s"), data(1))
        old = _arenas_mapped()
        assert old, "the shm client maps no arena"
        d.restart(kill=False)
        assert wait_until(reachable(c), timeout=30.0)
        assert same(c.restore("s"), data(1))  # meets the stale mapping, remaps, reads the new arena
        now = _arenas_mapped()
        assert now and not (now & old), f"still mapped after the remap: {sorted(now & old)}"
