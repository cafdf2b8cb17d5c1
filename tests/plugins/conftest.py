"""Plugin fixtures: the tokenizer directory the prompt plugins load."""
from __future__ import annotations

import pytest

from prefixgate.backend.demo import write_tokenizer_files
from tests.helpers import tiny_tokenizer


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """The tiny tokenizer with its default ChatML chat template, as a model directory has it."""
    d = tmp_path_factory.mktemp("chatml")
    write_tokenizer_files(d, tiny_tokenizer())
    return d
