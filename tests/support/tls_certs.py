"""Certificates for tests that run TLS on localhost: a key, a certificate valid from five
minutes ago for a day (self-signed, or signed by a CA the test made), and PEM files of both.
cryptography is imported on first use, so a test module can still skip without it."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any


def new_key() -> Any:
    """A P-256 private key."""
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def certificate(
    key: Any,
    name: str,
    *,
    ca: bool,
    localhost: bool,
    issuer: Any = None,
    issuer_key: Any = None,
) -> Any:
    """A certificate for `key` with common name `name`: self-signed, or signed by `issuer`
    (a certificate) with `issuer_key`. `ca`: it may sign others; `localhost`: it names
    localhost and 127.0.0.1 as subject alternative names (a server's)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject if issuer is None else issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if localhost:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    if ca:
        builder = builder.add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        )
    return builder.sign(key if issuer_key is None else issuer_key, hashes.SHA256())


def write_certificate(path: Path, cert: Any) -> Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def write_key(path: Path, key: Any) -> Path:
    """`key` as unencrypted PKCS#8 PEM."""
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path
