"""Prometheus metrics: one registry per daemon, and the ``/metrics`` HTTP endpoint.

Primitives:
- ``Metrics(stat_fn=None)``: a private ``CollectorRegistry`` (never the process-global one,
  so several daemons in one test process keep separate counts) holding the counters and
  histograms below; the per-tier gauges are read from ``stat_fn()`` at scrape time, so the
  engine needs no hook to keep them current.
- Recording functions the servicer and the engine call: ``parked``, ``restored``, ``moved``,
  ``evicted``, ``checksum_failure``, ``lease_expired``, ``error``, ``looked_up``.
- The remote tier's state, failures, pending writes and bytes moved, read from
  ``stat_fn()`` like the tier gauges; ``process_*`` (the process collector) and
  ``kvpark_build_info{version}``. Counters have no ``*_created`` series, and each
  labelled counter has its series from the start for every label value it can take
  (a rate over a series that appears at its first event misses that event).
- ``Metrics.render() -> bytes``: the text exposition format (what a scrape returns).
- ``MetricsServer(metrics, listen, token_sha256="")``: ``start()`` serves ``/metrics`` on
  ``listen`` ("host:port", port 0 picks one; "" serves nothing); ``address`` is then the
  bound address; ``stop()``. A busy port is a ``StartupError`` naming the key to change.
  With ``token_sha256`` (``metrics.token_sha256``) a scrape must carry
  ``Authorization: Bearer <token>`` whose sha256 matches (compared in constant time),
  else 401 and no metrics. Where it may listen is ``auth.check_exposure``'s rule.
- ``NAMES``: every metric name this module exports (docs/operations.md lists them).

Nothing here sends data anywhere: the endpoint only answers scrapes on the address it
is given, which is loopback by default. The per-tenant series exist only when the
daemon watches a ``Stat`` with tenants in it (``metrics.tenant_labels``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
from typing import Any, Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (CollectorRegistry, Counter, Histogram, Info, ProcessCollector,
                               disable_created_metrics, generate_latest, make_wsgi_app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvpark.proto import VERSION
from kvpark.proto.errors import StartupError
from kvpark.proto.types import Stat

log = logging.getLogger("kvpark.metrics")

# Transfers of KV blocks take from about 100 us (a small shm park) to tens of seconds (GBs
# streamed or read back from disk); the default buckets stop at 10 s and start at 5 ms.
_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

NAMES = (
    "kvpark_tier_capacity_bytes", "kvpark_tier_used_bytes", "kvpark_tier_sequences", "kvpark_tier_blocks",
    "kvpark_sequences", "kvpark_leases", "kvpark_tenant_used_bytes", "kvpark_tenant_quota_bytes",
    "kvpark_parks_total", "kvpark_restores_total", "kvpark_park_bytes_total", "kvpark_restore_bytes_total",
    "kvpark_moves_total", "kvpark_evictions_total", "kvpark_checksum_failures_total",
    "kvpark_lease_expiries_total", "kvpark_errors_total", "kvpark_lookup_blocks_total", "kvpark_lookup_tokens_total",
    "kvpark_park_seconds", "kvpark_restore_seconds", "kvpark_move_seconds",
    "kvpark_remote_state", "kvpark_remote_pending_writes", "kvpark_remote_errors_total",
    "kvpark_remote_refused_total", "kvpark_remote_outages_total", "kvpark_remote_data_loss_total",
    "kvpark_remote_written_bytes_total", "kvpark_remote_read_bytes_total", "kvpark_build_info",
)

# Every value each labelled counter can take, so each series exists from the start.
TRANSPORTS = ("inline", "shm", "cuda_ipc")
ERROR_CODES = ("INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
               "DATA_LOSS", "UNAUTHENTICATED", "PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
               "CANCELLED", "INTERNAL", "UNKNOWN")
REMOTE_STATES = ("closed", "half_open", "open")


class _TierCollector(Collector):
    """Per-tier gauges, read from the engine's ``stat()`` when Prometheus scrapes."""

    def __init__(self, stat_fn: Callable[[], Stat]) -> None:
        self._stat_fn = stat_fn

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            st = self._stat_fn()
        except Exception as e:  # a closing engine: a scrape must not fail the daemon or show stale numbers
            log.debug("metrics: stat unavailable: %s", e)
            return
        cap = GaugeMetricFamily("kvpark_tier_capacity_bytes", "Bytes the tier may hold", labels=["tier"])
        used = GaugeMetricFamily("kvpark_tier_used_bytes", "Bytes the tier holds now", labels=["tier"])
        seqs = GaugeMetricFamily("kvpark_tier_sequences", "Parked sequences (and shared blocks) with a copy "
                                 "in the tier", labels=["tier"])
        blocks = GaugeMetricFamily("kvpark_tier_blocks", "Slot extents (memory tiers) or block records (disk) "
                                   "in the tier", labels=["tier"])
        for name, t in st.tiers.items():
            cap.add_metric([name], t.capacity_bytes)
            used.add_metric([name], t.used_bytes)
            seqs.add_metric([name], t.sequences)
            blocks.add_metric([name], t.blocks)
        yield cap
        yield used
        yield seqs
        yield blocks
        yield GaugeMetricFamily("kvpark_sequences", "Parked sequences and shared blocks", value=st.sequences)
        yield GaugeMetricFamily("kvpark_leases", "Open write reservations and read leases", value=st.leases)
        pinned = GaugeMetricFamily("kvpark_pinned_bytes", "Page-locked host memory the daemon holds: the host "
                                   "arena when registered for a device pool, and the bounded staging buffers",
                                   labels=["kind"])
        for kind in ("registered", "staging"):
            pinned.add_metric([kind], st.pinned.get(kind, 0))
        yield pinned
        if st.tenants:
            t_used = GaugeMetricFamily("kvpark_tenant_used_bytes", "Bytes a tenant holds per tier (disk: every "
                                       "byte it has parked)", labels=["tenant", "tier"])
            t_quota = GaugeMetricFamily("kvpark_tenant_quota_bytes", "A tenant's quota per tier (absent: "
                                        "unlimited)", labels=["tenant", "tier"])
            for ts in st.tenants:
                for tier, n in ts.used.items():
                    t_used.add_metric([ts.name, tier], n)
                for tier, n in ts.quota.items():
                    t_quota.add_metric([ts.name, tier], n)
            yield t_used
            yield t_quota
        r = st.remote
        if r is not None:
            state = GaugeMetricFamily("kvpark_remote_state", "The remote tier's circuit breaker: 1 for the state it "
                                      "is in (closed = healthy; open = failing fast)", labels=["state"])
            for name in REMOTE_STATES:
                state.add_metric([name], 1.0 if r.state == name else 0.0)
            yield state
            yield GaugeMetricFamily("kvpark_remote_pending_writes", "Copies to the remote tier queued or running",
                                    value=r.pending_writes)
            for name, help_, v in (
                    ("kvpark_remote_errors", "Remote calls that failed", r.errors),
                    ("kvpark_remote_refused", "Remote calls refused at once by the open breaker", r.refused),
                    ("kvpark_remote_outages", "Times the remote tier's breaker opened", r.outages),
                    ("kvpark_remote_data_loss", "Remote values that failed their checks (deleted)", r.data_loss),
                    ("kvpark_remote_written_bytes", "Bytes written to the remote tier", r.bytes_written),
                    ("kvpark_remote_read_bytes", "Bytes read from the remote tier", r.bytes_read)):
                yield CounterMetricFamily(name, help_, value=v)


