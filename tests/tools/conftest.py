"""Tool fixtures: the checkpoint an engine benchmark loads."""
from __future__ import annotations

import pytest

from tests.helpers import make_tiny_model


@pytest.fixture
def model(tmp_path):
    """A tiny random Llama checkpoint in the test's own directory."""
    return make_tiny_model(tmp_path / "m", "llama")
