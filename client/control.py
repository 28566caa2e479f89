"""Control calls that need no tensors (``stat``, ``list``, ``info``, ``drop``, ``pin``,
``flush``), and a connection that makes only those: ``Control``.

The CLI is what operators and container probes run, and importing torch takes most of
a second: nothing here imports it (nor does anything it imports). ``Client`` makes the
same calls through the same code (``ControlCalls``), on its own connection.

Primitives:
- ``DEFAULT_ADDRESS``, ``TOKEN_ENV``, ``TLS_*_ENV``; ``tls_from_env(...)``.
- ``ControlCalls``: the calls, for a class with ``_call(stub, request, timeout)`` and
  ``rpc``.
- ``Control(address=None, *, token=None, timeout=None, tls_ca=None, tls_cert=None,
  tls_key=None)``: the address rule (``address.py``), the token and TLS files from the
  environment as ``Client`` takes them; ``server_version()``; ``close()``; a context
  manager.
"""

from __future__ import annotations

import os
from typing import Any

from kvpark.proto import convert
from kvpark.proto.errors import Unavailable
from kvpark.proto.layout import validate_seq_id
from kvpark.proto.types import SeqInfo, Stat
from kvpark.proto.v1 import kvpark_pb2 as pb

from .address import normalize
from .rpc import Rpc
from .tlsprobe import speaks_tls

DEFAULT_ADDRESS = "127.0.0.1:50551"
TOKEN_ENV = "KVPARK_TOKEN"  # the bearer token when ``token`` is not given
TLS_CA_ENV = "KVPARK_TLS_CA"  # the CA bundle file when ``tls_ca`` is not given
TLS_CERT_ENV, TLS_KEY_ENV = "KVPARK_TLS_CERT", "KVPARK_TLS_KEY"  # the client certificate and key (mTLS)


def tls_from_env(tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None) -> dict[str, str | bytes | None]:
    """The TLS files given, else the ``KVPARK_TLS_*`` environment's."""
    return {"tls_ca": tls_ca if tls_ca is not None else os.environ.get(TLS_CA_ENV) or None,
            "tls_cert": tls_cert if tls_cert is not None else os.environ.get(TLS_CERT_ENV) or None,
            "tls_key": tls_key if tls_key is not None else os.environ.get(TLS_KEY_ENV) or None}


class ControlCalls:
    rpc: Rpc

    def _call(self, stub: Any, req: Any, timeout: float | None) -> Any:
        raise NotImplementedError

    def drop(self, seq_id: str, *, timeout: float | None = None) -> bool:
        validate_seq_id(seq_id)
        return bool(self._call(self.rpc.drop, pb.DropRequest(seq_id=seq_id), timeout).dropped)

    def info(self, seq_id: str, *, timeout: float | None = None) -> SeqInfo:
        validate_seq_id(seq_id)
        return convert.info_from_pb(self._call(self.rpc.info, pb.InfoRequest(seq_id=seq_id), timeout))

    def list(self, *, timeout: float | None = None) -> list[SeqInfo]:
        return [convert.info_from_pb(i) for i in self._call(self.rpc.list, pb.ListRequest(), timeout).sequences]

    def stat(self, *, timeout: float | None = None) -> Stat:
        return convert.stat_from_pb(self._call(self.rpc.stat, pb.StatRequest(), timeout))

    def pin(self, seq_id: str, pinned: bool = True, *, timeout: float | None = None) -> SeqInfo:
        """Pin ``seq_id`` (never demoted below the tier it is in), or unpin it."""
        validate_seq_id(seq_id)
        req = pb.PinRequest(seq_id=seq_id, pinned=pinned)
        return convert.info_from_pb(self._call(self.rpc.pin, req, timeout))

    def flush(self, *, timeout: float | None = None) -> int:
        """Write every sequence that is only in memory to disk now; returns how many were written."""
        return int(self._call(self.rpc.flush, pb.FlushRequest(), timeout).written)


class Control(ControlCalls):
    def __init__(self, address: str | None = None, *, token: str | None = None, timeout: float | None = None,
                 tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None) -> None:
        self.address = normalize(address or os.environ.get("KVPARK_ADDRESS") or DEFAULT_ADDRESS)
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.rpc = Rpc(self.address, timeout, token=token, **tls_from_env(tls_ca, tls_cert, tls_key))

    def _call(self, stub: Any, req: Any, timeout: float | None) -> Any:
        try:
            with self.rpc.deadline(timeout):
                return self.rpc.call(stub, req)
        except Unavailable:
            if not any(self.rpc.tls) and speaks_tls(self.address):
                raise Unavailable(f"{self.address} requires TLS and this client connected in plaintext: pass "
                                  f"tls_ca=... (or set KVPARK_TLS_CA)") from None
            raise

    def server_version(self) -> str:
        """The daemon's version (its ``Hello``)."""
        from kvpark.proto import VERSION

        return str(self._call(self.rpc.hello, pb.HelloRequest(client_version=VERSION), None).server_version)

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self) -> "Control":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
