"""The remote tier through real daemons and real Redis servers (standalone and cluster).

Covers: demotion from disk to remote under disk pressure and the restore back; two
daemons with their own data dirs sharing one Redis (sequences and prefix blocks); the
same on a cluster with a node restarted mid-run; Redis killed mid-run; a corrupted
value; TTL expiry; namespace isolation.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, DataLoss, NotFound
from kvpark.client.cli import main as cli_main
from kvpark.daemon.server import Daemon

from ..conftest import wait_until
from ..redis_servers import RedisCluster, RedisServer, have_redis

MiB = 1 << 20
_ns = itertools.count()


def blob(i: int, n: int = MiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _remote(url: str, ns: str, cluster: bool = False, write: str = "write_through", **kw: object) -> dict:
    o = {"tiers.remote.url": url, "tiers.remote.namespace": ns, "tiers.remote.cluster": cluster,
         "tiers.remote.write": write, "tiers.remote.timeout_s": 1.0, "tiers.remote.breaker_cooldown_s": 0.2}
    o.update({f"tiers.remote.{k}": v for k, v in kw.items()})
    return o


def _own_dirs(tmp_path: Path, name: str) -> dict:
    (tmp_path / name / "shm").mkdir(parents=True)
    return {"tiers.disk.path": str(tmp_path / name / "disk"), "tiers.host.shm_dir": str(tmp_path / name / "shm")}


def _new_ns() -> str:
    return f"t{os.getpid()}-{next(_ns)}"


def _keys(srv: RedisServer | RedisCluster, ns: str) -> int:
    nodes = srv.nodes if isinstance(srv, RedisCluster) else [srv]
    return sum(len(n.cli("--scan", "--pattern", f"{ns}:*").split()) for n in nodes)


def _synced(c: Client) -> bool:
    r = c.stat().remote
    return r is not None and r.pending_writes == 0


def test_disk_pressure_demotes_to_remote_and_restores_bit_exact(daemon: Callable[..., Daemon], redis_server) -> None:
    ns = _new_ns()
    # Step 1: a 16 MiB host tier and a 24 MiB disk tier get 48 MiB of parks: the host
    # spills to disk, and the disk evicts its coldest to remote instead of refusing.
    d = daemon(**{"tiers.disk.capacity": "24MiB"}, **_remote(redis_server.url, ns, write="on_evict"))
    with Client(d.address, transport="inline") as c:
        for i in range(48):
            c.park(f"s{i:02d}", [blob(i)])
        st = c.stat()
        assert st.sequences == 48
        assert st.tiers["disk"].used_bytes <= 24 * MiB
        assert st.remote is not None and st.remote.sequences >= 8 and st.remote.state == "closed"
        assert c.info("s00").tier == "remote"
        assert _keys(redis_server, ns) > 0
        # Step 2: a remote one restores bit-exact and comes back up into the local tiers.
        assert torch.equal(c.restore("s00")[0], blob(0))
        assert c.info("s00").tier in ("host", "disk")
        # Step 3: every sequence restores bit-exact, wherever it lives (restoring them all
        # cycles them through the tiers again).
        for i in range(48):
            assert torch.equal(c.restore(f"s{i:02d}")[0], blob(i)), i
        assert c.stat().tiers["disk"].used_bytes <= 24 * MiB
        # Step 4: dropping a sequence removes it from remote too.
        far = [s.seq_id for s in c.list() if s.tier == "remote"]
        assert far, "nothing left on remote"
        assert c.drop(far[0])
        assert wait_until(lambda: _synced(c))
        assert not c.present([far[0]])[0]


def _share(tmp_path: Path, daemon: Callable[..., Daemon], url: str, cluster: bool) -> tuple[Daemon, Daemon, str]:
    ns = _new_ns()
    a = daemon(**_own_dirs(tmp_path, "a"), **_remote(url, ns, cluster))
    b = daemon(**_own_dirs(tmp_path, "b"), **_remote(url, ns, cluster))
    return a, b, ns


def _check_sharing(a: Daemon, b: Daemon) -> None:
    with Client(a.address) as ca, Client(b.address, transport="inline") as cb:
        # Step 1: park on A; the copy to remote happens after the ack.
        ca.park("conv-1", [blob(1, 3 * MiB + 5), blob(2, 1000)])
        ca.park_batch({"blk-0": [blob(10, 64 << 10)], "blk-1": [blob(11, 64 << 10)]})
        assert wait_until(lambda: _synced(ca), timeout=30)
        # Step 2: B has never seen them: info and restore find them on remote.
        assert cb.info("conv-1").tier == "remote"
        out = cb.restore("conv-1")
        assert torch.equal(out[0], blob(1, 3 * MiB + 5)) and torch.equal(out[1], blob(2, 1000))
        assert cb.info("conv-1").tier in ("host", "disk")
        # Step 3: A's prefix blocks are lookup hits on B.
        assert cb.lookup(["blk-0", "blk-1", "blk-2"]) == 2
        assert cb.present(["blk-1", "nope"]) == [True, False]
        assert torch.equal(cb.restore("blk-1")[0], blob(11, 64 << 10))


def test_two_daemons_share_one_redis(tmp_path: Path, daemon: Callable[..., Daemon], redis_server) -> None:
    a, b, _ = _share(tmp_path, daemon, redis_server.url, False)
    _check_sharing(a, b)


def test_two_daemons_share_one_cluster(tmp_path: Path, daemon: Callable[..., Daemon], redis_cluster) -> None:
    a, b, _ = _share(tmp_path, daemon, redis_cluster.url, True)
    _check_sharing(a, b)


def test_cluster_node_restarted_mid_run(tmp_path: Path, daemon: Callable[..., Daemon]) -> None:
    if have_redis():
        pytest.skip(have_redis())
    cl = RedisCluster(tmp_path / "cluster").start()
    try:
        a, b, _ = _share(tmp_path, daemon, cl.url, True)
        with Client(a.address) as ca, Client(b.address, transport="inline") as cb:
            ca.park("before", [blob(1, 2 * MiB)])
            assert wait_until(lambda: _synced(ca), timeout=30)
            # Step 1: a master dies; A keeps parking and restoring on its local tiers.
            cl.nodes[2].stop()
            for i in range(6):
                ca.park(f"during-{i}", [blob(20 + i, 2 * MiB)])
                assert torch.equal(ca.restore(f"during-{i}")[0], blob(20 + i, 2 * MiB))
            assert wait_until(lambda: ca.stat().remote.errors > 0, timeout=30)
            # Step 2: it comes back; the tier resumes: a new park reaches B through Redis.
            cl.nodes[2].start()
            cl.wait_ok()

            def shared() -> bool:
                ca.park("after", [blob(99, 2 * MiB)], overwrite=True)
                if not wait_until(lambda: _synced(ca), timeout=10):
                    return False
                try:
                    return torch.equal(cb.restore("after")[0], blob(99, 2 * MiB))
                except NotFound:
                    return False

            assert wait_until(shared, timeout=90, interval=0.5)
    finally:
        cl.stop()


def test_redis_killed_mid_run(daemon: Callable[..., Daemon], fresh_redis: RedisServer, capsys: pytest.CaptureFixture,
                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvpark")  # "resumed" is good news: INFO, not WARNING
    ns = _new_ns()
    d = daemon(**_remote(fresh_redis.url, ns))
    with Client(d.address, transport="inline") as c:
        c.park("a", [blob(1)])
        assert wait_until(lambda: _synced(c)) and _keys(fresh_redis, ns) > 0
        # Step 1: Redis dies. Parks and restores go on locally; nothing hangs.
        fresh_redis.stop()
        for i in range(10):
            c.park(f"k{i}", [blob(i)])
            assert torch.equal(c.restore(f"k{i}")[0], blob(i))
        assert torch.equal(c.restore("a")[0], blob(1))
        # A local miss is a miss (the remote manifest cannot be asked), not a hang.
        with pytest.raises(NotFound):
            c.info("never-parked")
        assert c.present(["never-parked", "k1"]) == [False, True]
        assert wait_until(lambda: c.stat().remote.errors > 0 and _synced(c), timeout=60)
        assert c.stat().remote.outages >= 1
        # One log line says the tier is degraded; `kvpark stat` says so too.
        assert any("remote tier degraded" in r.getMessage() for r in caplog.records)
        assert cli_main(["stat", "--address", d.address]) == 0
        assert "DEGRADED" in capsys.readouterr().out
        # Step 2: Redis is back (empty); the tier resumes: new parks reach it.
        fresh_redis.restart()

        def resumed() -> bool:
            c.park("z", [blob(7)], overwrite=True)
            return wait_until(lambda: _synced(c), timeout=10) and _keys(fresh_redis, ns) > 0

        assert wait_until(resumed, timeout=60, interval=0.3)
        assert c.stat().remote.state == "closed"
        assert any("remote tier resumed" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
        assert cli_main(["stat", "--address", d.address]) == 0
        assert "remote   ok" in capsys.readouterr().out


def test_corrupted_value_is_data_loss_and_deleted(tmp_path: Path, daemon: Callable[..., Daemon],
                                                   redis_server: RedisServer) -> None:
    a, b, ns = _share(tmp_path, daemon, redis_server.url, False)
    with Client(a.address) as ca, Client(b.address, transport="inline") as cb:
        ca.park("bad", [blob(3, 2 * MiB)])
        assert wait_until(lambda: _synced(ca))
        keys = redis_server.cli("--scan", "--pattern", f"{ns}:o:v:*").split()
        assert keys
        # Flip bytes in the middle of one chunk's payload, in Redis itself.
        redis_server.cli("setrange", keys[0], str(4096), "garbage")
        with pytest.raises(DataLoss):
            cb.restore("bad")
        assert _keys(redis_server, ns) == 0  # the whole sequence is gone from remote
        assert cb.stat().remote.data_loss == 1
        with pytest.raises(NotFound):
            cb.info("bad")
        # A's own copy is untouched.
        assert torch.equal(ca.restore("bad")[0], blob(3, 2 * MiB))


def test_ttl_expiry(daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    ns = _new_ns()
    d = daemon(**_remote(redis_server.url, ns, ttl_s=0.5))
    with Client(d.address) as c:
        c.park("brief", [blob(4)])
        assert wait_until(lambda: _synced(c))
        assert wait_until(lambda: _keys(redis_server, ns) == 0, timeout=20)
        assert torch.equal(c.restore("brief")[0], blob(4))  # the local copy has no remote TTL


def test_namespace_isolation(tmp_path: Path, daemon: Callable[..., Daemon], redis_server: RedisServer) -> None:
    a = daemon(**_own_dirs(tmp_path, "a"), **_remote(redis_server.url, _new_ns()))
    b = daemon(**_own_dirs(tmp_path, "b"), **_remote(redis_server.url, _new_ns()))
    with Client(a.address) as ca, Client(b.address) as cb:
        ca.park("mine", [blob(5)])
        assert wait_until(lambda: _synced(ca))
        assert cb.present(["mine"]) == [False]
        with pytest.raises(NotFound):
            cb.restore("mine")


def test_overwrite_on_one_daemon_is_what_another_restores(tmp_path: Path, daemon: Callable[..., Daemon],
                                                          redis_server: RedisServer) -> None:
    a, b, ns = _share(tmp_path, daemon, redis_server.url, False)
    with Client(a.address) as ca, Client(b.address, transport="inline") as cb:
        # Step 1: two versions in quick succession; the old one's remote delete and the
        # new one's copy are queued in that order.
        ca.park("v", [blob(1, 2 * MiB)])
        ca.park("v", [blob(2, 2 * MiB + 7)], overwrite=True)
        assert wait_until(lambda: _synced(ca))
        # Step 2: the other daemon gets the new version, never the old one.
        assert torch.equal(cb.restore("v")[0], blob(2, 2 * MiB + 7))
        # Step 3: a drop on A removes it fleet-wide (B's own copy stays B's until dropped).
        assert ca.drop("v")
        assert wait_until(lambda: _synced(ca))
        assert _keys(redis_server, ns) == 0


def test_a_redis_down_at_start_is_a_warning_and_degraded_until_it_answers(
        daemon: Callable[..., Daemon], fresh_redis: RedisServer, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture) -> None:
    ns = _new_ns()
    fresh_redis.stop()
    # Step 1: the daemon starts (a remote tier that is down is no reason to refuse), and
    # says at once that Redis does not answer, naming it, not at the first eviction.
    d = daemon(**_remote(fresh_redis.url, ns))
    assert any("does not answer at start" in r.getMessage() and f":{fresh_redis.port}" in r.getMessage()
               and r.levelno == logging.WARNING for r in caplog.records)
    with Client(d.address, transport="inline") as c:
        st = c.stat().remote
        assert st is not None and st.state != "closed" and st.outages == 1
        assert cli_main(["stat", "--address", d.address]) == 0
        assert "DEGRADED" in capsys.readouterr().out
        # Step 2: Redis comes back; with no park or eviction to call it, the maintenance
        # pass's ping finds it, and stat says ok.
        fresh_redis.restart()
        assert wait_until(lambda: c.stat().remote.state == "closed", timeout=30)  # type: ignore[union-attr]
        assert cli_main(["stat", "--address", d.address]) == 0
        assert "remote   ok" in capsys.readouterr().out


def test_a_park_refused_while_redis_is_down_says_so(daemon: Callable[..., Daemon], fresh_redis: RedisServer) -> None:
    # Host and disk full, and the disk evicts into Redis: with Redis down nothing can make
    # room, and the refusal says that it is Redis, not only byte counts.
    from kvpark.client import ResourceExhausted

    ns = _new_ns()
    fresh_redis.stop()  # down from the start: the start-up probe finds it so, whatever the timing after
    d = daemon(**_remote(fresh_redis.url, ns, write="on_evict"),
               **{"tiers.host.capacity": "2MiB", "tiers.disk.capacity": "2MiB", "policy.write": "write_through"})
    with Client(d.address, transport="inline") as c:
        with pytest.raises(ResourceExhausted) as e:
            for i in range(8):
                c.park(f"p{i}", [torch.full((1 << 20,), i, dtype=torch.uint8)])
    assert "the remote tier is down" in str(e.value) and "MiB" in str(e.value), str(e.value)
