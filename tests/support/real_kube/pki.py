"""The key material a test control plane needs: its CA, serving and admin certificates, and the
service-account issuer's signing key.

Why generated per run: a committed key would be a key anyone can sign tokens with; these live in
the control plane's temporary directory and die with it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_LIFETIME = timedelta(days=2)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


@dataclass(frozen=True)
class ClusterFiles:
    """Paths of the PEM files the API server and its clients are given."""

    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_public_key: Path
    sa_signing_key: Path
    ca_key: Path  # to issue more client certificates (a node's: `issue_client_certificate`)


def write_cluster_pki(directory: Path) -> ClusterFiles:
    """A cluster CA, the API server's loopback serving certificate, an admin client
    certificate (group system:masters, as kubeadm's admin.conf) and an RSA issuer key."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.now(UTC) - timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("meshca-test-cluster-ca"))
        .issuer_name(_name("meshca-test-cluster-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(subject: x509.Name, usage: x509.ObjectIdentifier, san: bool) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + _LIFETIME)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    serving = leaf(_name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, san=True)
    admin = leaf(
        _name("meshca-test-admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH, False
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    files = ClusterFiles(
        ca_cert=directory / "ca.crt",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_public_key=directory / "sa.pub",
        sa_signing_key=directory / "sa.key",
        ca_key=directory / "ca.key",
    )
    files.ca_key.write_bytes(_pem_key(ca_key))
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.serving_cert.write_bytes(serving[0])
    files.serving_key.write_bytes(serving[1])
    files.admin_cert.write_bytes(admin[0])
    files.admin_key.write_bytes(admin[1])
    files.sa_signing_key.write_bytes(_pem_key(sa_key))
    files.sa_public_key.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    for key_file in (files.serving_key, files.admin_key, files.sa_signing_key, files.ca_key):
        key_file.chmod(0o600)
    return files


def issue_client_certificate(
    files: ClusterFiles, directory: Path, common_name: str, organization: str | None = None
) -> tuple[Path, Path]:
    """A client certificate the API server authenticates as user `common_name` in group
    `organization` (a kubelet's: `system:node:<name>` in `system:nodes`); (cert, key) paths."""
    ca_cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC) - timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organization))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    stem = common_name.replace(":", "-")
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem_key(key))
    key_path.chmod(0o600)
    return cert_path, key_path
