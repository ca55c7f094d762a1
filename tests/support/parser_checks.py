"""The property the fuzzers and the property tests share, written once: whatever the input, the
CA's CSR path answers with its own typed refusal (or accepts), never another exception."""

from __future__ import annotations

import contextlib

from ca_server.authz import authorize_csr
from ca_server.errors import RequestError
from certs import CertsError, load_csr
from tests.support.inprocess_ca import SLEEP


def check_csr(data: bytes | str) -> None:
    """`load_csr` then `authorize_csr`; only `CertsError`/`RequestError` may be raised (and
    are swallowed): anything else escapes and fails the caller."""
    try:
        csr = load_csr(data)
    except CertsError:
        return
    with contextlib.suppress(RequestError):
        authorize_csr(csr, SLEEP)
