"""One throwaway mesh PKI for every test, built with meshca's own `certs` library.

In the manner of trustme: a CA object with verbs.

    ca = TestCa()                       # a self-signed root (ECDSA P-256, 10 years)
    issued = ca.issue(identity, ttl=timedelta(hours=1), now=...)   # leaf + key, as PEM
    chain = ca.sign_csr(csr_pem, ttl, now)   # Istio's response layout for a CSR
    inter = ca.child_ca()               # an intermediate; it issues the same way
    ca.root_pem, ca.root_secret(), ca.write_serving(directory, now)

Leaves follow the CA's profile (`certs.build_workload_certificate`), backdated for clock skew.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509

from agent.secrets import DEFAULT_RESOURCE, ROOT_RESOURCE, RootSecret, TlsSecret
from certs import (
    CLOCK_SKEW_BACKDATE,
    PrivateKey,
    PublicKey,
    SpiffeId,
    build_intermediate_certificate,
    build_root_certificate,
    build_serving_certificate,
    build_workload_certificate,
    cert_to_pem,
    certs_to_pem,
    describe_csr,
    generate_private_key,
    load_csr,
    private_key_to_pem,
    public_key_of,
)
from meshca.files import atomic_write

SERVING_HOSTS = ("localhost", "127.0.0.1", "istiod.istio-system.svc")


@dataclass(frozen=True)
class Issued:
    """One workload certificate (with any intermediates after it) and its key, as PEM."""

    cert: x509.Certificate
    cert_pem: str
    key_pem: str = field(repr=False)

    @property
    def serial(self) -> int:
        return self.cert.serial_number

    def tls_secret(self, name: str = DEFAULT_RESOURCE) -> TlsSecret:
        return TlsSecret(name=name, cert_chain_pem=self.cert_pem, private_key_pem=self.key_pem)

    @property
    def credential_bundle(self) -> str:
        """What the kubelet writes for a `podCertificate` volume's `credentialBundlePath`:
        the PKCS#8 key, then the chain (leaf first)."""
        return self.key_pem + self.cert_pem


