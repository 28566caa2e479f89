"""Who is calling, and whether this daemon may listen where it was told to.

Primitives:
- ``AuthInterceptor(tenants, metrics=None)``: a gRPC server interceptor. With tenants configured, every
  call except the gRPC health service must carry ``authorization: Bearer <token>``
  metadata whose sha256 matches a tenant's ``token_sha256``; otherwise it ends with
  UNAUTHENTICATED (client ``Unauthenticated``) before its handler runs (counted in
  ``kvpark_errors_total{code="UNAUTHENTICATED"}``). A refused call is refused before
  any of its request is read: gRPC reads a unary request whole before a handler runs, so
  a token-less call is answered by a request-streaming handler that never pulls its
  message, and the daemon buffers no more of it than HTTP/2 flow control lets in. The tenant is
  bound for the handler's whole run, streams included, so every RPC, present or added
  later, is covered without doing anything.
- ``current_tenant() -> TenantConfig | None``: the caller of the running handler (None on
  an open daemon).
- ``AuthInterceptor.identify(metadata) -> TenantConfig | None``: the tenant a call's
  metadata proves, compared in constant time.
- ``check_exposure(ServerConfig, tenants, metrics=None)``: ``StartupError`` for a listen
  address off loopback without tenants or without TLS, unless ``server.insecure``; and
  with ``metrics`` (``MetricsConfig``), for ``metrics.listen`` off loopback without
  ``metrics.token_sha256``, unless ``server.insecure``.
- ``server_credentials(ServerConfig) -> grpc.ServerCredentials | None``: TLS (and mTLS
  with ``tls_client_ca``) from the configured PEM files; None without ``tls_cert``.

Tokens are never logged, never stored (only their sha256, in the config), and never
part of an error message.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ipaddress
from typing import Any, Callable, Iterator, Mapping, Sequence

import grpc

from kvpark.proto.errors import ERROR_KEY, StartupError, Unauthenticated

from .config import MetricsConfig, ServerConfig, TenantConfig
from .metrics import Metrics

_TENANT: contextvars.ContextVar[TenantConfig | None] = contextvars.ContextVar("kvpark_tenant", default=None)
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # a load balancer's probe carries no token
_BEARER = "bearer "


def current_tenant() -> TenantConfig | None:
    return _TENANT.get()


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> bytes:
    for k, v in metadata or ():
        if k == "authorization":
            text = v.decode("latin-1") if isinstance(v, bytes) else str(v)
            if text[:len(_BEARER)].lower() == _BEARER:
                return text[len(_BEARER):].strip().encode("utf-8", "surrogateescape")
    return b""


def _deny(context: grpc.ServicerContext, metrics: Metrics | None) -> None:
    if metrics is not None:
        metrics.error(grpc.StatusCode.UNAUTHENTICATED.name)
    context.set_trailing_metadata(((ERROR_KEY, Unauthenticated.__name__),))
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  "missing or invalid bearer token (pass token=... or set KVPARK_TOKEN)")


def _refused(handler: grpc.RpcMethodHandler, metrics: Metrics | None) -> grpc.RpcMethodHandler:
    """A handler that ends the call UNAUTHENTICATED without reading its request.

    Request-streaming whatever the method is (the wire is the same): gRPC hands such a
    handler an iterator and reads nothing until it is pulled, where for a unary request
    it would first receive the whole message (up to the maximum size) into memory.
    """
    streams = handler.unary_stream is not None or handler.stream_stream is not None

    def deny(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        _deny(context, metrics)

    def deny_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        _deny(context, metrics)
        yield from ()

    if streams:
        return grpc.stream_stream_rpc_method_handler(deny_stream, response_serializer=handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(deny, response_serializer=handler.response_serializer)


def _bound(fn: Callable[..., Any], tenant: TenantConfig, streams: bool) -> Callable[..., Any]:
    """``fn`` run with ``tenant`` as the caller."""
    if streams:
        def gen(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            # The handler's generator runs on gRPC's threads, one step at a time: the
            # tenant is set for each step, in this generator's own frame.
            token = _TENANT.set(tenant)
            try:
                it = fn(request, context)
            finally:
                _TENANT.reset(token)
            try:
                while True:
                    token = _TENANT.set(tenant)
                    try:
                        item = next(it)
                    except StopIteration:
                        return
                    finally:
                        _TENANT.reset(token)
                    yield item
            finally:
                # A cancelled stream closes this generator: close the handler's now, so its
                # cleanup (releasing a read lease) runs at once and as the same tenant.
                close = getattr(it, "close", None)
                if close is not None:
                    token = _TENANT.set(tenant)
                    try:
                        close()
                    finally:
                        _TENANT.reset(token)
        return gen

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        token = _TENANT.set(tenant)
        try:
            return fn(request, context)
        finally:
            _TENANT.reset(token)
    return unary


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, tenants: Mapping[str, TenantConfig], metrics: Metrics | None = None) -> None:
        self.tenants = dict(tenants)
        self.metrics = metrics
        self._digests = [(bytes.fromhex(t.token_sha256), t) for t in self.tenants.values()]

    def identify(self, metadata: Sequence[tuple[str, Any]] | None) -> TenantConfig | None:
        """The tenant whose token the call carries, or None."""
        token = _bearer(metadata)
        if not token:
            return None
        digest = hashlib.sha256(token).digest()
        found = None
        # Every tenant is compared, each in constant time: neither which tenant nor how
        # much of a digest matched shows in the time a refusal takes.
        for d, t in self._digests:
            if hmac.compare_digest(digest, d):
                found = t
        return found

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or not self.tenants or details.method.startswith(OPEN_SERVICES):
            return handler
        tenant = self.identify(details.invocation_metadata)
        if tenant is None:
            return _refused(handler, self.metrics)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_bound(handler.unary_unary, tenant, False))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_bound(handler.unary_stream, tenant, True))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_bound(handler.stream_unary, tenant, False))
        return handler._replace(stream_stream=_bound(handler.stream_stream, tenant, True))


def _loopback(listen: str) -> bool:
    if listen.startswith("unix:"):
        return True
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(server: ServerConfig, tenants: Mapping[str, TenantConfig],
                   metrics: MetricsConfig | None = None) -> None:
    # The data channel carries the same bytes: an address of its own is held to the same rule.
    dc = server.data_channel_listen if server.data_channel else ""
    for key, listen in (("server.listen", server.listen), ("server.data_channel_listen", dc)):
        if listen:
            _check_one(key, listen, server, tenants)
    # /metrics shows the daemon's usage (and, with tenant_labels, every tenant's): off
    # loopback only behind its own token, or when the operator says insecure.
    if metrics is not None and metrics.listen and not _loopback(metrics.listen) and not server.insecure \
            and not metrics.token_sha256:
        raise StartupError(f"metrics.listen {metrics.listen} is not loopback and metrics.token_sha256 is not set: "
                           "anyone who reaches the port could watch the daemon; set metrics.token_sha256, listen "
                           "on 127.0.0.1, or set server.insecure = true")


def _check_one(key: str, listen: str, server: ServerConfig, tenants: Mapping[str, TenantConfig]) -> None:
    if _loopback(listen) or server.insecure:
        return
    if not tenants:
        raise StartupError(f"{key} {listen} is not loopback and no [tenants.*] are configured: anyone who "
                           "reaches the port could read and drop every sequence; configure tenants and TLS, listen "
                           "on 127.0.0.1 or a unix socket, or set server.insecure = true")
    if not server.tls_cert:
        raise StartupError(f"{key} {listen} is not loopback and TLS is off: tokens and KV would travel in "
                           "clear; set server.tls_cert and server.tls_key, or set server.insecure = true")


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise StartupError(f"{key}: cannot read {path}: {e.strerror or e}") from None


def server_credentials(server: ServerConfig) -> grpc.ServerCredentials | None:
    if not server.tls_cert:
        return None
    cert, key = _read(server.tls_cert, "server.tls_cert"), _read(server.tls_key, "server.tls_key")
    ca = _read(server.tls_client_ca, "server.tls_client_ca") if server.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


__all__ = ["AuthInterceptor", "OPEN_SERVICES", "check_exposure", "current_tenant", "server_credentials"]
