"""Whether a daemon that refused a plaintext client speaks TLS, so the client can say so.

A plaintext gRPC client against a TLS port sees only "Socket closed". After such a
failure the client asks once, on a fresh connection: does a TLS handshake get a TLS
answer there? The probe verifies nothing and sends nothing but a ClientHello; its only
use is a better error message.

Primitives:
- ``speaks_tls(address, timeout=2.0) -> bool``: True when the peer at ``address`` (a gRPC
  address) completes a TLS handshake or answers with a TLS alert (a client certificate
  required, say); False for anything else, including no answer.
"""

from __future__ import annotations

import socket
import ssl

from kvpark.proto.dataframe import parse_address


def speaks_tls(address: str, timeout: float = 2.0) -> bool:
    try:
        family, addr = parse_address(address)
    except ValueError:
        return False
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # a probe: nothing is sent over it, nothing trusted
    try:
        with socket.socket(family, socket.SOCK_STREAM) as raw:
            raw.settimeout(timeout)
            raw.connect(addr)
            with ctx.wrap_socket(raw):
                return True
    except ssl.SSLError as e:
        return "ALERT" in str(e.reason or "").upper()  # the peer spoke TLS, and said no
    except OSError:
        return False


__all__ = ["speaks_tls"]
