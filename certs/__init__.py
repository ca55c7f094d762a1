"""meshca's PKI library: keys, CSRs, SPIFFE IDs, certificate profiles, chains and PEM.

Pure by design: no file or network I/O, no clocks, no globals, no threads. The CA server and the
agent both build on it; it imports neither.
"""

from certs.authority import (
    SigningAuthority,
    make_authority,
    new_self_signed_authority,
    self_signed_authority,
)
from certs.chain import build_path, is_ca, verify_chain
from certs.csr import (
    MAX_CSR_BYTES,
    CsrContents,
    VerifiedCsr,
    build_csr,
    describe_csr,
    load_csr,
    load_verified_csr,
)
from certs.errors import (
    CertsError,
    ChainError,
    ChainOrderError,
    CsrError,
    ForeignCertificateError,
    KeyMaterialError,
    PemError,
    SpiffeIdError,
)
from certs.inspect import CertificateInfo, describe_certificate, format_duration
from certs.keys import (
    KeySpec,
    PrivateKey,
    PublicKey,
    generate_private_key,
    key_family,
    key_matches_certificate,
    load_private_key,
    private_key_to_pem,
    public_key_of,
)
from certs.leaf_template import LeafTemplate
from certs.pem import (
    cert_to_pem,
    certs_to_der,
    certs_to_pem,
    der_to_pem,
    load_cert,
    load_certs,
    load_der_certs,
)
from certs.profile import (
    CLOCK_SKEW_BACKDATE,
    build_intermediate_certificate,
    build_root_certificate,
    build_serving_certificate,
    build_workload_certificate,
    issuer_key_id,
    random_serial,
)
from certs.spiffe import DEFAULT_TRUST_DOMAIN, SpiffeId

__all__ = [
    "CLOCK_SKEW_BACKDATE",
    "DEFAULT_TRUST_DOMAIN",
    "MAX_CSR_BYTES",
    "CertificateInfo",
    "CertsError",
    "ChainError",
    "ChainOrderError",
    "CsrContents",
    "CsrError",
    "ForeignCertificateError",
    "KeyMaterialError",
    "KeySpec",
    "LeafTemplate",
    "PemError",
    "PrivateKey",
    "PublicKey",
    "SigningAuthority",
    "SpiffeId",
    "SpiffeIdError",
    "VerifiedCsr",
    "build_csr",
    "build_intermediate_certificate",
    "build_path",
    "build_root_certificate",
    "build_serving_certificate",
    "build_workload_certificate",
    "cert_to_pem",
    "certs_to_der",
    "certs_to_pem",
    "der_to_pem",
    "describe_certificate",
    "describe_csr",
    "format_duration",
    "generate_private_key",
    "is_ca",
    "issuer_key_id",
    "key_family",
    "key_matches_certificate",
    "load_cert",
    "load_certs",
    "load_csr",
    "load_der_certs",
    "load_private_key",
    "load_verified_csr",
    "make_authority",
    "new_self_signed_authority",
    "private_key_to_pem",
    "public_key_of",
    "random_serial",
    "self_signed_authority",
    "verify_chain",
]
