"""The bench's peers and statistics (``kvpark.client.benchkit``): the reference rows every
kvpark figure is a ratio of. A peer that moves the wrong bytes, or a percentile or unit
that is off, makes every published ratio wrong, so they are checked exactly here."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpark.client import benchkit
from kvpark.client.benchkit import (CHUNK, BareClient, BareServicer, BareSocket, latencies, pct, same,
                                    start_bare_server, timed)


def odd_views(seed: int) -> list[memoryview]:
    """Buffers whose sizes line up with nothing: a chunk and a half, a byte, a few KiB."""
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for n in (CHUNK + CHUNK // 2 + 3, 1, 4099)]


def test_the_bare_grpc_peer_moves_exactly_the_bytes_both_ways() -> None:
    src = odd_views(1)
    total = sum(len(v) for v in src)
    svc = BareServicer(total + 10)
    server, address = start_bare_server(svc)
    client = BareClient(address)
    try:
        assert client.upload(src) == total and svc.received == total
        assert bytes(svc.sink[:total]) == b"".join(bytes(v) for v in src)
        assert not svc.sink[total:].any()
        svc.sources["k"] = src
        dsts = [memoryview(bytearray(len(v))) for v in src]
        assert client.download("k", dsts) == total
        assert [bytes(d) for d in dsts] == [bytes(v) for v in src]
        assert client.echo(b"ping") == b"ping"
    finally:
        client.close()
        server.stop(0)


def test_the_bare_socket_peer_moves_exactly_the_bytes_both_ways() -> None:
    src = odd_views(2)
    total = sum(len(v) for v in src)
    sock = BareSocket(total)
    try:
        sock.upload(src)
        assert bytes(sock.sink) == b"".join(bytes(v) for v in src)
        sock.sources = src
        dsts = [memoryview(bytearray(len(v))) for v in src]
        sock.download(dsts)
        assert [bytes(d) for d in dsts] == [bytes(v) for v in src]
    finally:
        sock.close()


@pytest.mark.parametrize("xs, p, want", [
    ([4.0, 1.0, 3.0, 2.0], 50, 2.5), ([10.0, 20.0], 25, 12.5), ([10.0, 20.0], 100, 20.0),
    ([10.0, 20.0], 0, 10.0), ([7.0], 99, 7.0), ([1.0, 2.0, 3.0, 4.0, 5.0], 90, 4.6)])
def test_percentiles_interpolate_between_order_statistics(xs: list[float], p: float, want: float) -> None:
    assert pct(xs, p) == pytest.approx(want)


def test_latencies_are_microseconds_of_each_call_after_the_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = itertools.count(0, 2500)  # a clock that moves 2.5 us per reading
    monkeypatch.setattr(benchkit.time, "perf_counter_ns", lambda: next(ticks))
    calls: list[int] = []
    out = latencies(lambda: calls.append(1), iters=3, warmup=2)
    assert out == [2.5, 2.5, 2.5] and len(calls) == 5


def test_timed_reports_only_the_reps_after_the_warmup() -> None:
    seen: list[str] = []
    times = timed(lambda: seen.append("fn"), reps=2, warmup=1, before=lambda: seen.append("before"),
                  after=lambda: seen.append("after"))
    assert len(times) == 2 and all(t >= 0 for t in times)
    assert seen == ["before", "fn", "after"] * 3


def test_same_means_equal_tensors_pairwise() -> None:
    a = [torch.arange(4), torch.ones(3)]
    assert same(a, [t.clone() for t in a])
    assert not same(a, a[:1])
    assert not same(a, [torch.arange(4), torch.zeros(3)])


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_the_redis_peer_starts_when_redis_server_is_on_the_path() -> None:
    """The bench's Redis rows run wherever redis-server is installed: found on PATH, it is
    started on a free loopback port, answers, and is stopped by ``close``."""
    r = benchkit.RedisServer()
    try:
        assert r.ok and r.skip_reason == "" and r.version
        r.client.set("k", b"\x00\x01" * 1000)
        assert r.client.get("k") == b"\x00\x01" * 1000
        proc = r.proc
    finally:
        r.close()
    assert r.proc is None and proc is not None and proc.poll() is not None


def test_the_redis_peer_says_why_its_rows_are_skipped_without_redis_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    r = benchkit.RedisServer()
    assert not r.ok and r.proc is None
    assert "redis-server not found on PATH" in r.skip_reason
    r.close()  # nothing to stop
