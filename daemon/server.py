"""Server lifecycle: bind, serve, health, reflection, graceful drain.

Primitives:
- ``Daemon(config, disk_factory=DiskStore)``: ``start()`` refuses an exposed address
  (``auth.check_exposure``), binds (port 0 picks a free port; TLS with ``server.tls_cert``;
  a unix socket made mode 0600, or 0660 with ``server.socket_group``), installs the
  tenants' ``AuthInterceptor`` and begins serving;
  ``address`` is then the resolved address; ``stop(grace)`` stops taking calls, lets
  in-flight ones finish for ``grace`` seconds, flushes per policy and closes the tiers.
  Usable as a context manager (tests run real daemons this way). ``metrics`` is its
  ``Metrics``; ``metrics_address`` the bound ``/metrics`` address ("" when off).
  ``datachannel`` is its ``DataChannelServer`` (``None`` with ``server.data_channel = false``);
  ``datachannel.address`` is what Hello advertises.
- ``grpc_options(chunk_size=None)``: the server's channel options (the shared
  ``kvpark.proto.GRPC_OPTIONS``); with ``chunk_size``, a request may be no larger than
  ``max_request_bytes(chunk_size)``.
- ``max_request_bytes(chunk_size)``: the largest request a client sends (a chunk of
  payload plus a header naming ``MAX_PARTS`` ids of the longest length); anything larger
  is RESOURCE_EXHAUSTED before gRPC buffers it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


from kvpark.proto import GRPC_OPTIONS as CHANNEL_OPTIONS
from kvpark.proto.errors import StartupError
from kvpark.proto.layout import MAX_SEQ_ID_BYTES
from kvpark.tiers.disk import DiskStore
from kvpark.tiers.shm import boot_id, group_id

from .auth import AuthInterceptor, check_exposure, server_credentials
from .config import Config
from .datachannel import DataChannelServer, listen_address, server_ssl_context
from .engine import DiskFactory, Engine
from .metrics import Metrics, MetricsServer
from .model import MAX_PARTS
from .servicer import SERVICE, handlers
from .sockets import UnixClaim, claim_unix_path, unix_path
from .tenants import Tenants

log = logging.getLogger("kvpark")
HANDLER_WAIT_S = 30.0  # how long stop() waits for cancelled calls' handler threads to leave

def max_request_bytes(chunk_size: int) -> int:
    """A ParkSmall or a Park stream's chunk carries at most ``chunk_size`` payload bytes;
    the largest header or id list names ``MAX_PARTS`` ids (a Lookup, a park's new blocks),
    each at most ``MAX_SEQ_ID_BYTES`` with its metadata. Bulk bytes never need more: they
    go in chunks or on the data channel."""
    return chunk_size + MAX_PARTS * (MAX_SEQ_ID_BYTES + 128)


def grpc_options(chunk_size: int | None = None) -> list[tuple[str, int]]:
    """The shared channel options (read at start, so a bench can vary them), no port reuse."""
    opts = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]
    if chunk_size is not None:
        # What a caller, authenticated or not, can make the daemon buffer for one message.
        opts = [o for o in opts if o[0] != "grpc.max_receive_message_length"]
        opts.append(("grpc.max_receive_message_length", max_request_bytes(chunk_size)))
    return opts


def _cannot_listen(listen: str, why: str) -> str:
    return (f"server.listen = {listen}: cannot listen there ({why}); another kvpark daemon may hold it: choose "
            "another with --listen HOST:PORT or --set server.listen=HOST:PORT (port 0 picks a free one)")


def _probe(listen: str) -> None:
    """Bind ``listen`` once ourselves, as gRPC will (SO_REUSEADDR), and refuse in words
    if that fails: gRPC's own refusal is a raw C-core log line and a hint about its
    debug log, and its log level is fixed before this module can set it."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or None
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as e:
        raise StartupError(_cannot_listen(listen, f"not an address here: {e}")) from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as e:
                raise StartupError(_cannot_listen(listen, e.strerror or str(e))) from None


def _claim(key: str, listen: str) -> UnixClaim:
    try:
        return claim_unix_path(unix_path(listen))
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise StartupError(f"{key} = {listen}: cannot listen there ({why})") from None


def _release(server: grpc.Server) -> None:
    """Close a server's listeners after a failed start. ``stop`` alone does nothing to a
    server that never started: its ports would stay bound (and accepting) for the life of
    the process, holding the address against the next start."""
    try:
        server.start()
    except Exception:  # nothing bound, or already started: stop is enough
        pass
    server.stop(None).wait(HANDLER_WAIT_S)


def _restrict_socket(listen: str, group: str) -> None:
    """Exactly 0600 (owner only), or 0660 with ``group``, before the server starts serving.
    A unix socket's mode is what guards connect()."""
    path = unix_path(listen)
    if not os.path.exists(path):
        return  # an abstract socket (unix-abstract:) has no file; nothing to guard
    if group:
        try:
            os.chown(path, -1, group_id(group))
        except PermissionError:
            raise StartupError(f"server.socket_group: this user may not give files to group {group!r}") from None
    os.chmod(path, 0o660 if group else 0o600)


class Daemon:
    def __init__(self, config: Config, *, disk_factory: DiskFactory = DiskStore) -> None:
        self.config = config
        self._disk_factory = disk_factory
        self.engine: Engine | None = None
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self.address = ""
        self.metrics = Metrics()
        self._metrics_server: MetricsServer | None = None
        self.metrics_address = ""
        self.datachannel: DataChannelServer | None = None
        self._claims: list[UnixClaim] = []

    def start(self) -> "Daemon":
        self.metrics = Metrics()
        metrics_server = MetricsServer(self.metrics, self.config.metrics.listen, self.config.metrics.token_sha256)
        engine: Engine | None = None
        datachannel: DataChannelServer | None = None
        claims: list[UnixClaim] = []
        dc_claim: UnixClaim | None = None
        check_exposure(self.config.server, self.config.tenants, self.config.metrics)
        creds = server_credentials(self.config.server)
        auth = [AuthInterceptor(self.config.tenants, self.metrics)] if self.config.tenants else None
        self._handlers = ThreadPoolExecutor(max_workers=self.config.server.max_workers,
                                            thread_name_prefix="kvpark-rpc")
        server = grpc.server(
            self._handlers,
            options=grpc_options(self.config.server.chunk_size),
            interceptors=auth,
        )
        try:
            # The ports first: a busy one is reported at once, before the arena (GBs)
            # is reserved and mapped. Handlers may be added until the server starts.
            listen = self.config.server.listen
            # gRPC would unlink a live daemon's socket to bind its path: each unix path
            # (gRPC's, the data channel's) is claimed first, and held until stop().
            dc_listen = listen_address(listen, self.config.server.data_channel_listen) \
                if self.config.server.data_channel else ""
            if listen.startswith("unix:"):
                claims.append(_claim("server.listen", listen))
            else:
                _probe(listen)
            if dc_listen.startswith("unix:"):
                dc_claim = _claim("server.data_channel_listen", dc_listen)
                claims.append(dc_claim)
            # A unix socket is created owner-only (umask 177): no moment exists in which
            # another user could connect. (The umask is the process's; it only narrows.)
            old_umask = os.umask(0o177) if listen.startswith("unix:") else None
            try:
                port = server.add_insecure_port(listen) if creds is None else server.add_secure_port(listen, creds)
            except RuntimeError:
                port = 0
            finally:
                if old_umask is not None:
                    os.umask(old_umask)
            if port == 0:
                raise StartupError(_cannot_listen(listen, "gRPC could not bind it"))
            if listen.startswith("unix:"):
                _restrict_socket(listen, self.config.server.socket_group)
            if not listen.startswith("unix:"):
                listen = re.sub(r":0$", f":{port}", listen)
            self.address = listen
            # Bound before serving: a busy metrics port refuses the start instead of
            # leaving a daemon that operators cannot see.
            metrics_server.start()
            t0 = time.perf_counter()
            engine = Engine(self.config, disk_factory=self._disk_factory, metrics=self.metrics)
            tenants = Tenants(engine, self.config.tenants)
            # /metrics (loopback by default, the operator's) shows every tenant's row, named,
            # only when the operator asks for it (metrics.tenant_labels).
            named = self.config.metrics.tenant_labels
            self.metrics.known_tiers([*engine.stat().tiers, *(["remote"] if engine.remote is not None else [])])
            self.metrics.watch(lambda: dataclasses.replace(
                engine.stat(), tenants=tuple(tenants.all_stats()) if named else ()))
            if self.config.server.data_channel:
                # TLS exactly when gRPC has it (the same certificate, and client
                # certificates required when gRPC requires them).
                datachannel = DataChannelServer(
                    engine, dc_listen, ssl_context=server_ssl_context(self.config.server), claim=dc_claim).start()
                if datachannel.address.startswith("unix:"):
                    _restrict_socket(datachannel.address, self.config.server.socket_group)  # as the gRPC socket
            rpc = handlers(engine, self.config.server, socket.gethostname(), boot_id(), self.metrics,
                           tenants=tenants, datachannel=datachannel)
            server.add_generic_rpc_handlers((rpc,))
            self._health = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
            reflection.enable_server_reflection(
                (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
            engine.start()
            server.start()
            self._log_effective(time.perf_counter() - t0)
        except BaseException:
            _release(server)
            if datachannel is not None:
                datachannel.stop()
            metrics_server.stop()
            if engine is not None:
                engine.close(flush=False)
            for claim in claims:
                claim.release()
            raise
        self._claims = claims
        self.engine, self._server, self.datachannel = engine, server, datachannel
        self._metrics_server, self.metrics_address = metrics_server, metrics_server.address
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info("kvpark listening on %s", self.address)
        return self

    def _log_effective(self, took: float) -> None:
        """What this daemon runs with, in one place: where each tier lives and how big it is."""
        cfg = self.config
        pol = cfg.policy
        log.info("disk tier: %s, %d MiB; policy: eviction=%s write=%s disk_full=%s watermarks %.2f/%.2f",
                 cfg.tiers.disk.path, cfg.disk_capacity >> 20, pol.eviction, pol.write, pol.disk_full,
                 pol.high_watermark, pol.low_watermark)
        if cfg.remote_options is not None:
            # Not the URL itself: it may carry a password.
            log.info("remote tier: on (write=%s)", cfg.tiers.remote.write)
        log.info("tiers ready in %.2fs (arena reserved and mapped, index loaded)", took)

    def stop(self, grace: float | None = None) -> None:
        if self._server is None or self.engine is None:
            return
        grace = self.config.server.grace_s if grace is None else grace
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        # A handler waiting for a pending id (a refused park's undo the disk keeps failing)
        # gives up now, not at its deadline: the join below would wait for it.
        self.engine.end_waits()
        # A cancelled call's handler thread may still be inside the engine (a disk write
        # of a windowed park, say): the engine closes once they are out, or a bounded
        # while later (a handler stuck for good must not hold the stop forever).
        self._handlers.shutdown(wait=False)
        ends = time.monotonic() + HANDLER_WAIT_S
        for t in list(getattr(self._handlers, "_threads", ())):
            t.join(max(0.0, ends - time.monotonic()))
        if self.datachannel is not None:
            self.datachannel.stop()  # after gRPC: no token is issued any more
            self.datachannel = None
        self.engine.close()
        for claim in self._claims:  # the sockets are closed: the paths may go to another daemon
            claim.release()
        self._claims = []
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        log.info("kvpark stopped")
        self._server = None
        self.engine = None

    def wait(self, timeout: float | None = None) -> bool:
        assert self._server is not None
        return self._server.wait_for_termination(timeout)

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["Daemon", "grpc_options", "max_request_bytes"]
