"""Tiny random Hugging Face checkpoints made on the fly, so tests never touch a hub.

`make_tiny_model(dir, kind)` saves a LlamaForCausalLM or Qwen2ForCausalLM built by transformers
(safetensors weights, config.json) plus a byte-level BPE tokenizer and a ChatML chat template;
both our engine and transformers load the same directory. `PagedCache` drives our model over a
paged KV cache directly (no engine), for tests that compare it with transformers.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from prefixgate.backend.attention import AttentionMetadata
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


class PagedCache:
    """Minimal stand-in for the engine's KV cache bookkeeping, enough to drive the model."""

    def __init__(self, config, num_blocks=96, block_size=4, dtype=torch.float32, device="cpu", seed=0):
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(config.num_hidden_layers)]
        self.block_size, self.device = block_size, device
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slot(self, sid: int, pos: int) -> int:
        table = self.tables.setdefault(sid, [])
        if pos // self.block_size >= len(table):
            table.append(self.free.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.no_grad()
    def step(self, model, batch: dict[int, list[int]], backend=None) -> dict[int, torch.Tensor]:
        """Run one forward over the new tokens of every sequence in `batch`; logits per sequence."""
        ids, positions, slots, starts = [], [], [], [0]
        for sid, tokens in batch.items():
            start = self.lens.get(sid, 0)
            for i, tok in enumerate(tokens):
                ids.append(tok)
                positions.append(start + i)
                slots.append(self._slot(sid, start + i))
            self.lens[sid] = start + len(tokens)
            starts.append(starts[-1] + len(tokens))
        width = max(len(self.tables[s]) for s in batch)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in batch]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([self.lens[s] for s in batch], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_seq_len=max(self.lens[s] for s in batch),
            is_decode=all(len(t) == 1 for t in batch.values()),
            attention_backend=backend,
        )
        hidden = model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta, self.kv)
        logits = model.compute_logits(hidden)
        return {sid: logits[starts[i]:starts[i + 1]] for i, sid in enumerate(batch)}
