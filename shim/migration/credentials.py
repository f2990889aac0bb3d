"""Node credentials for migrations (docs/design/migration.md (Live migration)): every node has a
certificate and key signed by the cluster's migration CA (`[migration] cert_file`, `key_file`,
`ca_file`); both ends of a link present theirs and check the other's (mutual TLS 1.3). A node is
named by its certificate: the destination's name or address must be in its certificate's subject
alternative names (the source connects to it as to any TLS server); the source's certificate must
carry the name the destination's RestorePod expects (`lazy-migration-from`).

`issue` makes a CA and node certificates (the test beds', and an operator's starting point).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim import errors


@dataclass(frozen=True)
class NodeCredentials:
    cert_file: str
    key_file: str
    ca_file: str

    def _context(self, purpose: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
            ctx.load_verify_locations(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise errors.FailedPrecondition(
                f"the node's migration credentials ([migration] cert_file {self.cert_file}, key_file "
                f"{self.key_file}, ca_file {self.ca_file}) cannot be loaded: {e}"
            ) from None
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: a peer without a certificate of the CA is refused
        return ctx

    def server_context(self) -> ssl.SSLContext:
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    def client_context(self) -> ssl.SSLContext:
        ctx = self._context(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = True  # the destination's name or address is in its certificate
        return ctx


def peer_names(cert: dict[str, Any] | None) -> set[str]:
    """The names a verified peer certificate (`SSLSocket.getpeercert()`) carries: its subject's
    common name and its DNS and IP subject alternative names."""
    if not cert:
        return set()
    names = {v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"}
    names |= {v for kind, v in cert.get("subjectAltName", ()) if kind in ("DNS", "IP Address")}
    return names


def check_peer(cert: dict[str, Any] | None, expected: str) -> None:
    """FAILED_PRECONDITION unless the verified peer certificate names `expected`."""
    names = peer_names(cert)
    if expected not in names:
        raise errors.FailedPrecondition(
            f"the peer's certificate names {', '.join(sorted(names)) or 'nothing'}, not {expected!r}"
        )


def issue(directory: Path, nodes: dict[str, list[str]], days: int = 30) -> dict[str, tuple[Path, Path]]:
    """A new CA (`ca.pem`) and, for each node name, a certificate with that name as common name
    and DNS name and `nodes[name]` as IP addresses, signed by it: {name: (cert, key)}, all files
    0600 in `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def write(path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "podshim migration CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    write(directory / "ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    out = {}
    for name, ips in nodes.items():
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(name)]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
        write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        write(key_path, pem_key(key))
        out[name] = (cert_path, key_path)
    return out
