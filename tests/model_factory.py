"""Tiny random Hugging Face checkpoints made on the fly, so tests never touch a hub.

`make_tiny_model(dir, kind)` saves a LlamaForCausalLM or Qwen2ForCausalLM built by transformers
(safetensors weights, config.json) plus a byte-level BPE tokenizer and a ChatML chat template;
both our engine and transformers load the same directory.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from prefixgate.backend.demo import train_bpe_tokenizer, write_tokenizer_files

VOCAB_SIZE = 384

_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "A prefix cache keeps the keys and values of prompts that many requests share.",
    "Hello there! How are you today? I am fine, thank you, and you?",
    "Numbers like 1, 2, 3, 42 and 2024 appear in text; so do symbols: {} [] () <> # @.",
    "User asks a question and the assistant answers it clearly and briefly.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "Emoji can appear too: 🙂 🚀 ✨ and accents: café, naïve, über.",
]


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    return train_bpe_tokenizer(_TRAINING_TEXT * 4, VOCAB_SIZE).to_str()


def tiny_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tiny_tokenizer_json())


def _hf_config(kind: str, eos_id: int, overrides: dict):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind]
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        # Wider than HF's 0.02 so random logits are well separated and greedy picks are stable.
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_model(
    dir: str | Path, kind: str = "llama", seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """Build and save a tiny random model of `kind` ("llama", "qwen2" or "mistral") in `dir`.

    `max_shard_size` (e.g. "100KB") saves a sharded checkpoint with an index.
    `overrides` go to the transformers config (e.g. tie_word_embeddings=True, rope_scaling=...,
    num_hidden_layers=3); weights are saved in float32.
    """
    from transformers import AutoModelForCausalLM

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    config = _hf_config(kind, tok.token_to_id("<|im_end|>"), overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # HF initialises biases to zero, which would leave Qwen2's q/k/v bias path untested.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    write_tokenizer_files(out, tok, model_max_length=config.max_position_embeddings)
    return out
