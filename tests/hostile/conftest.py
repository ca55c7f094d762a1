"""Fixtures of the hostile-input suite: one in-process CA per module
(`tests/support/inprocess_ca.py`, whose `refused` is the one check every case ends with)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.inprocess_ca import InProcessCa


@pytest.fixture(scope="module")
def hostile_ca(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessCa]:
    with InProcessCa(Path(tmp_path_factory.mktemp("hostile_ca"))) as server:
        yield server
