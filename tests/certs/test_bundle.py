import hashlib

from cryptography.hazmat.primitives.serialization import Encoding

from certs.bundle import bundle_digest, root_fingerprint
from tests.support.pki import TestCa


def test_the_digest_is_sha256_over_the_sorted_der_fingerprints_ignoring_order_and_repeats():
    a, b = TestCa().root, TestCa().root
    fingerprints = sorted(hashlib.sha256(c.public_bytes(Encoding.DER)).digest() for c in (a, b))
    expected = hashlib.sha256(b"".join(fingerprints)).hexdigest()
    assert bundle_digest([a, b]) == bundle_digest([b, a, a]) == expected
    assert bundle_digest([a]) == hashlib.sha256(root_fingerprint(a)).hexdigest()
    assert bundle_digest([a]) != bundle_digest([a, b])
