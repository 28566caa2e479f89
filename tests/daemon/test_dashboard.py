"""deploy/grafana/kvpark.json names only metrics a real daemon exports (with a remote
tier, so its series are there too), and parses as a dashboard with a query per panel."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from .test_metrics import scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvpark.json"
# PromQL words that look like metric names but are not.
_NOT_METRICS = {"sum", "rate", "increase", "by", "without", "ignoring", "histogram_quantile", "le", "label_values",
                "job", "instance", "tier", "transport", "result", "src", "dst", "code", "state", "version"}


def _exprs(doc: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    out += [v["query"] for v in doc["templating"]["list"] if v.get("type") == "query"]
    return out


def test_every_dashboard_expression_names_a_metric_the_daemon_exports(
        daemon: Callable[..., Daemon], redis_server: Any) -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["panels"] and all(p["targets"] for p in doc["panels"])
    d = daemon(**{"metrics.listen": "127.0.0.1:0", "tiers.remote.url": redis_server.url,
                  "tiers.remote.namespace": "dashboard"})
    with Client(d.address) as c:  # one of each event, so histograms have buckets to name
        c.park("a", [torch.ones(16)])
        c.restore("a")
        c.lookup(["a", "b"])
    exported = {name for name, _ in scrape(d)}
    used = set()
    for e in _exprs(doc):
        # Strip label matchers and template variables; what is left that looks like a
        # metric name must be one.
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\$\w+", " ", e)
        used |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare) if w not in _NOT_METRICS
                 and not re.fullmatch(r"\d.*|e\d+", w)}
    assert used, "no metric found in the dashboard"
    assert used <= exported, f"the dashboard names metrics the daemon does not export: {sorted(used - exported)}"
    for needed in ("kvpark_lookup_blocks_total", "kvpark_remote_state", "kvpark_park_bytes_total",
                   "kvpark_evictions_total", "kvpark_errors_total", "kvpark_tier_used_bytes"):
        assert needed in used
