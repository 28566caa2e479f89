"""/metrics: a real daemon serving on a free port, scraped over HTTP and parsed."""

from __future__ import annotations

import urllib.request
from typing import Callable

import lmdb
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvpark.client import Client, DataLoss, NotFound
from kvpark.daemon.config import ConfigError
from kvpark.daemon.metrics import NAMES
from kvpark.daemon.model import ParkSpec
from kvpark.daemon.server import Daemon
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
    assert moved("kvpark_park_bytes_total") == 3 * nbytes
    assert moved("kvpark_restore_bytes_total") == 3 * nbytes
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
        # Step 2: restoring a disk-only sequence promotes it back (disk -> host).
        assert torch.equal(c.restore("s0")[0], four[0])
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
