"""Configurations that cannot work stop ``kvpark serve`` with one line and exit code 2,
never a traceback: a device tier forced on without CUDA, a data dir that cannot be
written. A busy port is reported before the arena is mapped; start-up logs say what
the daemon runs with."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpark.proto import VERSION

from kvpark.tiers import cuda

from ..conftest import wait_until
from .test_arena_safety import serve


def _refused(tmp_path: Path, *sets: str) -> str:
    (tmp_path / "shm").mkdir(exist_ok=True)
    r = serve(tmp_path, f"tiers.host.shm_dir={tmp_path / 'shm'}", "tiers.host.capacity=16MiB", *sets)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "cannot start" in ln]
    assert len(lines) == 1, r.stderr
    assert list((tmp_path / "shm").iterdir()) == [], "no arena left behind"
    return lines[0]


@pytest.mark.skipif(cuda.cuda_available(), reason="needs a host without CUDA")
def test_device_tier_forced_on_without_cuda(tmp_path: Path) -> None:
    line = _refused(tmp_path, "tiers.device.enabled=true", "tiers.device.device=cuda:0")
    assert "CUDA is not available" in line and "tiers.device.enabled" in line


def test_data_dir_that_cannot_be_a_directory(tmp_path: Path) -> None:
    # Root may write anywhere, so "not writable" is made real as a file where the
    # data directory should be (serve passes --data-dir tmp_path/disk).
    bad = tmp_path / "disk"
    bad.write_text("x")
    line = _refused(tmp_path)
    assert str(bad) in line and "tiers.disk.path" in line


def test_busy_port_is_reported_before_the_arena_is_mapped(tmp_path: Path) -> None:
    # 1. Hold a port; 2. a daemon asked to listen on it fails at once: no arena was
    #    reserved or mapped (nothing in shm_dir, no arena line in the log).
    (tmp_path / "shm").mkdir()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
        r = subprocess.run(
            [sys.executable, "-m", "kvpark.daemon.cli", "serve", "--listen", f"127.0.0.1:{port}",
             "--data-dir", str(tmp_path / "disk"), "--set", f"tiers.host.shm_dir={tmp_path / 'shm'}",
             "--set", "tiers.host.capacity=64MiB", "--set", "metrics.listen="],
            capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    # One line in words (after the start-up log line that names the version and config):
    # the key, the address, what to do; no gRPC C-core log line.
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith(f"kvpark: cannot start: server.listen = 127.0.0.1:{port}: cannot listen there"), \
        r.stderr
    assert [x for x in lines if "kvpark: cannot start" in x] == lines[-1:], r.stderr
    assert not any("add_port" in x or "Failed to add port" in x for x in lines), r.stderr
    assert "--listen HOST:PORT" in r.stderr and "GRPC_VERBOSITY" not in r.stderr
    assert "host arena" not in r.stderr and "Traceback" not in r.stderr
    assert list((tmp_path / "shm").iterdir()) == []


def test_start_up_logs_the_effective_config(proc) -> None:
    p = proc("--set", "policy.eviction=lfu")
    wait_until(lambda: "tiers ready" in p.output(), timeout=30)
    out = p.output()
    # The version, where the config came from, and each tier on or off with the reason.
    assert f"kvpark {VERSION} starting; config: embedded defaults" in out and "--set " in out, out
    assert "device tier: off (" in out, out
    assert "listening on" in out and "host arena" in out and "to map" in out
    assert "disk tier:" in out and "eviction=lfu" in out and "write=write_back" in out and "disk_full=evict" in out


def test_an_open_daemon_off_loopback_is_refused(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
    r = subprocess.run([sys.executable, "-m", "kvpark.daemon.cli", "serve", "--listen", "0.0.0.0:0",
                        "--data-dir", str(tmp_path / "disk"), "--set", f"tiers.host.shm_dir={tmp_path / 'shm'}",
                        "--set", "tiers.host.capacity=16MiB", "--set", "metrics.listen="],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "cannot start" in ln]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "0.0.0.0:0 is not loopback" in lines[0] and "server.insecure" in lines[0]
    assert list((tmp_path / "shm").iterdir()) == []
