"""Fixtures of the deployment tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_mmgate_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MMGATE_* variable from the developer's shell leaks into a settings load."""
    for name in list(os.environ):
        if name.startswith("MMGATE_"):
            monkeypatch.delenv(name)
    return monkeypatch
