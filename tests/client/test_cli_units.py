"""The CLI's pure pieces, checked exactly: durations, the JSON view of a sequence, and
``stat --watch``'s rates and frame (the live view's numbers, without a terminal)."""

from __future__ import annotations

import io

import pytest

from kvpark.client import cli
from kvpark.proto.types import SeqInfo, Stat, TierStat

MiB = 1 << 20


@pytest.mark.parametrize("s, text", [
    (-5, "0s"), (0, "0s"), (59.4, "59s"), (119, "119s"), (120, "2m"), (3599, "60m"), (7199, "120m"),
    (7200, "2.0h"), (36000, "10.0h"), (172799, "48.0h"), (172800, "2.0d"), (864000, "10.0d")])
def test_durations_switch_units_at_their_bounds(s: float, text: str) -> None:
    assert cli._duration(s) == text


def test_the_json_view_of_a_sequence_never_shows_a_negative_or_padded_ttl() -> None:
    now = 1000.0
    past = SeqInfo(seq_id="a", nbytes=1, tier="host", num_tensors=1, created_at=990.0, expires_at=999.0)
    soon = SeqInfo(seq_id="b", nbytes=1, tier="host", num_tensors=1, created_at=1001.0, expires_at=1000.25)
    forever = SeqInfo(seq_id="c", nbytes=1, tier="host", num_tensors=1)
    assert cli._seq_json(past, now)["ttl_s"] == 0.0 and cli._seq_json(past, now)["age_s"] == 10.0
    assert cli._seq_json(soon, now)["ttl_s"] == 0.25
    assert cli._seq_json(soon, now)["age_s"] == 0.0  # a clock step never shows a negative age
    assert cli._seq_json(forever, now)["ttl_s"] is None and cli._seq_json(forever, now)["age_s"] is None


def tier(used: int, evictions: int = 0) -> TierStat:
    return TierStat(capacity_bytes=16 * MiB, used_bytes=used, blocks=0, sequences=1, evictions=evictions)


def test_watch_rates_are_signed_bytes_and_evictions_per_second() -> None:
    assert cli._watch_rates(tier(3 * MiB, 10), tier(MiB, 0), 2.0) == ("+1.0 MiB", "5.0")
    assert cli._watch_rates(tier(MiB, 10), tier(3 * MiB, 10), 4.0) == ("-512.0 KiB", "0.0")
    assert cli._watch_rates(tier(MiB), tier(MiB), 1.0) == ("+0 B", "0.0")
    assert cli._watch_rates(tier(MiB), None, 1.0) == ("-", "-")  # the first frame
    assert cli._watch_rates(tier(MiB), tier(0), 0.0) == ("-", "-")  # no time passed: no rate


def test_a_watch_frame_shows_each_tier_with_its_rates() -> None:
    pytest.importorskip("rich")
    from rich.console import Console

    before = Stat(tiers={"host": tier(MiB, 0), "disk": tier(0)}, leases=2)
    now = Stat(tiers={"host": tier(5 * MiB, 8), "disk": tier(2 * MiB)}, leases=2)
    seqs = [SeqInfo(seq_id="s", nbytes=1, tier="host", num_tensors=1),
            SeqInfo(seq_id="blk", nbytes=1, tier="host", num_tensors=1, shared=True)]
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(cli._watch_view("here:1", now, seqs, (5.0, before), 25.0))
    text = out.getvalue()
    assert "kvpark at here:1: 1 sequences, 1 shared blocks, 2 leases" in text
    rows = {c[0].strip(): c for c in map(cells, text.splitlines()) if c and c[0].strip() in ("host", "disk")}
    host = [c.strip() for c in rows["host"]]
    assert host[:2] == ["host", "ok"] and host[3:] == ["5.0 MiB / 16.0 MiB", "1", "8", "+204.8 KiB", "0.4"]
    assert [c.strip() for c in rows["disk"]][3:] == ["2.0 MiB / 16.0 MiB", "1", "0", "+102.4 KiB", "0.0"]
    # The bar: 24 cells wide, 5/16 of it drawn (7 full cells and a half).
    assert len(rows["host"][2]) == 24 + 2 and rows["host"][2].strip() == "━" * 7 + "╸"
    first = io.StringIO()
    Console(file=first, width=200, color_system=None).print(cli._watch_view("here:1", now, seqs, None, 14.0))
    rows = {c[0].strip(): c for c in map(cells, first.getvalue().splitlines()) if c and c[0].strip() in ("host", "disk")}
    assert [c.strip() for c in rows["host"]][-2:] == ["-", "-"]  # the first frame has no rates


def cells(line: str) -> list[str]:
    """A rendered table row's cells, padding kept."""
    return line.split("│")[1:-1]


def test_the_listing_fits_its_id_column_to_the_ids_up_to_48_characters(capsys: pytest.CaptureFixture[str]) -> None:
    """``stat --all``: the id column is as wide as the longest id, at least 6 and at most 48
    characters; a longer id is cut to 48, so every row's columns stay aligned."""
    def rows(*ids: str) -> list[str]:
        cli._print_all([SeqInfo(seq_id=i, nbytes=MiB, tier="host", num_tensors=1) for i in ids], 0.0)
        return capsys.readouterr().out.splitlines()

    head, row = rows("ab")
    assert head.startswith("seq_id  tier") and row.startswith("ab      host")  # at least 6
    head, row = rows("x" * 48)
    assert head.startswith("seq_id" + " " * 44 + "tier") and row.startswith("x" * 48 + "  host")
    head, *cut = rows("y" * 49, "z" * 80)
    assert head.startswith("seq_id" + " " * 44 + "tier")
    assert [r[:54] for r in cut] == ["y" * 48 + "  host", "z" * 48 + "  host"]


def test_the_summary_shows_each_tiers_use_as_a_percentage(capsys: pytest.CaptureFixture[str]) -> None:
    st = Stat(tiers={"host": tier(4 * MiB, 3), "disk": tier(0),
                     "device": TierStat(capacity_bytes=0, used_bytes=0, blocks=0, sequences=0, evictions=0)})
    cli._print_summary("here:1", st, [])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["host"][-3:] == ["25.0%", "1", "3"]  # 4 of 16 MiB; held 1; 3 evictions
    assert rows["disk"][-3] == "0.0%"
    assert rows["device"][-3] == "0.0%"  # no capacity: no division
