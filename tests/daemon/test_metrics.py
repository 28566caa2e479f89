"""/metrics: a real daemon serving on a free port, scraped over HTTP and parsed."""

from __future__ import annotations

import urllib.request
from typing import Callable

import lmdb
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvpark.client import Client, DataLoss, InvalidArgument, NotFound
from kvpark.daemon.config import ConfigError
from kvpark.daemon.metrics import NAMES
from kvpark.daemon.model import ParkSpec
from kvpark.daemon.server import Daemon
from kvpark.proto import VERSION
from kvpark.proto.errors import StartupError
from kvpark.proto.layout import TensorMeta
from kvpark.tiers.disk import HEADER

from ..conftest import make_config, wait_until

MiB = 1 << 20


def scrape(d: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the daemon's /metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_park_restore_and_errors_move_the_counters_and_gauges(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"metrics.listen": "127.0.0.1:0"})
    assert d.metrics_address.startswith("127.0.0.1:") and not d.metrics_address.endswith(":0")
    before = scrape(d)
    # Step 1: the tier gauges exist before anything is parked, at the configured capacity.
    assert before[("kvpark_tier_capacity_bytes", (("tier", "host"),))] == d.config.host_capacity
    assert before[("kvpark_tier_used_bytes", (("tier", "host"),))] == 0
    assert before[("kvpark_tier_sequences", (("tier", "disk"),))] == 0
    big = torch.ones(MiB)  # 4 MiB: the shm path reserves and commits, no small-park shortcut
    # Step 2: two parks and a restore over shm, one park and two restores streamed inline.
    with Client(d.address, transport="shm") as c:
        c.park("a", [big])
        c.park("b", [big])
        assert torch.equal(c.restore("a")[0], big)
        with pytest.raises(NotFound):
            c.restore("missing")
    with Client(d.address, transport="inline") as c:
        c.park("c", [big])
        assert torch.equal(c.restore("c")[0], big)
        assert torch.equal(c.restore("b")[0], big)
    after = scrape(d)
    nbytes = big.numel() * big.element_size()

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("kvpark_parks_total", transport="shm") == 2
    assert moved("kvpark_parks_total", transport="inline") == 1
    assert moved("kvpark_restores_total", transport="shm") == 1
    assert moved("kvpark_restores_total", transport="inline") == 2
    assert moved("kvpark_park_bytes_total", transport="shm") == 2 * nbytes
    assert moved("kvpark_park_bytes_total", transport="inline") == nbytes
    assert moved("kvpark_restore_bytes_total", transport="shm") == nbytes
    assert moved("kvpark_restore_bytes_total", transport="inline") == 2 * nbytes
    assert moved("kvpark_park_seconds_count", transport="shm") == 2
    assert moved("kvpark_restore_seconds_count", transport="inline") == 2
    assert moved("kvpark_errors_total", code="NOT_FOUND") == 1
    # Step 3: the gauges are the engine's stat at scrape time.
    st = d.engine.stat()
    assert after[("kvpark_tier_used_bytes", (("tier", "host"),))] == st.tiers["host"].used_bytes >= 3 * nbytes
    assert after[("kvpark_tier_sequences", (("tier", "host"),))] == 3
    assert after[("kvpark_sequences", ())] == 3
    exported = {name for name, _ in after}
    for name in ("kvpark_tier_capacity_bytes", "kvpark_parks_total", "kvpark_restore_seconds_bucket"):
        assert name in exported
    assert all(n.startswith("kvpark_") for n in NAMES)


def test_every_series_exists_from_the_start_with_build_and_process_metrics_and_no_created(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"metrics.listen": "127.0.0.1:0"})
    first = scrape(d)
    names = {name for name, _ in first}
    # Before any event, each labelled counter has a zero series for each value it takes:
    # rate() over a series born at its first event misses that event.
    for t in ("inline", "shm", "cuda_ipc"):
        for name in ("kvpark_parks_total", "kvpark_restores_total", "kvpark_park_bytes_total",
                     "kvpark_restore_bytes_total"):
            assert first[(name, (("transport", t),))] == 0
    assert first[("kvpark_errors_total", (("code", "NOT_FOUND"),))] == 0
    assert first[("kvpark_lookup_blocks_total", (("result", "hit"),))] == 0
    assert first[("kvpark_lookup_tokens_total", (("result", "miss"),))] == 0
    assert first[("kvpark_evictions_total", (("tier", "host"),))] == 0
    assert first[("kvpark_moves_total", (("dst", "disk"), ("src", "host")))] == 0
    assert first[("kvpark_build_info", (("version", VERSION),))] == 1
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"} <= names
    assert not [n for n in names if n.endswith("_created")]