class Metrics:
    def __init__(self, stat_fn: Callable[[], Stat] | None = None) -> None:
        # No ``*_created`` series beside each counter: a second series per counter that no
        # dashboard reads. The switch is the client library's, process-wide; the daemon
        # owns its process.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self._parks = Counter("kvpark_parks", "Committed parks", ["transport"], registry=r)
        self._restores = Counter("kvpark_restores", "Completed restores", ["transport"], registry=r)
        self._park_bytes = Counter("kvpark_park_bytes", "Payload bytes parked", ["transport"], registry=r)
        self._restore_bytes = Counter("kvpark_restore_bytes", "Payload bytes restored", ["transport"], registry=r)
        self._lookups = Counter("kvpark_lookup_blocks", "Blocks asked for by prefix lookups: hit (in the cached "
                                "prefix) or miss", ["result"], registry=r)
        self._lookup_tokens = Counter("kvpark_lookup_tokens", "Tokens asked for by prefix lookups whose caller "
                                      "said how many tokens a block holds: hit or miss", ["result"], registry=r)
        self._moves = Counter("kvpark_moves", "Copies between tiers (promotions and demotions)", ["src", "dst"],
                              registry=r)
        self._evictions = Counter("kvpark_evictions", "Sequences removed from a tier to make room", ["tier"],
                                  registry=r)
        self._checksum = Counter("kvpark_checksum_failures", "Disk records whose checksum did not match",
                                 registry=r)
        self._expiries = Counter("kvpark_lease_expiries", "Reservations and read leases that expired unreleased",
                                 registry=r)
        self._errors = Counter("kvpark_errors", "RPCs that ended in an error, by gRPC status code", ["code"],
                               registry=r)
        self._park_s = Histogram("kvpark_park_seconds", "Park duration, reserve to commit", ["transport"],
                                 buckets=_SECONDS_BUCKETS, registry=r)
        self._restore_s = Histogram("kvpark_restore_seconds", "Restore duration, request to last byte or lease",
                                    ["transport"], buckets=_SECONDS_BUCKETS, registry=r)
        self._move_s = Histogram("kvpark_move_seconds", "Copy duration between tiers", ["src", "dst"],
                                 buckets=_SECONDS_BUCKETS, registry=r)
        ProcessCollector(registry=r)
        Info("kvpark_build", "The daemon's version", registry=r).info({"version": VERSION})
        # Every known label value from the start (a series appearing at its first event
        # makes rate() miss that event and dashboards show gaps).
        for t in TRANSPORTS:
            for c in (self._parks, self._restores, self._park_bytes, self._restore_bytes):
                c.labels(t)
            self._park_s.labels(t)
            self._restore_s.labels(t)
        for code in ERROR_CODES:
            self._errors.labels(code)
        for result in ("hit", "miss"):
            self._lookups.labels(result)
            self._lookup_tokens.labels(result)
        if stat_fn is not None:
            self.watch(stat_fn)

    def known_tiers(self, names: Iterable[str]) -> None:
        """The daemon's tiers (``remote`` included when it has one): the eviction series
        of each, and the move series of each ordered pair, exist from now on."""
        names = list(names)
        for t in names:
            self._evictions.labels(t)
            for u in names:
                if u != t:
                    self._moves.labels(t, u)
                    self._move_s.labels(t, u)

    def watch(self, stat_fn: Callable[[], Stat]) -> None:
        """Export the per-tier gauges from ``stat_fn()`` at every scrape."""
        self.registry.register(_TierCollector(stat_fn))

    def parked(self, transport: str, nbytes: int, seconds: float) -> None:
        self._parks.labels(transport).inc()
        self._park_bytes.labels(transport).inc(nbytes)
        self._park_s.labels(transport).observe(seconds)

    def restored(self, transport: str, nbytes: int, seconds: float) -> None:
        self._restores.labels(transport).inc()
        self._restore_bytes.labels(transport).inc(nbytes)
        self._restore_s.labels(transport).observe(seconds)

    def looked_up(self, hits: int, misses: int, tokens_per_block: int = 0) -> None:
        """A prefix lookup: ``hits`` blocks in the prefix found, ``misses`` after it;
        ``tokens_per_block`` (0: unknown) counts their tokens as well."""
        self._lookups.labels("hit").inc(hits)
        self._lookups.labels("miss").inc(misses)
        if tokens_per_block > 0:
            self._lookup_tokens.labels("hit").inc(hits * tokens_per_block)
            self._lookup_tokens.labels("miss").inc(misses * tokens_per_block)

    def moved(self, src: str, dst: str, seconds: float) -> None:
        self._moves.labels(src, dst).inc()
        self._move_s.labels(src, dst).observe(seconds)

    def evicted(self, tier: str, n: int = 1) -> None:
        self._evictions.labels(tier).inc(n)

    def checksum_failure(self) -> None:
        self._checksum.inc()

    def lease_expired(self, n: int = 1) -> None:
        self._expiries.inc(n)

    def error(self, code: str) -> None:
        """``code``: the gRPC status code name, e.g. "NOT_FOUND"."""
        self._errors.labels(code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def split_listen(listen: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port); raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {listen!r}")
    return host.strip("[]"), int(port)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


def _bearer_only(app: Callable[..., Iterable[bytes]], digest: bytes) -> Callable[..., Iterable[bytes]]:
    """``app`` for requests whose bearer token hashes to ``digest``; 401 for the rest."""
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if token and hmac.compare_digest(hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest(), digest):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")])
        return [b"a bearer token is required (metrics.token_sha256)\n"]
    return guarded


class MetricsServer:
    def __init__(self, metrics: Metrics, listen: str, token_sha256: str = "") -> None:
        self.metrics = metrics
        self.listen = listen
        self.token_sha256 = token_sha256
        self.address = ""
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "MetricsServer":
        if not self.listen:
            return self
        try:
            host, port = split_listen(self.listen)
        except ValueError as e:
            raise StartupError(f"metrics.listen: {e}") from None
        app = make_wsgi_app(self.metrics.registry)
        if self.token_sha256:
            app = _bearer_only(app, bytes.fromhex(self.token_sha256))

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        try:
            self._server = make_server(host, port, app, Server, handler_class=_Quiet)
        except OSError as e:
            raise StartupError(
                f"cannot serve metrics on {self.listen}: {e.strerror or e}; set metrics.listen to a free "
                'address, or "" to turn the endpoint off'
            ) from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvpark-metrics", daemon=True)
        self._thread.start()
        bound_port = self._server.server_port
        self.address = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
        log.info("metrics on http://%s/metrics", self.address)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["Metrics", "MetricsServer", "NAMES", "split_listen"]
