"""The CLI's control commands never import torch (an exec probe has about a second, and
importing torch takes most of it): each runs in a child process whose imports of torch
fail, against a real daemon, and must do its job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon

BLOCKED = """
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _NoTorch())
from kvpark.client.cli import main
rc = main(sys.argv[1:])
assert "torch" not in sys.modules, "torch was imported"
sys.exit(rc)
"""


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
    return subprocess.run([sys.executable, "-c", BLOCKED, *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_control_commands_run_without_torch(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    d = daemon()
    with Client(d.address) as c:
        c.park("x", [torch.ones(8)])
        c.park("y", [torch.ones(8)])
    a = ("--address", d.address)
    for args, expect in ((("health", *a), "SERVING"), (("stat", *a), "sequence"), (("stat", "--all", *a), "x"),
                         (("stat", "--json", *a), '"seq_id": "x"'), (("info", "x", *a), "float32[8]"),
                         (("pin", "x", *a), ""), (("unpin", "x", *a), ""), (("flush", *a), "written"),
                         (("drop", "y", *a), ""), (("config",), "[tiers.host]"),
                         (("config", "--set", "tiers.host.capacity=1GiB"), 'capacity = "1GiB"')):
        r = _cli(*args)
        assert r.returncode == 0, (args, r.stderr)
        assert expect in r.stdout, (args, r.stdout)
    with Client(d.address) as c:
        assert [s.seq_id for s in c.list()] == ["x"]


def test_compact_runs_without_torch(tmp_path: Path) -> None:
    data = tmp_path / "disk"
    with Daemon(_cfg(tmp_path)) as d, Client(d.address) as c:
        c.park("k", [torch.ones(8)])
    r = _cli("compact", "--data-dir", str(data))
    assert r.returncode == 0 and "MiB ->" in r.stdout, r.stderr


def _cfg(tmp_path: Path):  # a daemon whose disk tier is tmp_path/disk, written through
    from ..conftest import make_config

    return make_config(tmp_path, **{"policy.write": "write_through"})


@pytest.mark.parametrize("cmd", [["stat"], ["health"]])
def test_no_daemon_without_torch_is_still_one_line(cmd: list[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _cli(*cmd, "--address", f"127.0.0.1:{port}", "--timeout", "5")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
