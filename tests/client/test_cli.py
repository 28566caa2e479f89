"""The ``kvpark`` command line against real daemons: every command, its output and exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.client.cli import main
from kvpark.daemon.config import load
from kvpark.daemon.server import Daemon
from kvpark.proto import VERSION

from ..conftest import Proc

CLI = [sys.executable, "-m", "kvpark.client.cli"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_version_and_health(daemon: Callable[..., Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    r = subprocess.run([*CLI, "--version"], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"kvpark {VERSION}"
    d = daemon()
    rc, out, _ = run(capsys, "health", "--address", d.address)
    assert rc == 0 and "SERVING" in out
    address = d.address
    d.stop()
    rc, _, err = run(capsys, "health", "--address", address, "--timeout", "2")
    assert rc == 1 and "not serving" in err


def test_stat_summary_all_and_json(daemon: Callable[..., Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    d = daemon()
    with Client(d.address) as c:
        c.park("b1", [torch.ones(256)], pinned=True, ttl_s=3600)
        c.park("a2", [torch.ones(1000)], refs=["blk"], new_blocks={"blk": [torch.zeros(512)]})
    # Step 1: the summary counts sequences and shared blocks apart, once each, and no ids.
    rc, out, _ = run(capsys, "stat", "--address", d.address)
    assert rc == 0
    assert "2 sequence(s), 1 shared block(s), 0 lease(s)" in out
    assert "host" in out and "disk" in out and "b1" not in out
    # Step 2: --all lists every sequence with its pin, TTL and age.
    rc, out, _ = run(capsys, "stat", "--all", "--address", d.address)
    line = next(x for x in out.splitlines() if x.startswith("b1"))
    assert rc == 0 and "yes" in line and ("59m" in line or "60m" in line)
    assert any(x.startswith("blk") and "x1" in x for x in out.splitlines())
    # Step 3: --json.
    rc, out, _ = run(capsys, "stat", "--json", "--address", d.address)
    doc = json.loads(out)
    assert rc == 0 and doc["sequences"] == 2 and doc["shared_blocks"] == 1 and doc["leases"] == 0
    assert doc["version"] == VERSION and doc["address"] == d.address
    host = doc["tiers"]["host"]
    assert host["sequences"] == 3 and host["capacity_bytes"] == d.config.host_capacity
    assert host["state"] == "ok" and host["evictions"] == 0 and host["used_bytes"] > 0
    b1 = next(s for s in doc["sequence_list"] if s["seq_id"] == "b1")
    assert b1["pinned"] is True and 3500 < b1["ttl_s"] <= 3600 and b1["age_s"] >= 0 and b1["nbytes"] == 1024


def test_stat_watch_draws_a_bar_per_tier(daemon: Callable[..., Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    d = daemon()
    rc, out, _ = run(capsys, "stat", "--watch", "0.1", "--iterations", "2", "--address", d.address)
    assert rc == 0 and "host" in out and "disk" in out and "0 sequences, 0 shared blocks" in out


def test_info_drop_pin_unpin_flush(daemon: Callable[..., Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    d = daemon()
    with Client(d.address) as c:
        c.park("x", [torch.ones(4, 8)])
        c.park("t", [torch.ones(2)], ttl_s=3600)
    rc, out, _ = run(capsys, "info", "t", "--address", d.address)
    # People read durations and local times, not seconds and epochs (--json keeps those).
    assert rc == 0 and re.search(r"^expires in +(59|60)m$", out, re.M), out
    assert re.search(r"^last access +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(\d+s ago\)$", out, re.M), out
    rc, out, _ = run(capsys, "info", "x", "--address", d.address)
    assert rc == 0 and re.search(r"^expires in +never$", out, re.M), out
    with Client(d.address) as c:
        assert c.drop("t")
    rc, out, _ = run(capsys, "info", "x", "--json", "--address", d.address)
    doc = json.loads(out)
    assert rc == 0 and doc["tier"] == "host" and doc["tensors"] == [{"dtype": "float32", "shape": [4, 8],
                                                                       "nbytes": 128}]
    rc, out, _ = run(capsys, "info", "x", "--address", d.address)
    assert rc == 0 and "float32[4, 8]" in out
    # Pin, then unpin: the daemon's own record changes.
    assert run(capsys, "pin", "x", "--address", d.address)[0] == 0
    assert d.engine.info("x").pinned
    assert run(capsys, "unpin", "x", "--address", d.address)[0] == 0
    assert not d.engine.info("x").pinned
    # Flush writes the host-only sequence to disk.
    rc, out, _ = run(capsys, "flush", "--address", d.address)
    assert rc == 0 and out.startswith("1 sequence(s)") and d.engine.stat().tiers["disk"].sequences == 1
    rc, out, _ = run(capsys, "drop", "x", "--address", d.address)
    assert rc == 0 and d.engine.list() == []
    # Unknown ids: one clear line, exit 1, for every command that takes one.
    for cmd in ("info", "drop", "pin", "unpin"):
        rc, out, err = run(capsys, cmd, "nope", "--address", d.address)
        assert rc == 1 and "nope" in err and "Traceback" not in err, cmd
    rc, _, err = run(capsys, "info", "bad\x00id", "--address", d.address)
    assert rc == 1 and "InvalidArgument" in err


def test_a_pin_survives_a_restart(daemon: Callable[..., Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    d = daemon(**{"policy.write": "write_through"})
    with Client(d.address) as c:
        c.park("p", [torch.ones(100)])
    assert run(capsys, "pin", "p", "--address", d.address)[0] == 0
    d.stop()
    d2 = daemon()
    assert d2.engine.info("p").pinned


@pytest.mark.slow
def test_stat_into_a_closed_pipe_and_the_daemon_commands(proc: Callable[..., Proc], tmp_path: Path) -> None:
    p = proc()
    with Client(p.address) as c:
        for i in range(300):
            c.park(f"s{i:03d}", [torch.ones(10)])
    # `kvpark stat --all | head -1`: the reader leaves early; no traceback, exit 0.
    stat = subprocess.Popen([*CLI, "stat", "--all", "--address", p.address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    assert stat.stdout is not None and stat.stderr is not None
    first = stat.stdout.readline()
    stat.stdout.close()
    err = stat.stderr.read().decode()
    assert stat.wait(60) == 0 and first.startswith(b"kvpark at") and "Traceback" not in err, err
    # `kvpark config` prints TOML that --config reads back to the same config.
    r = subprocess.run([*CLI, "config"], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0
    tree = tomllib.loads(r.stdout)
    assert tree["policy"]["write"] == "write_back" and tree["tiers"]["host"]["capacity"] == "auto"
    assert "# one of: lru" in r.stdout
    f = tmp_path / "kvpark.toml"
    f.write_text(r.stdout)
    assert load(f, env={}) == load(env={})
    r2 = subprocess.run([*CLI, "config", "--config", str(f), "--set", "tiers.host.capacity=96MiB"],
                        capture_output=True, text=True, env=ENV, timeout=60)
    assert r2.returncode == 0 and 'capacity = "96MiB"' in r2.stdout
    g = tmp_path / "resolved.toml"
    g.write_text(r2.stdout)
    assert load(g, env={}) == load(f, env={}, overrides={"tiers.host.capacity": "96MiB"})
    # The daemon starts on a config `kvpark config` printed (ports and dirs set for the test).
    proc("--config", str(g), "--log-format", "json", data_dir=tmp_path / "disk2")
    assert p.terminate() == 0


def test_serve_logs_json_lines(proc: Callable[..., Proc]) -> None:
    p = proc("--log-format", "json")
    line = next(x for x in p.seen if "listening on" in x)
    doc = json.loads(line)
    assert doc["level"] == "info" and doc["logger"] == "kvpark" and doc["msg"].startswith("kvpark listening on")
    assert doc["ts"].endswith("Z") and time.strptime(doc["ts"][:19], "%Y-%m-%dT%H:%M:%S")
    assert p.terminate() == 0


def test_stat_shows_the_callers_tenant_row(daemon: Callable[..., Daemon], capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    sha = lambda t: hashlib.sha256(t.encode()).hexdigest()  # noqa: E731
    d = daemon(**{"tenants.alice.token_sha256": sha("ta"), "tenants.alice.quota": {"host": "4MiB"},
                  "tenants.bob.token_sha256": sha("tb")})
    with Client(d.address, token="ta") as c:
        c.park("s", [torch.ones(1024)])
    rc, _, err = run(capsys, "stat", "--address", d.address)
    assert rc == 1 and "Unauthenticated" in err
    monkeypatch.setenv("KVPARK_TOKEN", "ta")
    rc, out, _ = run(capsys, "stat", "--address", d.address)
    assert rc == 0 and "1 sequence(s)" in out
    assert "tenant alice: 1 sequence(s); device 0 B of unlimited, host 4.0 KiB of 4.0 MiB, disk 4.0 KiB of unlimited" \
        in out and "bob" not in out
    rc, out, _ = run(capsys, "stat", "--json", "--address", d.address)
    assert json.loads(out)["tenants"] == [{"name": "alice", "sequences": 1, "used": {"device": 0, "host": 4096,
                                           "disk": 4096}, "quota": {"host": 4 << 20}}]
    monkeypatch.setenv("KVPARK_TOKEN", "tb")
    rc, out, _ = run(capsys, "stat", "--address", d.address)
    assert rc == 0 and "0 sequence(s)" in out and "tenant bob: 0 sequence(s)" in out
    # bob is not trusted_local: his copy is in the private tier (charged to his host row),
    # which stat lists with the other tiers.
    with Client(d.address, token="tb") as c:
        c.park("p", [torch.ones(1024)])
    rc, out, _ = run(capsys, "stat", "--address", d.address)
    private = next(line for line in out.splitlines() if line.startswith("private "))
    assert rc == 0 and "4.0 MiB" in private and private.split()[-2] == "1", private
    assert "tenant bob: 1 sequence(s); device 0 B of unlimited, host 4.0 KiB of unlimited" in out
