"""transformers' own model on the weights a `--model` names, for the benchmarks that compare
the engine against it: a Hugging Face directory, or a GGUF file (transformers dequantizes it
with the same `gguf` package the engine loads it with)."""
from __future__ import annotations

from pathlib import Path

from prefixgate.backend.gguf_weights import is_gguf


def load_transformers(path: str | Path, dtype):
    """`AutoModelForCausalLM` in eval mode on `path` (what `resolve_model` gave), in `dtype`."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if is_gguf(path):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()
