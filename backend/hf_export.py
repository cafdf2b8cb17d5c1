"""A GGUF model written out as a Hugging Face directory, for engines that cannot read GGUF.

vLLM's CPU build (and transformers without `accelerate`) loads a model directory, not a .gguf
file. This writes one from the same reader the bundled engine loads from, so both engines run
identical weights and tokenize identically:

    config.json              the shape (`gguf_weights.config_from_gguf`) + `architectures`
    model.safetensors        every tensor dequantized (fp32, or --dtype), Hugging Face names,
                             Llama's Q/K rows in Hugging Face's order
    tokenizer.json           the GGUF's vocabulary rebuilt by `common.gguf_tokenizer`, with
                             llama.cpp's pre-tokenizer (transformers' own GGUF converter drops
                             SmolLM2's digit split, so its ids differ from llama.cpp's)
    tokenizer_config.json    special tokens and the chat template
    generation_config.json   bos/eos ids, including end-of-turn ids

Nothing is written where the directory already has a config.json, unless `overwrite`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from prefixgate.backend import gguf_weights
from prefixgate.backend.checkpoint_files import SINGLE_NAME, WeightError
from prefixgate.common.gguf_file import GGUFError, open_gguf
from prefixgate.common.gguf_tokenizer import read_tokenizer

log = logging.getLogger("prefixgate.engine")

ARCHITECTURE_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_hf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32",
              overwrite: bool = False) -> Path:
    """Write `gguf_path` as a Hugging Face model directory at `out_dir`; returns `out_dir`."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if (out_dir / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already holds a model (config.json)")
    try:
        reader = open_gguf(gguf_path)
        config = gguf_weights.config_from_gguf(reader)
        found = read_tokenizer(reader)
    except GGUFError as e:
        raise WeightError(str(e)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_weights(reader, config, out_dir / SINGLE_NAME, DTYPES[dtype])
    found.tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **found.special_tokens,
        "chat_template": found.chat_template,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    })
    eos = [config.eos_token_id, *found.extra_eos_ids] if config.eos_token_id is not None else []
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1
                 else eos})
    _write_json(out_dir / "config.json", _config_json(config, dtype))
    log.info("exported %s to %s (%s)", gguf_path, out_dir, dtype)
    return out_dir


def _write_weights(reader, config, path: Path, dtype: torch.dtype) -> None:
    state = {}
    for gguf_name, name, tensor in gguf_weights.read_tensors(reader, config):
        if name == gguf_weights.ROPE_FREQS:
            # Hugging Face's config would need rope_scaling spelt out to reproduce these
            raise WeightError(f"{gguf_name}: per-dimension rope factors cannot be exported")
        state[name] = tensor.to(dtype).contiguous()
    save_file(state, str(path), metadata={"format": "pt"})


def _config_json(config, dtype: str) -> dict:
    fields = {k: v for k, v in vars(config).items() if v is not None}
    return {"architectures": [ARCHITECTURE_CLASSES[config.model_type]], **fields,
            "torch_dtype": dtype, "hidden_act": "silu"}


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
