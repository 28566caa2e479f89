"""``kvpark bench --quick``: the suite runs end to end and writes a real PNG and its JSON."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kvpark.client import bench

pytest.importorskip("matplotlib")
pytest.importorskip("rich")


def test_quick_bench_writes_json_and_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert bench.main(["--quick", "--reps", "1", "--out", str(out)]) == 0
    doc = json.loads((out / "bench.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    # Every kind of row is there, and every row measured both directions with the real payload.
    assert {"copy_ (1 thread)", "one TCP socket (loopback)", "one gRPC stream", "LMDB, a put per record",
            "kvpark shm", "kvpark inline", "kvpark disk"} <= set(rows)
    assert {r["kind"] for r in doc["rows"]} >= {"reference", "kvpark"}
    # p50 latency of a 4 KiB and a 1 MiB park and restore, per transport.
    lat = {(x["transport"], x["size"]): x for x in doc["latency"]}
    assert {("shm", "4 KiB"), ("shm", "1 MiB"), ("inline", "4 KiB"), ("inline", "1 MiB")} <= set(lat)
    assert all(x["park_p50_ms"] > 0 and x["restore_p50_ms"] > 0 for x in lat.values())
    for r in doc["rows"]:
        assert r["nbytes"] == 64 << 20 and r["write_best_gbps"] > 0 and r["read_best_gbps"] > 0, r["name"]
    assert doc["checks"] == [], "every row read back exactly the bytes it wrote"
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 400 and height > 200
    printed = capsys.readouterr().out
    assert "kvpark shm" in printed and "reference rows" in printed and "latency p50, kvpark shm, 4 KiB" in printed
