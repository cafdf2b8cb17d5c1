"""A benchmark's `--model`: a built-in name, a .gguf file or a directory; its vocabulary size,
which the benchmarks draw random prompt tokens from."""
from __future__ import annotations

from prefixgate.backend.config import resolve_model
from prefixgate.common.tokenizer import Tokenizer

MODEL_HELP = "demo (default), smollm2, a .gguf file or a Hugging Face directory"


def vocab_size(model: str) -> int:
    return Tokenizer.load(resolve_model(model)).vocab_size
