"""Certificates for the tests of an etcd served with TLS: a CA, and certificates it signs for
127.0.0.1, as PEM files (the `cryptography` package, which make test installs)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


class Issued(NamedTuple):
    """A certificate and its private key, as PEM files."""

    cert: str
    key: str


class Authority:
    """A CA whose certificate is `self.cert` (a PEM file in `folder`), and what it signs."""

    def __init__(self, folder: Path, name: str = "tensorbroker test CA") -> None:
        self.folder, self._key = folder, ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._name = subject
        ca = self._builder(subject, self._key.public_key()).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        )
        slug = name.replace(" ", "-")
        self.cert = self._write(f"{slug}.pem", ca.sign(self._key, hashes.SHA256()))

    def issue(self, name: str) -> Issued:
        """A certificate for `name` at 127.0.0.1, good for TLS servers and clients alike."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            self._builder(subject, key.public_key())
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        key_path = self.folder / f"{name}-key.pem"
        key_path.write_bytes(key_pem)
        return Issued(self._write(f"{name}.pem", cert), str(key_path))

    def _builder(
        self, subject: x509.Name, public: ec.EllipticCurvePublicKey
    ) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(getattr(self, "_name", subject))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def _write(self, name: str, cert: x509.Certificate) -> str:
        path = self.folder / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(path)
