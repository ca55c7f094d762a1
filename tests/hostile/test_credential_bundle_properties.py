"""Property-based tests of the kubelet credential bundle parser (`agent.credential_bundle`): the
file comes from the node, so whatever it holds the agent answers with `FileSecretError` or a
bundle, never another exception (a reload that raised something else would not be counted as a
refusal), and never echoes the file's text.

Inputs: arbitrary bytes; the kubelet's layout with bytes flipped inside the key's or the
certificate's DER (re-armoured, so the PEM layer passes and the DER parsers are reached); and
the real blocks shuffled, dropped and repeated. Then the whole loader
(`agent.file_mounted.load_credential_bundle_secret`: acceptance, the chain against the projected
roots) on mutated leaves, intermediates and roots: `FileSecretError` or the secret. Bounded and
derandomized by tests/hostile/test_properties.py's settings (`MESHCA_HYPOTHESIS_EXAMPLES` searches
longer).
"""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agent.credential_bundle import CredentialBundle, parse_credential_bundle
from agent.errors import FileSecretError
from agent.file_mounted import load_credential_bundle_secret
from certs import generate_private_key, private_key_to_pem
from tests.hostile.test_properties import BOUNDED, _mutated_der
from tests.support.pki import TestCa

_CA = TestCa()
_ISSUED = _CA.child_ca().issue("app")
KEY_PEM = _ISSUED.key_pem
CHAIN_PEMS = [
    "-----BEGIN CERTIFICATE-----" + block
    for block in _ISSUED.cert_pem.split("-----BEGIN CERTIFICATE-----")[1:]
]
BLOCKS = [KEY_PEM, *CHAIN_PEMS, private_key_to_pem(generate_private_key()).decode()]


def check(data: bytes) -> CredentialBundle | None:
    try:
        return parse_credential_bundle(data, source="/fuzzed/bundle.pem")
    except FileSecretError as exc:
        message = str(exc)
        assert "-----BEGIN" not in message and "MII" not in message, message
        return None


def _mutated(pem: str, label: str) -> st.SearchStrategy[str]:
    """`pem` with 1-3 bytes of its DER replaced, re-armoured under `label` (as text)."""
    return _mutated_der(pem, label).map(bytes.decode)


@BOUNDED
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_are_parsed_or_refused(data: bytes) -> None:
    check(data)


@BOUNDED
@given(_mutated(KEY_PEM, "PRIVATE KEY"))
def test_a_mutated_key_is_parsed_or_refused(key: str) -> None:
    check((key + _ISSUED.cert_pem).encode())


@BOUNDED
@given(_mutated(CHAIN_PEMS[0], "CERTIFICATE"))
def test_a_mutated_leaf_is_parsed_or_refused(leaf: str) -> None:
    check((KEY_PEM + leaf + "".join(CHAIN_PEMS[1:])).encode())


@BOUNDED
@given(st.lists(st.sampled_from(range(len(BLOCKS))), max_size=6))
def test_any_arrangement_of_real_blocks_is_parsed_only_in_the_kubelets_order(
    order: list[int],
) -> None:
    keys = {0, len(BLOCKS) - 1}
    bundle = check("".join(BLOCKS[i] for i in order).encode())
    kubelets_order = len(order) > 1 and order[0] in keys and not any(i in keys for i in order[1:])
    assert (bundle is not None) == kubelets_order, order
    if bundle is not None:
        assert bundle.key_pem == BLOCKS[order[0]]
        assert len(bundle.chain) == len(order) - 1


def check_loaded(bundle: str, roots: str) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="cbp-") as directory:
        bundle_path, roots_path = Path(directory) / "bundle.pem", Path(directory) / "roots.pem"
        bundle_path.write_text(bundle)
        roots_path.write_text(roots)
        try:
            load_credential_bundle_secret("default", bundle_path, roots_path, now=datetime.now(UTC))
        except FileSecretError as exc:
            assert "-----BEGIN" not in str(exc) and "MII" not in str(exc), exc


@BOUNDED
@given(_mutated(CHAIN_PEMS[0], "CERTIFICATE"))
def test_the_loader_on_a_mutated_leaf(leaf: str) -> None:
    check_loaded(KEY_PEM + leaf + "".join(CHAIN_PEMS[1:]), _CA.root_pem)


@BOUNDED
@given(_mutated(CHAIN_PEMS[1], "CERTIFICATE"))
def test_the_loader_on_a_mutated_intermediate(intermediate: str) -> None:
    check_loaded(KEY_PEM + CHAIN_PEMS[0] + intermediate, _CA.root_pem)


@BOUNDED
@given(_mutated(_CA.root_pem, "CERTIFICATE"))
def test_the_loader_on_a_mutated_root(root: str) -> None:
    check_loaded(_ISSUED.credential_bundle, root)
