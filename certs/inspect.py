"""Human- and machine-readable facts about a certificate: identity, serial, validity, time left."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509

from certs.chain import is_ca
from certs.errors import PemError


@dataclass(frozen=True)
class CertificateInfo:
    subject: str
    issuer: str
    serial: int
    uri_sans: tuple[str, ...]
    dns_sans: tuple[str, ...]
    not_before: datetime
    not_after: datetime
    is_ca: bool

    @property
    def identity(self) -> str | None:
        """The SPIFFE ID the certificate carries, if any."""
        for uri in self.uri_sans:
            if uri.startswith("spiffe://"):
                return uri
        return None

    @property
    def lifetime(self) -> timedelta:
        return self.not_after - self.not_before

    def time_left(self, now: datetime) -> timedelta:
        return self.not_after - now

    @property
    def serial_hex(self) -> str:
        return format(self.serial, "x")


def describe_certificate(cert: x509.Certificate) -> CertificateInfo:
    """The facts of `cert`. cryptography parses names and extensions lazily, so a malformed one
    shows here first: `PemError` (a `CertsError`), not a bare ValueError from deep inside."""
    uris: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()
    try:
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            uris = tuple(san.get_values_for_type(x509.UniformResourceIdentifier))
            dns = tuple(san.get_values_for_type(x509.DNSName))
        except x509.ExtensionNotFound:
            pass
        subject, issuer = cert.subject.rfc4514_string(), cert.issuer.rfc4514_string()
    except (ValueError, x509.DuplicateExtension) as exc:
        raise PemError(f"certificate: its names or extensions do not parse ({exc})") from None
    return CertificateInfo(
        subject=subject,
        issuer=issuer,
        serial=cert.serial_number,
        uri_sans=uris,
        dns_sans=dns,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        is_ca=is_ca(cert),
    )


def format_duration(delta: timedelta) -> str:
    """`3d4h`, `59m12s`, `-2h` (expired): compact, for CLI output and logs."""
    seconds = int(delta.total_seconds())
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    days, seconds = divmod(seconds, 86400)
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (seconds, "s")]
    text = "".join(f"{value}{unit}" for value, unit in parts if value)
    return sign + (text or "0s")
