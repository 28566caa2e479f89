"""A unix socket path is claimed for the daemon's life, never taken: a second daemon
started on a running one's path (gRPC's or the data channel's), at once or later, is
refused and the first keeps serving; so is a path another program listens on; the
socket of a daemon that died is replaced; a file that is not a socket is never removed;
a missing directory, a path too long or an address gRPC reads as another file is refused
in words; a failed start lets go of every address it bound."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.daemon.sockets import MAX_UNIX_PATH
from kvpark.proto.errors import StartupError

from ..conftest import make_config


def _second(tmp_path: Path, **overrides: str) -> Daemon:
    (tmp_path / "b").mkdir(exist_ok=True)
    return Daemon(make_config(tmp_path / "b", **overrides))


def test_a_second_daemon_on_a_live_socket_is_refused_and_the_first_keeps_it(
        daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    first = daemon(**{"server.listen": f"unix://{sock}"})
    before = (os.stat(sock).st_ino, os.stat(f"{sock}.data").st_ino)
    with Client(first.address) as c:
        c.park("s", [torch.arange(64, dtype=torch.float32)])
    with pytest.raises(StartupError, match="another kvpark daemon holds"):
        _second(tmp_path, **{"server.listen": f"unix://{sock}"}).start()
    # The same files, still the first daemon's: its clients reach it and what it holds.
    assert (os.stat(sock).st_ino, os.stat(f"{sock}.data").st_ino) == before
    with Client(first.address) as c:
        (got,) = c.restore("s")
        assert torch.equal(got, torch.arange(64, dtype=torch.float32))


def test_a_data_channel_on_a_live_daemons_socket_is_refused(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    first = daemon(**{"server.listen": f"unix://{sock}"})
    before = os.stat(f"{sock}.data").st_ino
    second = _second(tmp_path, **{"server.listen": f"unix://{tmp_path / 'other.sock'}",
                                  "server.data_channel_listen": f"unix:{sock}.data"})
    with pytest.raises(StartupError, match="server.data_channel_listen = .*another kvpark daemon holds"):
        second.start()
    assert not (tmp_path / "other.sock").exists(), "refused before gRPC bound anything"
    assert os.stat(f"{sock}.data").st_ino == before
    with Client(first.address) as c:
        c.park("s", [torch.ones(1024)])
        (got,) = c.restore("s")
        assert torch.equal(got, torch.ones(1024))


def test_the_sockets_of_a_daemon_that_died_are_replaced(daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    for path in (str(sock), f"{sock}.data"):
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(path)  # a socket file nobody listens on, as a killed daemon leaves
        dead.close()
    d = daemon(**{"server.listen": f"unix://{sock}"})
    with Client(d.address) as c:
        c.park("s", [torch.ones(8)])
        (got,) = c.restore("s")
        assert torch.equal(got, torch.ones(8))


@pytest.mark.parametrize("which", ["grpc", "data"])
def test_a_file_that_is_not_a_socket_is_refused_and_kept(tmp_path: Path, which: str) -> None:
    sock = tmp_path / "kv.sock"
    victim = sock if which == "grpc" else Path(f"{sock}.data")
    victim.write_text("an operator's file")
    with pytest.raises((StartupError, OSError), match="exists and is not a socket"):
        with Daemon(make_config(tmp_path, **{"server.listen": f"unix://{sock}"})):
            pass
    assert victim.read_text() == "an operator's file"


def test_a_missing_directory_or_a_path_too_long_is_refused_in_words(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match=r"directory .*nodir does not exist"):
        Daemon(make_config(tmp_path, **{"server.listen": f"unix://{tmp_path / 'nodir' / 'kv.sock'}"})).start()
    long = tmp_path / ("x" * (MAX_UNIX_PATH + 1 - len(str(tmp_path)) - 1))
    assert len(str(long)) == MAX_UNIX_PATH + 1
    with pytest.raises(StartupError, match=f"a unix socket path holds at most {MAX_UNIX_PATH}"):
        Daemon(make_config(tmp_path, **{"server.listen": f"unix://{long}"})).start()
    assert not long.exists()


def test_a_path_another_program_listens_on_is_refused(tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    with socket.socket(socket.AF_UNIX) as other:  # not a kvpark daemon: it holds no lock
        other.bind(str(sock))
        other.listen()
        before = os.stat(sock).st_ino
        with pytest.raises(StartupError, match="a process is listening on"):
            Daemon(make_config(tmp_path, **{"server.listen": f"unix://{sock}"})).start()
        assert os.stat(sock).st_ino == before


@pytest.mark.parametrize("listen, why", [
    ("unix://kv.sock", "names a host"),  # gRPC would bind /kv.sock, not ./kv.sock
    ("unix:{d}/a%20b.sock", "'%'"),  # gRPC would bind "a b.sock"
    ("unix:{d}/q?x.sock", "'\\?'"),  # its clients would dial .../q
    ("unix:{d}/h#x.sock", "'#'"),
    ("unix:{d}/c,x.sock", "','"),  # two addresses to a gRPC client
    ("unix:", "no path"),
    ("unix:////{d}/kv.sock", "starts with //"),
])
def test_an_address_grpc_reads_as_another_file_is_refused(tmp_path: Path, listen: str, why: str) -> None:
    from kvpark.daemon.config import ConfigError

    for key in ("server.listen", "server.data_channel_listen"):
        with pytest.raises(ConfigError, match=f"{key}: .*{why}"):
            make_config(tmp_path, **{key: listen.format(d=str(tmp_path).lstrip("/"))})


def test_the_data_channel_may_not_share_grpcs_path_or_its_lock(tmp_path: Path) -> None:
    from kvpark.daemon.config import ConfigError

    with pytest.raises(ConfigError, match="server.data_channel_listen: the same unix path"):
        make_config(tmp_path, **{"server.listen": f"unix://{tmp_path}/kv.sock",
                                 "server.data_channel_listen": f"unix:{tmp_path}/kv.sock"})
    for grpc_path, dc_path in (("x.lock", "x"), ("y", "y.lock")):
        with pytest.raises(ConfigError, match="the other's lock file"):
            make_config(tmp_path, **{"server.listen": f"unix:{tmp_path}/{grpc_path}",
                                     "server.data_channel_listen": f"unix:{tmp_path}/{dc_path}"})


@pytest.mark.parametrize("kind", ["dangling link", "link to a file", "directory", "fifo"])
def test_a_lock_file_that_is_not_a_plain_file_is_refused_and_named(tmp_path: Path, kind: str) -> None:
    # Never followed through a link: a root daemon would create (or lock) the target,
    # wherever it points.
    sock, lock, target = tmp_path / "kv.sock", tmp_path / "kv.sock.lock", tmp_path / "elsewhere"
    if kind == "dangling link":
        lock.symlink_to(target)
    elif kind == "link to a file":
        target.write_text("not ours")
        lock.symlink_to(target)
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(StartupError, match=f"lock file {lock}"):
        Daemon(make_config(tmp_path, **{"server.listen": f"unix://{sock}"})).start()
    assert not sock.exists()
    if kind == "dangling link":
        assert not target.exists(), "the link's target was created"
    if kind == "link to a file":
        assert target.read_text() == "not ours"


@pytest.mark.parametrize("unix", [True, False])
def test_a_failed_start_lets_go_of_its_addresses(tmp_path: Path, unix: bool) -> None:
    # The start fails after gRPC bound its address (a busy metrics port); a retry in the
    # same process, the port freed, must find the address free, not held by the first try.
    sock = tmp_path / "kv.sock"
    if unix:
        listen = f"unix://{sock}"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            listen = f"127.0.0.1:{s.getsockname()[1]}"
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    metrics = f"127.0.0.1:{held.getsockname()[1]}"
    with pytest.raises((StartupError, OSError)):
        Daemon(make_config(tmp_path, **{"server.listen": listen, "metrics.listen": metrics})).start()
    if unix:
        with socket.socket(socket.AF_UNIX) as probe:  # nothing answers there now
            with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
                probe.connect(str(sock))
    held.close()
    with Daemon(make_config(tmp_path, **{"server.listen": listen})) as d, Client(d.address) as c:
        c.park("s", [torch.ones(4)])
        (got,) = c.restore("s")
        assert torch.equal(got, torch.ones(4))


def test_two_daemons_started_at_once_on_one_path_one_wins(tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    for round_ in range(4):
        barrier = threading.Barrier(2)
        outcome: dict[int, object] = {}

        def start(i: int) -> None:
            d = Daemon(make_config(tmp_path / f"r{round_}-{i}", **{"server.listen": f"unix://{sock}"}))
            barrier.wait()
            try:
                outcome[i] = d.start()
            except StartupError as e:
                outcome[i] = e

        for i in (0, 1):
            (tmp_path / f"r{round_}-{i}").mkdir()
        threads = [threading.Thread(target=start, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        up = [d for d in outcome.values() if isinstance(d, Daemon)]
        assert len(up) == 1, outcome
        try:
            with Client(up[0].address) as c:  # the winner owns the path its clients reach
                c.park("s", [torch.ones(4)])
                (got,) = c.restore("s")
                assert torch.equal(got, torch.ones(4))
        finally:
            up[0].stop()


def test_a_stopped_daemons_path_is_free_for_the_next(tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    with Daemon(make_config(tmp_path, **{"server.listen": f"unix://{sock}"})):
        pass
    with Daemon(make_config(tmp_path, **{"server.listen": f"unix://{sock}"})) as d, Client(d.address) as c:
        c.park("s", [torch.ones(4)])
