"""Daemon addresses, one rule for the client, the CLI and the vLLM connector.

gRPC takes a bare host as port 443 and reports a URL as "Misformatted domain name"; a
kvpark user means the daemon's port and deserves words. So:

- ``HOST:PORT`` and ``[V6]:PORT``: as given (the port checked: 1-65535);
- a bare ``HOST``, ``[V6]`` or IPv6 literal: kvpark's port, 50551;
- ``unix:PATH`` (and ``unix:///PATH``, ``unix-abstract:NAME``): a unix socket, as given;
- gRPC's own resolver forms (``dns:``, ``ipv4:``, ``ipv6:``): as given;
- anything else with a scheme (``http://``, ``grpc://``...): refused with ``InvalidArgument``
  saying what to write instead.

Primitives: ``DEFAULT_PORT``; ``normalize(address) -> str``.
"""

from __future__ import annotations

import re

from kvpark.proto.errors import InvalidArgument

DEFAULT_PORT = 50551
_PASS = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_FORM = "HOST:PORT (e.g. 127.0.0.1:50551), HOST alone for port 50551, or unix:/PATH"


def normalize(address: str) -> str:
    a = address.strip()
    if not a:
        raise InvalidArgument(f"empty daemon address: expected {_FORM}")
    if a.startswith(_PASS):
        return a
    m = _SCHEME.match(a)
    if m:
        rest = a[m.end():].rstrip("/")
        hint = f"; did you mean {rest}?" if rest and "/" not in rest else ""
        raise InvalidArgument(f"daemon address {address!r}: kvpark speaks gRPC, not {m.group(1)}://; "
                              f"expected {_FORM}{hint}")
    if a.startswith("["):  # [v6] or [v6]:port
        end = a.find("]")
        if end < 0:
            raise InvalidArgument(f"daemon address {address!r}: an IPv6 literal needs its closing ']'")
        host, rest = a[:end + 1], a[end + 1:]
        if not rest:
            return f"{host}:{DEFAULT_PORT}"
        if not rest.startswith(":"):
            raise InvalidArgument(f"daemon address {address!r}: expected {_FORM}")
        return f"{host}:{_port(address, rest[1:])}"
    if a.count(":") > 1:  # a bare IPv6 literal: no port can be told apart from it
        return f"[{a}]:{DEFAULT_PORT}"
    host, sep, port = a.partition(":")
    if not host or "/" in a or any(c.isspace() for c in a):
        raise InvalidArgument(f"daemon address {address!r}: expected {_FORM}")
    return f"{host}:{_port(address, port)}" if sep else f"{host}:{DEFAULT_PORT}"


def _port(address: str, port: str) -> int:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"daemon address {address!r}: port {port!r} is not a number from 1 to 65535")
    return int(port)
