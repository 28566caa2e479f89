"""``kvpark bench``'s own arithmetic and table, checked exactly on made-up rows (the run
itself is ``test_bench.py``): GB/s from the best and the median time, a row with no
times shown as "-", and the payload an option asks for."""

from __future__ import annotations

import io

import pytest

from kvpark.client.bench import Options, Result, Row, table, to_json


def rows() -> list[Row]:
    return [Row("copy", "reference", "copy_", "copy_", write_s=[0.5, 0.25, 1.0], read_s=[2.0], nbytes=10**9),
            Row("redis", "peer", "SET", "GET", nbytes=10**9)]


def test_gbps_is_bytes_over_the_best_or_the_median_time() -> None:
    r = rows()[0]
    assert r.gbps(r.write_s) == 4.0 and r.gbps(r.write_s, best=False) == 2.0
    assert r.gbps(r.read_s) == 0.5 and rows()[1].gbps([]) is None


def test_the_json_and_the_table_show_each_row_and_a_dash_for_no_times() -> None:
    pytest.importorskip("rich")
    from rich.console import Console

    res = Result(rows=rows(), meta={"payload": "4 x 1 MiB", "reps": 3}, skipped=[], checks=[])
    doc = to_json(res)
    assert [(d["write_best_gbps"], d["write_median_gbps"], d["read_best_gbps"]) for d in doc["rows"]] == [
        (4.0, 2.0, 0.5), (None, None, None)]
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(table(res))
    lines = {c[0].strip(): [x.strip() for x in c] for c in
             (x.split("│")[1:-1] for x in out.getvalue().splitlines()) if c}
    assert lines["copy"] == ["copy", "reference", "copy_", "4.00 (2.00)", "copy_", "0.50 (0.50)"]
    assert lines["redis"] == ["redis", "peer", "SET", "-", "GET", "-"]


def test_quick_runs_a_quarter_of_the_payload() -> None:
    assert Options(quick=True).n == 64 and Options().n == 256