def test_prefix_lookups_count_hits_and_misses(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"metrics.listen": "127.0.0.1:0"})
    with Client(d.address) as c:
        for i in range(3):
            c.park(f"b{i}", [torch.full((64,), i, dtype=torch.uint8)])
        # b0 b1 b2 hit, then b3 misses, and b4 after it counts as a miss too (not in the prefix).
        assert c.lookup(["b0", "b1", "b2", "b3", "b4"]) == 3
        assert c.lookup(["x", "b0"]) == 0
        after = scrape(d)
        # Blocks only: these callers did not say how many tokens a block holds.
        assert after[("kvpark_lookup_tokens_total", (("result", "hit"),))] == 0
        assert after[("kvpark_lookup_tokens_total", (("result", "miss"),))] == 0
        # 16 tokens a block: 2 hit blocks and 1 miss, then (lookup_acquire) 1 hit and 2 misses.
        assert c.lookup(["b0", "b1", "y"], tokens_per_block=16) == 2
        assert c.lookup_acquire(["b2", "z", "b0"], tokens_per_block=16)[0] == 1
        with pytest.raises(InvalidArgument):
            c.lookup(["b0"], tokens_per_block=-1)
    after = scrape(d)
    assert after[("kvpark_lookup_blocks_total", (("result", "hit"),))] == 3 + 3
    assert after[("kvpark_lookup_blocks_total", (("result", "miss"),))] == 4 + 3
    assert after[("kvpark_lookup_tokens_total", (("result", "hit"),))] == 3 * 16
    assert after[("kvpark_lookup_tokens_total", (("result", "miss"),))] == 3 * 16


def test_the_paged_adapters_lookups_count_tokens(daemon: Callable[..., Daemon]) -> None:
    from kvpark.client import paged

    d = daemon(**{"metrics.listen": "127.0.0.1:0"})
    bs = 16
    kv = [torch.randn(2, 8, bs, 2, 32).to(torch.float16) for _ in range(2)]
    tokens = list(range(4 * bs))
    with Client(d.address) as c:
        paged.park_blocks(c, "s", kv, [0, 1], num_tokens=2 * bs, tokens=tokens[: 2 * bs])
        assert paged.lookup(c, kv, tokens) == 2 * bs  # 2 of its 4 blocks hit
    after = scrape(d)
    hit = after[("kvpark_lookup_tokens_total", (("result", "hit"),))]
    miss = after[("kvpark_lookup_tokens_total", (("result", "miss"),))]
    assert (hit, miss) == (2 * bs, 2 * bs)


def test_the_remote_tier_has_its_series(daemon: Callable[..., Daemon], redis_server) -> None:
    d = daemon(**{"metrics.listen": "127.0.0.1:0", "tiers.remote.url": redis_server.url,
                  "tiers.remote.namespace": "metrics-remote", "tiers.remote.write": "write_through"})
    with Client(d.address, transport="inline") as c:
        c.park("r", [torch.ones(1024)])
        assert wait_until(lambda: c.stat().remote.pending_writes == 0)  # type: ignore[union-attr]
    after = scrape(d)
    assert after[("kvpark_remote_state", (("state", "closed"),))] == 1
    assert after[("kvpark_remote_state", (("state", "open"),))] == 0
    assert after[("kvpark_remote_written_bytes_total", ())] >= 4096
    assert after[("kvpark_remote_pending_writes", ())] == 0
    for name in ("kvpark_remote_errors_total", "kvpark_remote_refused_total", "kvpark_remote_outages_total",
                 "kvpark_remote_data_loss_total", "kvpark_remote_read_bytes_total"):
        assert after[(name, ())] == 0


