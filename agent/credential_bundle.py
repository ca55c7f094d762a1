"""The kubelet's `podCertificate` credential bundle, parsed strictly: one key, then the chain.

Kubernetes' Pod Certificates (`certificates.k8s.io/v1` PodCertificateRequest) need no agent to
ask a CA: the kubelet generates the pod's key, a signer (meshca's CA, `--pod-certificate-signer`)
issues the chain, and the kubelet writes both into the pod through a `podCertificate` projected
volume. With `credentialBundlePath` that is ONE file, in an order the kubelet always keeps:

    -----BEGIN PRIVATE KEY-----        the pod's key, PKCS#8, unencrypted
    -----BEGIN CERTIFICATE-----        the leaf (the pod's SPIFFE ID as its URI SAN)
    -----BEGIN CERTIFICATE-----        intermediates, in order, if the signer has any

Anything else is not what the kubelet wrote, so it is refused rather than guessed at: a key in
another encoding (SEC1 `EC PRIVATE KEY`, PKCS#1 `RSA PRIVATE KEY`, an encrypted one), a second
key, a key after the certificates, no certificate, another kind of block, text between blocks,
non-ASCII bytes. Whether the chain may be served (validity window, key matches the leaf, the
chain verifies to the trust bundle) is the one rule every source shares, `agent.acceptance`,
applied by the loader (`agent.file_mounted.load_credential_bundle_secret`).

Pure: bytes in, a `CredentialBundle` out or `FileSecretError` naming the check that failed and
the file; never key material (not even the text of a block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cryptography import x509

from agent.errors import FileSecretError
from certs import CertsError, PrivateKey, load_certs, load_private_key

# A PodCertificateRequest's chain is at most 100 KiB (API server validation); an RSA-4096
# PKCS#8 key is ~3.3 KiB. Anything much larger is not a kubelet's bundle.
MAX_CREDENTIAL_BUNDLE_BYTES = 128 * 1024

KEY_LABEL = "PRIVATE KEY"  # PKCS#8 (RFC 7468 section 10)
CERTIFICATE_LABEL = "CERTIFICATE"
# The kubelet's `keyType`s whose keys Envoy can serve (Ed25519 it cannot), for error messages.
SERVABLE_KEY_TYPES = "ECDSAP256, ECDSAP384, ECDSAP521, RSA3072 or RSA4096"

# RFC 7468's encapsulation boundaries; labels are printable ASCII without '-', bounded so a
# hostile file cannot make the scan quadratic.
_BLOCK = re.compile(
    r"-----BEGIN (?P<label>[\x21-\x2c\x2e-\x7e][\x20-\x2c\x2e-\x7e]{0,63})-----"
    r"(?P<body>[A-Za-z0-9+/=\s]*)"
    r"-----END (?P<end>[\x20-\x2c\x2e-\x7e]{1,64})-----"
)


@dataclass(frozen=True)
class CredentialBundle:
    """A parsed bundle: the key and the chain (leaf first), each also as its PEM text."""

    key: PrivateKey = field(repr=False)
    key_pem: str = field(repr=False)
    chain: tuple[x509.Certificate, ...]
    chain_pem: str

    @property
    def leaf(self) -> x509.Certificate:
        return self.chain[0]


@dataclass(frozen=True)
class _Block:
    label: str
    text: str = field(repr=False)  # the whole block, BEGIN to END line


def _blocks(text: str, source: str) -> list[_Block]:
    """The PEM blocks of `text`, in order; only whitespace may lie between them."""
    blocks: list[_Block] = []
    position = 0
    for match in _BLOCK.finditer(text):
        if text[position : match.start()].strip() or match["label"] != match["end"]:
            raise FileSecretError(
                f"credential bundle {source}: not a sequence of PEM blocks (stray text, or a "
                f"block that does not end as it began, before block {len(blocks) + 1})"
            )
        blocks.append(_Block(match["label"], match.group(0) + "\n"))
        position = match.end()
    if text[position:].strip():
        raise FileSecretError(
            f"credential bundle {source}: not a sequence of PEM blocks (stray text or an "
            f"unterminated block after block {len(blocks)})"
        )
    return blocks


def _check_layout(blocks: list[_Block], source: str) -> None:
    """One PKCS#8 key, first; then at least one certificate; nothing else."""
    what = f"credential bundle {source}"
    expected = "the kubelet writes the PKCS#8 PRIVATE KEY block first, then the certificate chain"
    if not blocks:
        raise FileSecretError(f"{what}: no PEM blocks; {expected}")
    keys = [index for index, block in enumerate(blocks) if block.label.endswith(KEY_LABEL)]
    if len(keys) > 1:
        raise FileSecretError(f"{what}: {len(keys)} private keys (exactly one expected)")
    if not keys:
        raise FileSecretError(f"{what}: no private key; {expected}")
    if keys[0] != 0:
        raise FileSecretError(
            f"{what}: blocks in the wrong order (the private key is block {keys[0] + 1}); "
            f"{expected}"
        )
    label = blocks[0].label
    if label != KEY_LABEL:
        raise FileSecretError(
            f"{what}: the private key is a {label!r} block, not PKCS#8 ({KEY_LABEL!r}, "
            "unencrypted), the only form the kubelet writes"
        )
    for number, block in enumerate(blocks[1:], start=2):
        if block.label != CERTIFICATE_LABEL:
            raise FileSecretError(
                f"{what}: block {number} is a {block.label!r} block; only CERTIFICATE blocks "
                "may follow the key"
            )
    if len(blocks) == 1:
        raise FileSecretError(f"{what}: a private key but no certificate chain after it")


def parse_credential_bundle(data: bytes, *, source: str) -> CredentialBundle:
    """Parses the bytes of a `podCertificate` credential bundle read from `source` (a path,
    for messages). Raises `FileSecretError` saying what is wrong (module docstring)."""
    if len(data) > MAX_CREDENTIAL_BUNDLE_BYTES:
        raise FileSecretError(
            f"credential bundle {source}: {len(data)} bytes, over the limit of "
            f"{MAX_CREDENTIAL_BUNDLE_BYTES} (a kubelet's bundle is far smaller)"
        )
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise FileSecretError(
            f"credential bundle {source} is not a PEM text file (it has non-ASCII bytes)"
        ) from None
    blocks = _blocks(text, source)
    _check_layout(blocks, source)
    try:
        key = load_private_key(blocks[0].text)
    except CertsError as exc:
        raise FileSecretError(_key_problem(source, str(exc))) from None
    chain_pem = "".join(block.text for block in blocks[1:])
    try:
        chain = load_certs(chain_pem, what=f"certificate chain in credential bundle {source}")
    except CertsError as exc:
        raise FileSecretError(str(exc)) from None
    return CredentialBundle(key, blocks[0].text, tuple(chain), chain_pem)


def _key_problem(source: str, problem: str) -> str:
    if problem.startswith("unsupported"):  # e.g. Ed25519, which the PCR API allows
        return (
            f"credential bundle {source}: {problem}; Envoy serves ECDSA and RSA keys only: set "
            f"the podCertificate volume's keyType to {SERVABLE_KEY_TYPES}"
        )
    return f"credential bundle {source}: the PRIVATE KEY block does not parse as PKCS#8"
