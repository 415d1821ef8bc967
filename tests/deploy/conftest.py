"""Fixtures of the deployment tests."""

from __future__ import annotations

import os

import pytest

# The live-metrics test runs a real engine and a real gateway.
from tests.engine_adapter.conftest import make_engine  # noqa: F401
from tests.gateway.conftest import make_gateway  # noqa: F401


@pytest.fixture
def clean_mmgate_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MMGATE_* variable from the developer's shell leaks into a settings load."""
    for name in list(os.environ):
        if name.startswith("MMGATE_"):
            monkeypatch.delenv(name)
    return monkeypatch
