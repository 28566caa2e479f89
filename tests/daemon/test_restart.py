"""Real `kvpark serve` processes: graceful restart, kill -9 under write_through, corruption."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client, DataLoss
from kvpark.tiers.disk import HEADER, Manifest, block_key

from ..conftest import Proc

pytestmark = pytest.mark.slow
MiB = 1 << 20


def data(i: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return [torch.randn(i + 1, 333, generator=g).to(torch.bfloat16),
            torch.randint(-128, 127, (3 * MiB // 2 + i,), dtype=torch.int8, generator=g)]


def test_sigterm_flushes_and_a_restart_restores_everything(proc: Callable[..., Proc]) -> None:
    p = proc()
    with Client(p.address) as c:
        for i in range(12):  # 18+ MiB into a 16 MiB host tier: some spill, some stay hot
            c.park(f"s{i}", data(i), priority=i % 3)
        hot = [s.seq_id for s in c.list() if s.tier == "host"]
        assert hot, "some sequences must still be host-only before the stop"
    assert p.terminate() == 0
    out = p.output()
    assert "flush:" in out and "kvpark stopped" in out
    shm_dir = Path(p.popen.args[p.popen.args.index("--set") + 3].split("=", 1)[1])
    assert not list(shm_dir.glob("kvpark-*.arena")), "the arena file is removed on stop"

    p2 = proc()
    with Client(p2.address) as c:
        infos = {s.seq_id: s for s in c.list()}
        assert set(infos) == {f"s{i}" for i in range(12)}
        assert all(s.tier == "disk" for s in infos.values())
        assert infos["s5"].priority == 2
        for i in range(12):
            back = c.restore(f"s{i}")
            assert all(torch.equal(a, b) for a, b in zip(data(i), back)), i
    assert p2.terminate() == 0


def test_sigkill_under_write_through_keeps_every_acknowledged_park(proc: Callable[..., Proc]) -> None:
    p = proc("--set", "policy.write=write_through")
    acked = []
    with Client(p.address) as c:
        for i in range(8):
            c.park(f"wt{i}", data(i))
            acked.append(f"wt{i}")
    p.kill()  # SIGKILL: no flush, no cleanup
    p2 = proc("--set", "policy.write=write_through")
    with Client(p2.address) as c:
        assert sorted(s.seq_id for s in c.list()) == sorted(acked)
        for i, sid in enumerate(acked):
            assert all(torch.equal(a, b) for a, b in zip(data(i), c.restore(sid)))
    # The killed daemon's arena file was left behind; the new daemon removed it.
    assert "removed 1 stale arena file" in p2.output()


def test_a_flipped_byte_on_disk_is_data_loss(proc: Callable[..., Proc], tmp_path: Path) -> None:
    p = proc("--set", "policy.write=write_through")
    with Client(p.address) as c:
        c.park("victim", data(1))
        c.park("bystander", data(2))
    assert p.terminate() == 0
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4)
    blocks, manifests = env.open_db(b"blocks"), env.open_db(b"manifests")
    with env.begin(write=True) as txn:
        m = Manifest.decode(txn.get(b"victim", db=manifests))
        key = block_key("victim", m.gen, 1)
        raw = bytearray(txn.get(key, db=blocks))
        raw[HEADER.size + 1000] ^= 0x40
        txn.put(key, bytes(raw), db=blocks)
    env.close()
    p2 = proc()
    for transport in ("inline", "shm"):
        with Client(p2.address, transport=transport) as c:
            with pytest.raises(DataLoss, match="checksum"):
                c.restore("victim")
            assert all(torch.equal(a, b) for a, b in zip(data(2), c.restore("bystander")))
            assert c.stat().leases == 0
    assert p2.popen.poll() is None


def test_cli_stat_and_bad_config(proc: Callable[..., Proc], tmp_path: Path) -> None:
    p = proc()
    with Client(p.address) as c:
        c.park("one", [torch.zeros(1000)])
    cli = [sys.executable, "-m", "kvpark.client.cli"]  # the `kvpark` entry point
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
    out = subprocess.run([*cli, "stat", "--all", "--address", p.address], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "host" in out.stdout and "disk" in out.stdout
    assert any(line.startswith("one ") for line in out.stdout.splitlines())
    js = subprocess.run([*cli, "stat", "--json"], capture_output=True, text=True, timeout=60,
                        env={**env, "KVPARK_ADDRESS": p.address})
    doc = json.loads(js.stdout)
    assert doc["tiers"]["host"]["sequences"] == 1 and doc["sequence_list"][0]["seq_id"] == "one"
    down = subprocess.run([*cli, "stat", "--address", "127.0.0.1:1"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert down.returncode == 1 and "no daemon answers at 127.0.0.1:1" in down.stderr, down.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[policy]\nwrite = "never"\n')
    r = subprocess.run([*cli, "serve", "--config", str(bad)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "policy.write" in r.stderr and "write_through" in r.stderr
    assert p.terminate() == 0


def test_unix_socket_and_sigint(proc: Callable[..., Proc], tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    p = Proc.start(tmp_path, "--listen", f"unix://{sock}")
    try:
        assert p.address == f"unix://{sock}"
        with Client(p.address) as c:
            c.park("u", [torch.ones(3)])
            assert torch.equal(c.restore("u")[0], torch.ones(3))
        p.popen.send_signal(signal.SIGINT)
        assert p.popen.wait(60) == 0
    finally:
        if p.popen.poll() is None:
            p.kill()


def test_a_second_daemon_on_the_same_data_dir_is_refused(proc: Callable[..., Proc], tmp_path: Path) -> None:
    p = proc()
    (tmp_path / "shm2").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
    r = subprocess.run([sys.executable, "-m", "kvpark.daemon.cli", "serve", "--listen", "127.0.0.1:0",
                        "--data-dir", str(tmp_path / "disk"), "--set", "tiers.host.capacity=16MiB",
                        "--set", "metrics.listen=",
                        "--set", f"tiers.host.shm_dir={tmp_path / 'shm2'}"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2  # a start-up refusal, in one line
    assert "in use by another kvpark daemon" in r.stderr and str(p.popen.pid) in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("kvpark: cannot start: "), r.stderr
    assert not list((tmp_path / "shm2").glob("*.arena")), "nothing left behind by the refused daemon"
    with Client(p.address) as c:  # the first one is unaffected
        c.park("ok", [torch.ones(2)])
    assert p.terminate() == 0
