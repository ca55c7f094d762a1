"""Bad input gets the right status, issues nothing, and the CA keeps serving (issue #2, item 3).

The decisions themselves are tested in-process, case by case (`test_service_decisions.py`).
Here one case per refusal family goes to a running CA through real gRPC and TLS, then checks the
issued counter did not move, no issuance was audited and a valid request still succeeds.
"""

from __future__ import annotations

import grpc
import pytest

from tests.ca_server.refusal_cases import CASES, Case, good_csr, good_token
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value
from tests.support.token_issuer import RsaIssuer

SMOKE = [
    next(case for case in CASES if case.family == family)
    for family in ("authn", "authz", "csr", "impersonation")
]


def _issued(ca: CaProcess) -> float:
    return sample_value(ca.metrics(), "meshca_ca_certificates_issued_total")


@pytest.mark.parametrize("case", SMOKE, ids=[c.name for c in SMOKE])
def test_refused_with_the_right_status_and_nothing_issued(
    ca: CaProcess, root_pem: bytes, rsa_issuer: RsaIssuer, case: Case
):
    issued_before = _issued(ca)
    audit_before = ca.log().count('"outcome": "issued"')
    with ca_stub(ca.addr, root_pem) as stub:
        with pytest.raises(grpc.RpcError) as refused:
            create_certificate(
                stub, case.csr(), token=case.token(rsa_issuer), metadata=case.metadata
            )
        assert refused.value.code() == case.code, refused.value.details()
        assert case.message in (refused.value.details() or "")
        assert _issued(ca) == issued_before
        assert ca.log().count('"outcome": "issued"') == audit_before
        # ... and the CA keeps serving valid requests.
        chain = create_certificate(stub, good_csr(), token=good_token(rsa_issuer))
        assert len(chain) == 2
    assert _issued(ca) == issued_before + 1
