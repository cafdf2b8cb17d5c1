"""A GGUF file (llama.cpp's format) as the engine's model: config and weights.

GGUF keeps everything in one file: the model's shape in metadata keys (`llama.block_count`,
...), the tokenizer (see `common/gguf_tokenizer.py`) and the tensors, under llama.cpp's names and
usually quantized. This module turns those into what the safetensors path gives the loader:
a `LlamaConfig`, and Hugging Face-named tensors in fp32, dequantized by llama.cpp's own Python
package (`gguf.quants`). llama.cpp's converter permutes the rows of Llama's Q and K projections
(its RoPE pairs neighbouring dimensions, Hugging Face's pairs the two halves); that is undone
here, so the model code stays one. The loader (`backend/loader.py`) checks and assigns them.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from prefixgate.backend.models import LlamaConfig
from prefixgate.common.gguf_file import field
from prefixgate.common.schema import ConfigError

SUFFIX = ".gguf"
ARCHITECTURES = ("llama", "qwen2")
_Q = GGMLQuantizationType
SUPPORTED_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
                   _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)
# Llama 3.1's long-context RoPE, stored as per-frequency divisors rather than as config keys.
ROPE_FREQS = "rope_freqs.weight"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix.lower() == SUFFIX and not path.is_dir()


# --- config ----------------------------------------------------------------------------------


def config_from_gguf(reader: GGUFReader) -> LlamaConfig:
    """The model's shape from the metadata; ConfigError names the metadata key at fault."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError("general.architecture", f"{arch!r} is not supported "
                                                  f"(supported: {', '.join(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}

    def meta(key, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"{arch}.{key}", "missing from the GGUF metadata")
        if isinstance(value, list):    # per-layer values (OpenELM-style): not this engine's
            raise ConfigError(f"{arch}.{key}", "per-layer values are not supported")
        return value

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ConfigError(f"{arch}.rope.dimension_count", "partial rotary embeddings are not "
                                                          "supported")
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError(f"{arch}.rope.scaling.type", f"{scaling!r} is not supported")
    return LlamaConfig.from_dict({
        "model_type": arch,
        "vocab_size": int(meta("vocab_size", _vocab_size(reader))),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id", None),
    })


def _vocab_size(reader: GGUFReader) -> int | None:
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    return int(embedding.shape[-1]) if embedding is not None else None


# --- tensors ---------------------------------------------------------------------------------


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter a llama.cpp tensor name stands for (None: no such one)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def tensor_problems(reader: GGUFReader, expected: dict[str, tuple]) -> list[str]:
    """Unsupported types, unknown or missing tensors, and shapes that contradict the metadata."""
    problems, found = [], set()
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    for t in reader.tensors:
        name = hf_name(t.name)
        if t.tensor_type not in SUPPORTED_TYPES:
            problems.append(f"tensor {t.name} has type {t.tensor_type.name}, which is not "
                            f"supported (supported: {supported})")
        if t.name == ROPE_FREQS:
            continue
        if name not in expected:
            problems.append(f"unexpected tensor {t.name}")
            continue
        found.add(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != expected[name]:
            problems.append(f"shape mismatch for {t.name}: file {list(shape)}, metadata implies "
                            f"{list(expected[name])}")
    problems += [f"missing tensor {_gguf_name(n)} ({n})" for n in expected if n not in found]
    return problems


def _gguf_name(hf: str) -> str:
    inverse = {v: k for k, v in _GLOBAL_NAMES.items()}
    if hf in inverse:
        return inverse[hf]
    layer, _, rest = hf.removeprefix("model.layers.").partition(".")
    return f"blk.{layer}." + {v: k for k, v in _LAYER_NAMES.items()}[rest]


def read_tensors(reader: GGUFReader,
                 config: LlamaConfig) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(llama.cpp name, Hugging Face name or ROPE_FREQS, fp32 tensor) for every tensor,
    dequantized, with Llama's Q/K rows back in Hugging Face's order."""
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
        if not values.flags.writeable:     # an F32 tensor is a view of the read-only mapping
            values = values.copy()
        name = hf_name(t.name) or t.name
        if config.model_type == "llama" and ".self_attn.q_proj." in name:
            values = _unpermute(values, config.num_attention_heads)
        elif config.model_type == "llama" and ".self_attn.k_proj." in name:
            values = _unpermute(values, config.num_key_value_heads)
        yield t.name, name, torch.from_numpy(values)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's two rotary halves."""
    pair = rows.shape[0] // heads // 2
    return (rows.reshape(heads, pair, 2, *rows.shape[1:]).swapaxes(1, 2)
            .reshape(rows.shape).copy())
