"""Self-signed CA, server and client certificates for TLS tests (made with cryptography)."""

from __future__ import annotations

import datetime
import pathlib


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: pathlib.Path, key, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_pki(folder: pathlib.Path) -> dict[str, str]:
    """Write ca.crt, server.crt/key (for localhost and 127.0.0.1) and client.crt/key."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = _key()
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("calibrl test CA"))
        .issuer_name(_name("calibrl test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write(folder / "ca", ca_key, ca)

    def leaf(name: str, san: list) -> None:
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(folder / name, key, cert)

    leaf("server", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    leaf("client", [x509.DNSName("calibrl-client")])
    return {
        name: str(folder / name)
        for name in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    }
