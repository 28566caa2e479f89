"""Real Redis servers for the remote tier's tests: standalone and a 3-master cluster.

Each server is a ``redis-server`` child on a free loopback port, with no persistence,
in its own temp dir; the cluster is joined with ``redis-cli --cluster create``. Tests
that need one skip, with the reason, only when ``redis-server`` is not installed
(``.ci/run`` installs it).

Primitives:
- ``have_redis() -> str | None``: None when the binaries are there, else why not.
- ``RedisServer(dir, port=None, cluster=False)``: ``start()``, ``stop()`` (SIGKILL: an
  outage, not a shutdown), ``restart()`` on the same port and data, ``url``, ``cli(*args)``.
- ``RedisCluster(dir, masters=3)``: ``start()``, ``stop()``, ``nodes``, ``url`` (a seed).
- ``free_port(also_bus=False) -> int``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def have_redis() -> str | None:
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return f"{' and '.join(missing)} not installed (.ci/run installs them)" if missing else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(also_bus: bool = False) -> int:
    """A free loopback port; with ``also_bus``, port + 10000 (the cluster bus) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not also_bus or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free port pair found")


class RedisServer:
    def __init__(self, dir: Path, port: int | None = None, cluster: bool = False) -> None:
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.port = port or free_port(also_bus=cluster)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> "RedisServer":
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no",
                "--logfile", str(self.dir / "redis.log"), "--protected-mode", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                     "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: "
                                   f"{(self.dir / 'redis.log').read_text(errors='replace')[-2000:]}")
            try:
                if self.cli("ping").strip() == "PONG":
                    return self
            except subprocess.SubprocessError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        r = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, timeout=timeout)
        return r.stdout.decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> "RedisServer":
        self.stop()
        # The port may sit in TIME_WAIT for a moment; redis-server binds with SO_REUSEADDR.
        return self.start()


class RedisCluster:
    def __init__(self, dir: Path, masters: int = 3) -> None:
        self.nodes = [RedisServer(Path(dir) / f"node{i}", cluster=True) for i in range(masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 60.0) -> "RedisCluster":
        for n in self.nodes:
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        r = subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0",
                            "--cluster-yes"], capture_output=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout.decode()[-2000:]}"
                               f"{r.stderr.decode()[-2000:]}")
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
