"""Shared fixtures: real daemons (in-process on port 0, or as subprocesses), temp dirs.

Primitives:
- ``make_config(tmp_path, **overrides) -> Config``: small tiers in temp dirs, the device
  tier off (tests that need it turn it on).
- ``daemon`` fixture factory: ``start(disk_factory=DiskStore, **overrides) -> Daemon``
  (stopped at teardown); ``disk_factory`` injects a ``DiskStore`` subclass (faults, slow I/O).
- ``Proc``: a ``kvpark serve`` subprocess; ``Proc.start(tmp_path, *args)`` waits for the
  "listening on" line and parses the address.
- ``wait_until(pred, timeout)``: poll a condition with a deadline (no fixed sleeps).
- ``run_threads(targets) -> errors``: run callables concurrently, collect what they raised.
- ``redis_server`` / ``redis_cluster``: a real standalone Redis and a 3-master Redis
  Cluster on free loopback ports, one each per test session (tests keep apart by
  namespace); ``fresh_redis``: a standalone server of the test's own, to kill and
  restart. They skip, with the reason, only when redis-server is not installed.
- A backstop for hangs: a test still running ``HANG_S`` after it began (pytest-timeout's
  180 s failed to end it: a wait in C that a signal cannot interrupt, or a teardown that
  hangs after the timeout fired) prints every thread's stack and ends the run (exit
  status 1), instead of holding CI until its own limit with nothing said.
- With ``KVPARK_TESTS_SKIP_MISSING=1`` (the GPU check sets it), a test module that cannot
  be collected because a third-party package is not installed is reported as skipped,
  with the package's name, instead of aborting the whole run. Elsewhere (CI, `make test`)
  a missing package stays an error: every package the suite needs is installed there.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from kvpark.daemon.config import Config, load
from kvpark.daemon.engine import DiskFactory
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore
from .redis_servers import RedisCluster, RedisServer, have_redis
from .skip_missing import pytest_make_collect_report  # noqa: F401 (a hook: pytest finds it here)


# The vLLM connector's tests run in their own venv (`make test-vllm`); the core run leaves
# them out instead of listing each as "skipped: could not import vllm".
_HAVE_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if _HAVE_VLLM else ["vllm"]


def pytest_report_header(config: Any) -> str | None:
    return None if _HAVE_VLLM else "tests/vllm: left out here (no vllm); `make test-vllm` runs them in .venv-vllm"


HANG_S = int(os.environ.get("KVPARK_TESTS_HANG_S", "420"))
_real_stderr: list[int] = []


def pytest_configure(config: Any) -> None:
    # The terminal's stderr, kept before any test's capture replaces fd 2: the backstop's
    # stacks must reach the log of a run it ends.
    _real_stderr.append(os.dup(2))


_deadline: list[float] = []  # when the running test's backstop fires (time.monotonic)


def _arm() -> None:
    if _deadline:
        left = max(1.0, _deadline[0] - time.monotonic())
        faulthandler.dump_traceback_later(left, exit=True, file=_real_stderr[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    fd = _real_stderr[0]
    # The name first (a Python thread: it needs the GIL, which a hang in C may hold), then
    # the stacks and the exit from faulthandler's own thread, which needs nothing.
    name = threading.Timer(HANG_S - 5, os.write, args=(fd, f"\n{item.nodeid} still running after "
                                                          f"{HANG_S - 5} s; its stacks follow\n".encode()))
    name.daemon = True
    name.start()
    _deadline[:] = [time.monotonic() + HANG_S]
    _arm()
    try:
        yield
    finally:
        name.cancel()
        _deadline.clear()
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact() -> None:
    # pytest's own faulthandler plugin cancels any pending dump when a test phase fails (a
    # pytest-timeout expiry too): armed again, so a teardown that hangs after it ends too.
    _arm()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def make_config(tmp_path: Path, **overrides: Any) -> Config:
    (tmp_path / "shm").mkdir(exist_ok=True)  # the daemon never creates shm_dir itself
    base = {
        "server.listen": "127.0.0.1:0",
        "server.grace_s": 1.0,
        # Off unless a test turns it on: "auto" would give every daemon of the suite an
        # 8 GiB pool on a GPU machine.
        "tiers.device.enabled": "false",
        "tiers.host.capacity": "16MiB",
        "tiers.host.shm_dir": str(tmp_path / "shm"),
        "tiers.disk.path": str(tmp_path / "disk"),
        "tiers.disk.capacity": "256MiB",
        # Off: the default port is one per host, and suites run side by side. Metrics
        # tests turn it on at port 0.
        "metrics.listen": "",
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load(env={}, overrides=base)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(*, disk_factory: DiskFactory = DiskStore, **overrides: Any) -> Daemon:
        d = Daemon(make_config(tmp_path, **overrides), disk_factory=disk_factory).start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop(0.5)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    why = have_redis()
    if why:
        pytest.skip(why)
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    why = have_redis()
    if why:
        pytest.skip(why)
    cl = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cl.start()
        yield cl
    finally:
        cl.stop()


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[RedisServer]:
    why = have_redis()
    if why:
        pytest.skip(why)
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def run_threads(targets: list[Callable[[], None]], timeout: float = 300.0) -> list[BaseException]:
    """Run each target in its own thread; return what they raised (empty when all passed)."""
    errors: list[BaseException] = []

    def guard(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced to the test
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class Proc:
    """A real ``kvpark serve`` process."""

    def __init__(self, popen: subprocess.Popen, address: str, lines: "queue.Queue[str]", seen: list[str]) -> None:
        self.popen = popen
        self.address = address
        self.lines = lines
        self.seen = seen  # everything printed so far, start-up lines included

    @classmethod
    def start(cls, tmp_path: Path, *args: str, timeout: float = 60.0, data_dir: Path | None = None) -> "Proc":
        (tmp_path / "shm").mkdir(exist_ok=True)
        cmd = [
            sys.executable, "-m", "kvpark.daemon.cli", "serve",
            "--listen", "127.0.0.1:0",
            "--data-dir", str(data_dir or tmp_path / "disk"),
            "--set", "tiers.device.enabled=false",
            "--set", "tiers.host.capacity=16MiB",
            "--set", f"tiers.host.shm_dir={tmp_path / 'shm'}",
            "--set", "tiers.disk.capacity=256MiB",
            "--set", "server.grace_s=1",
            "--set", "metrics.listen=",
            *args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
        p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert p.stderr is not None
            for line in p.stderr:
                lines.put(line)
            lines.put("")

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            if line == "":
                break
            m = re.search(r'listening on ([^\s"]+)', line)  # a text line, or a JSON one
            if m:
                return cls(p, m.group(1), lines, seen)
        p.kill()
        raise RuntimeError("daemon did not start:\n" + "".join(seen))

    def terminate(self, timeout: float = 60.0) -> int:
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout)

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(30)

    def output(self) -> str:
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return "".join(self.seen)


@pytest.fixture
def proc(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []

    def start(*args: str, **kw: Any) -> Proc:
        p = Proc.start(tmp_path, *args, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.popen.poll() is None:
            p.kill()


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Pids the test SIGSTOPs; each gets its SIGCONT whatever happens."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
