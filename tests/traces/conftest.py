"""Shared fixtures of the traces tests."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_TRACES = REPO.parent / "shared" / "traces"


@pytest.fixture
def shared_traces() -> Path:
    """The raw public traces beside the checkout (../shared/traces); skip when absent."""
    if not SHARED_TRACES.is_dir():
        pytest.skip("../shared/traces is not present")
    return SHARED_TRACES
