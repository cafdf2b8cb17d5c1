"""Engine fixtures: the tiny random checkpoints the engine tests serve."""
from __future__ import annotations

import pytest

from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    """The module's tiny random Llama checkpoint, as the path string engine flags take."""
    return str(tiny_llama_dir)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    """A tiny random checkpoint of each family (Llama, Qwen2); a module's tests run per family."""
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
