"""Attack: ``/metrics`` off loopback (issue F9). It was the one listener outside the
``server.insecure`` rule, and it named every tenant with its usage."""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from ..daemon.test_arena_safety import serve
from ..daemon.test_tenants import TOKENS, tenants

SCRAPE_TOKEN = "scrape-secret"


def _scrape(d: Daemon, token: str | None = None) -> tuple[int, str]:
    port = d.metrics_address.rpartition(":")[2]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_metrics_off_loopback_refuses_start_up_without_a_token_or_insecure(
        tmp_path: Path, daemon: Callable[..., Daemon]) -> None:
    (tmp_path / "shm").mkdir(exist_ok=True)
    r = serve(tmp_path, f"tiers.host.shm_dir={tmp_path / 'shm'}", "tiers.host.capacity=16MiB",
              "metrics.listen=0.0.0.0:0", timeout=30)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "cannot start" in ln]
    assert len(lines) == 1 and "metrics.listen" in lines[0] and "metrics.token_sha256" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    # The operator's explicit word serves it.
    d = daemon(**{"metrics.listen": "0.0.0.0:0", "server.insecure": True})
    assert _scrape(d)[0] == 200


def test_metrics_with_a_token_answer_only_scrapes_that_carry_it(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"metrics.listen": "0.0.0.0:0",
                  "metrics.token_sha256": hashlib.sha256(SCRAPE_TOKEN.encode()).hexdigest()})
    for bad in (None, "", "wrong", SCRAPE_TOKEN + "x", hashlib.sha256(SCRAPE_TOKEN.encode()).hexdigest()):
        status, body = _scrape(d, bad)
        assert status == 401 and "kvpark_" not in body, bad
    status, body = _scrape(d, SCRAPE_TOKEN)
    assert status == 200 and "kvpark_tier_used_bytes" in body


@pytest.mark.parametrize("labels", [False, True])
def test_tenant_names_appear_in_metrics_only_with_tenant_labels(daemon: Callable[..., Daemon], labels: bool) -> None:
    d = daemon(**tenants(), **{"metrics.listen": "127.0.0.1:0", "metrics.tenant_labels": labels})
    with Client(d.address, token=TOKENS["alice"]) as a:
        a.park("chat-1", [torch.ones(1024)])
    status, body = _scrape(d)
    assert status == 200 and "kvpark_sequences" in body
    named = [ln for ln in body.splitlines() if any(n in ln for n in TOKENS)]
    assert bool(named) == labels, named
    if labels:
        assert 'kvpark_tenant_used_bytes{tenant="alice",tier="disk"} 4096.0' in body
