"""Session-scoped PKI fixtures: keys are generated once per run."""

from __future__ import annotations

import pytest

from tests.support.pki_views import Pki, make_pki


@pytest.fixture(scope="session")
def pki() -> Pki:
    return make_pki()


@pytest.fixture(scope="session")
def other_pki() -> Pki:
    """An unrelated PKI with the same subject names but different keys."""
    return make_pki()
