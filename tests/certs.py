"""Throwaway certificates for the TLS and mTLS tests, made with ``cryptography``.

Primitives:
- ``make_pki(dir) -> Pki``: a CA, a server certificate for ``localhost`` and
  ``127.0.0.1`` and a client certificate, all signed by the CA, written as PEM files
  (``ca``, ``server_cert``, ``server_key``, ``client_cert``, ``client_key``: paths); and a
  second, unrelated CA (``other_ca``) whose signature the daemon must not accept.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey,
          *, ca: bool = False, sans: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, *objs: object) -> str:
    out = b""
    for o in objs:
        if isinstance(o, x509.Certificate):
            out += o.public_bytes(serialization.Encoding.PEM)
        else:
            key: ec.EllipticCurvePrivateKey = o  # type: ignore[assignment]
            out += key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
    path.write_bytes(out)
    return str(path)


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    ca_key, other_key, srv_key, cli_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    ca = _cert("kvpark test CA", ca_key, "kvpark test CA", ca_key, ca=True)
    other = _cert("another CA", other_key, "another CA", other_key, ca=True)
    srv = _cert("localhost", srv_key, "kvpark test CA", ca_key,
                sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cli = _cert("worker-1", cli_key, "kvpark test CA", ca_key)
    return Pki(ca=_write(d / "ca.pem", ca), server_cert=_write(d / "server.pem", srv),
               server_key=_write(d / "server.key", srv_key), client_cert=_write(d / "client.pem", cli),
               client_key=_write(d / "client.key", cli_key), other_ca=_write(d / "other-ca.pem", other))