class TestCa:
    """A signing CA: a self-signed root, or (`child_ca`) an intermediate under another."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        now: datetime | None = None,
        *,
        trust_domain: str = "cluster.local",
        lifetime: timedelta = timedelta(days=3650),
        parent: TestCa | None = None,
    ) -> None:
        self.now = now or datetime.now(UTC)
        self.trust_domain = trust_domain
        self.parent = parent
        self.key: PrivateKey = generate_private_key()
        if parent is None:
            self.cert = build_root_certificate(
                self.key, trust_domain, now=self.now, lifetime=lifetime
            )
        else:
            self.cert = build_intermediate_certificate(
                self.key.public_key(),
                parent.cert,
                parent.key,
                trust_domain,
                now=self.now,
                lifetime=lifetime,
            )

    # -- what the trust side needs -----------------------------------------------------------

    @property
    def root(self) -> x509.Certificate:
        return self.parent.root if self.parent is not None else self.cert

    @property
    def root_pem(self) -> str:
        return cert_to_pem(self.root)

    @property
    def intermediates(self) -> list[x509.Certificate]:
        """This CA's certificate and its parents', up to (not including) the root."""
        if self.parent is None:
            return []
        return [self.cert, *self.parent.intermediates]

    def root_secret(self, name: str = ROOT_RESOURCE) -> RootSecret:
        return RootSecret(name=name, trusted_ca_pem=self.root_pem)

    def write_cacerts(self, directory: Path, roots: list[TestCa]) -> None:
        """Plugs this CA into a `--cacerts-dir` (Istio's layout: `ca-key.pem`, `ca-cert.pem`,
        `cert-chain.pem` up to the root) with `roots`' certificates as `root-cert.pem`, the way
        the kubelet updates a mounted Secret: the four files in a new generation directory,
        then one atomic swap of the `..data` link the file names point through, so a CA polling
        the directory never sees half of one set and half of the next (a mix is itself a
        plausible, refusable change). Old generations are kept: a reader may still hold one."""
        directory.mkdir(parents=True, exist_ok=True)
        generation = Path(tempfile.mkdtemp(dir=directory, prefix="..gen-"))
        generation.chmod(0o755)
        chain = [self.cert, *self.intermediates[1:], self.root] if self.parent else [self.cert]
        files = {
            "ca-key.pem": (private_key_to_pem(self.key), 0o600),
            "ca-cert.pem": (cert_to_pem(self.cert).encode(), 0o644),
            "cert-chain.pem": (certs_to_pem(chain).encode(), 0o644),
            "root-cert.pem": (certs_to_pem([r.root for r in roots]).encode(), 0o644),
        }
        for name, (data, mode) in files.items():
            atomic_write(generation / name, data, mode=mode)
        swap = directory / "..data_tmp"
        swap.unlink(missing_ok=True)
        swap.symlink_to(generation.name)
        os.replace(swap, directory / "..data")
        for name in files:
            link = directory / name
            if not link.is_symlink():
                link.unlink(missing_ok=True)
                link.symlink_to(f"..data/{name}")

    # -- verbs -------------------------------------------------------------------------------

    def child_ca(self, *, lifetime: timedelta = timedelta(days=365)) -> TestCa:
        """An intermediate CA signed by this one, valid from this CA's `now`."""
        return TestCa(self.now, trust_domain=self.trust_domain, lifetime=lifetime, parent=self)

    def identity(self, service_account: str, namespace: str = "default") -> SpiffeId:
        return SpiffeId(self.trust_domain, namespace, service_account)

    def issue(
        self,
        identity: SpiffeId | str,
        *,
        ttl: timedelta = timedelta(hours=1),
        now: datetime | None = None,
        key: PrivateKey | None = None,
    ) -> Issued:
        """A workload certificate for `identity` (a service account name means the default
        namespace), valid from `now` (default: the CA's) for `ttl`."""
        if isinstance(identity, str):
            identity = self.identity(identity)
        key = key or generate_private_key()
        leaf = self._leaf(key.public_key(), identity, ttl, now or self.now)
        chain_pem = certs_to_pem([leaf, *self.intermediates])
        return Issued(leaf, chain_pem, private_key_to_pem(key).decode())

    def sign_csr(
        self, csr_pem: str, ttl: timedelta, now: datetime, uri: str | None = None
    ) -> list[str]:
        """What a CA answers for `csr_pem` (for the CSR's own URI, or `uri`): Istio's layout,
        leaf first, then each intermediate, then the root bundle as the last element."""
        csr = load_csr(csr_pem)
        identity = SpiffeId.parse(uri or describe_csr(csr).uri_sans[0])
        leaf = self._leaf(public_key_of(csr), identity, ttl, now)
        return [cert_to_pem(c) for c in (leaf, *self.intermediates)] + [certs_to_pem([self.root])]

    def write_serving(self, directory: Path, now: datetime) -> tuple[bytes, bytes]:
        """(key PEM, cert PEM) for a CA serving on loopback under its usual names; the root is
        written to `directory/root-cert.pem` for the client to verify it with."""
        key = generate_private_key()
        cert = build_serving_certificate(
            key.public_key(),
            self.cert,
            self.key,
            hosts=list(SERVING_HOSTS),
            now=now,
            lifetime=timedelta(days=1),
        )
        (directory / "root-cert.pem").write_text(self.root_pem)
        return private_key_to_pem(key), cert_to_pem(cert).encode()

    def _leaf(
        self, public_key: PublicKey, identity: SpiffeId, ttl: timedelta, now: datetime
    ) -> x509.Certificate:
        return build_workload_certificate(
            public_key,
            identity,
            self.cert,
            self.key,
            not_before=now - CLOCK_SKEW_BACKDATE,
            not_after=now + ttl,
        )
