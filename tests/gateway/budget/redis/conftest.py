"""Fixtures of the Redis budget's tests."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:8]}"