def test_a_busy_metrics_port_refuses_the_start_and_names_the_key(daemon: Callable[..., Daemon], tmp_path) -> None:
    first = daemon(**{"metrics.listen": "127.0.0.1:0"})
    other = tmp_path / "other"
    other.mkdir()
    cfg = make_config(other, **{"metrics.listen": first.metrics_address})
    with pytest.raises(StartupError, match="metrics.listen"):
        Daemon(cfg).start()
    # Nothing left behind: the data dir opens again, and the first daemon still serves.
    with Daemon(make_config(other)) as d2:
        assert d2.metrics_address == ""
    assert scrape(first)[("kvpark_sequences", ())] == 0


def test_empty_listen_serves_nothing_and_a_bad_address_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="metrics.listen"):
        make_config(tmp_path, **{"metrics.listen": "9851"})
    with Daemon(make_config(tmp_path, **{"metrics.listen": ""})) as d:
        assert d.metrics_address == ""


def test_moves_evictions_lease_expiries_and_checksum_failures(daemon: Callable[..., Daemon], tmp_path) -> None:
    d = daemon(**{"metrics.listen": "127.0.0.1:0", "leases.ttl_s": 0.5})
    four = [torch.full((MiB,), 7.0)]  # 4 MiB; the host tier holds 16 MiB
    # Step 1: parking 6 x 4 MiB into a 16 MiB host tier demotes the oldest to disk.
    with Client(d.address, transport="shm") as c:
        for i in range(6):
            c.park(f"s{i}", four)
        assert wait_until(lambda: c.info("s0").tier == "disk", timeout=30)
        # Step 2: restoring a disk-only sequence promotes it back (disk -> host): after a
        # disk grant in the background, once the reads pause (``idle_work.py``).
        assert torch.equal(c.restore("s0")[0], four[0])
    key = ("kvpark_moves_total", (("dst", "host"), ("src", "disk")))
    assert wait_until(lambda: scrape(d).get(key, 0) >= 1, timeout=30)
    m = scrape(d)
    evicted = m.get(("kvpark_evictions_total", (("tier", "host"),)), 0)
    written = m.get(("kvpark_moves_total", (("dst", "disk"), ("src", "host"))), 0)
    assert evicted >= 1 and written >= evicted, "every eviction from host wrote its sequence to disk first"
    assert m[("kvpark_moves_total", (("dst", "host"), ("src", "disk")))] >= 1
    assert m[("kvpark_move_seconds_count", (("dst", "host"), ("src", "disk")))] >= 1
    # Step 3: a reservation nobody commits expires and is counted.
    spec = ParkSpec("never", (TensorMeta("uint8", (4096,), 4096),), 4096)
    d.engine.reserve(spec, tier="host")
    assert wait_until(lambda: scrape(d).get(("kvpark_lease_expiries_total", ()), 0) == 1, timeout=30)


def test_a_corrupt_disk_record_counts_one_checksum_failure(daemon: Callable[..., Daemon], tmp_path) -> None:
    d = daemon(**{"policy.write": "write_through"})
    with Client(d.address) as c:
        c.park("x", [torch.full((4096,), 3.0)])
    d.stop()
    # Flip one payload byte of the record on disk, with the daemon stopped.
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        key, raw = next(iter(txn.cursor(db=db)))
        raw = bytearray(raw)
        raw[HEADER.size + 10] ^= 0x01
        txn.put(key, bytes(raw), db=db)
    env.close()
    d2 = daemon(**{"metrics.listen": "127.0.0.1:0"})
    with Client(d2.address) as c, pytest.raises(DataLoss):
        c.restore("x")
    m = scrape(d2)
    assert m[("kvpark_checksum_failures_total", ())] == 1
    assert m[("kvpark_errors_total", (("code", "DATA_LOSS"),))] == 1
