"""GGUF files made from a Hugging Face checkpoint by llama.cpp's conversion rules, and damaged
copies of them for the error tests.

`write_gguf(hf_dir, out_path, ggml_type)` writes what llama.cpp's `convert_hf_to_gguf.py` writes
for a Llama, Mistral or Qwen2 checkpoint whose tokenizer is a byte-level BPE `tokenizer.json`
(the tiny ones `tests.helpers.make_tiny_model` saves), through llama.cpp's own Python package:
`GGUFWriter` for the format, `TensorNameMap` for the tensor names, `SpecialVocab` for merges,
special token ids and the chat template, `gguf.quants` for the quantized data. The converter's
rules that live in its model classes are restated here: which config keys become which metadata
keys, Llama's interleaved Q/K rows, which tensors stay F32, the token list and token types.
"""
from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import gguf
import numpy as np
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType
from safetensors import safe_open

Q = GGMLQuantizationType
# The Hugging Face classes llama.cpp converts as each architecture (Mistral is a Llama there).
_ARCHES = {
    "LlamaForCausalLM": MODEL_ARCH.LLAMA,
    "MistralForCausalLM": MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": MODEL_ARCH.QWEN2,
}
# llama.cpp's RoPE rotates neighbouring pairs of a head's dimensions, Hugging Face's the two
# halves, so the converter interleaves the rows of Llama's Q and K; Qwen2 is written as is.
_PERMUTED = {MODEL_ARCH.LLAMA}


def write_gguf(hf_dir: str | Path, out_path: str | Path, ggml_type: Q = Q.F16, *,
               tokenizer_pre: str = "qwen2", architecture: str | None = None,
               drop: Collection[str] = (), retype: Mapping[str, Q] | None = None) -> Path:
    """Convert the checkpoint in `hf_dir` into the GGUF file `out_path`, 2-D weights in
    `ggml_type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1).

    `tokenizer_pre` is llama.cpp's name for the tokenizer's pre-tokenizer split; the converter
    finds it from a hash of the tokenizer's output, known only for published tokenizers, so
    it is given here (the tiny and demo tokenizers split as Qwen2's does).
    For damaged files: `architecture` writes the same model under another architecture name,
    `drop` leaves out the named tensors (llama.cpp names), and `retype` declares the named
    tensors to be of another type, with zeroed data of that type's size.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    hparams = _hparams(hf_dir)
    arch = _ARCHES[hparams["architectures"][0]]
    writer = GGUFWriter(out_path, architecture or gguf.MODEL_ARCH_NAMES[arch])
    for name, data in _tensors(hf_dir, arch, hparams):
        if name not in drop:
            _add_tensor(writer, name, data, (retype or {}).get(name), ggml_type)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(hf_dir.name)
    _add_parameters(writer, arch, hparams, ggml_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(writer, hf_dir, hparams, tokenizer_pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _hparams(hf_dir: Path) -> dict:
    """The config as the converter reads it: transformers' config, every default filled in."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_dir).to_dict()


# --- metadata ----------------------------------------------------------------------------------

def _add_parameters(writer: GGUFWriter, arch: MODEL_ARCH, hp: dict, ggml_type: Q) -> None:
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope['rope_type']!r} is not written here")
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    # written whenever the config names head_dim, even where it is hidden / heads
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    writer.add_file_type(_file_type(ggml_type))
    if arch == MODEL_ARCH.LLAMA:    # only the converter's Llama class writes these two
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(
            hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def _file_type(ggml_type: Q) -> gguf.LlamaFileType:
    if ggml_type == Q.F32:
        return gguf.LlamaFileType.ALL_F32
    return gguf.LlamaFileType[f"MOSTLY_{ggml_type.name}"]


def _add_vocab(writer: GGUFWriter, hf_dir: Path, hp: dict, tokenizer_pre: str) -> None:
    """llama.cpp's "gpt2" tokenizer: every id's token (byte-level text) and type, the merges,
    special token ids, add_bos/add_eos where the tokenizer says, and the chat template."""
    tokens, types = _token_list(hf_dir, hp["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def _token_list(hf_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """One entry per row of the embedding: ids the tokenizer lacks are UNUSED `[PADn]`, added
    tokens marked special (or looking like `<|...|>`) CONTROL, other added ones USER_DEFINED."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        if i in added and not added[i].normalized:
            # llama.cpp expects added tokens in their normalized form
            token = tok.decode(tok.encode(token, add_special_tokens=False))
        if i not in added:
            types.append(TokenType.NORMAL)
        elif added[i].special or (token.startswith("<|") and token.endswith("|>")):
            types.append(TokenType.CONTROL)
        else:
            types.append(TokenType.USER_DEFINED)
        tokens.append(token)
    return tokens, types


# --- tensors -----------------------------------------------------------------------------------

def _tensors(hf_dir: Path, arch: MODEL_ARCH, hp: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(llama.cpp name, fp32 array) for every tensor of every shard, Q/K rows interleaved where
    the architecture wants them."""
    names = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    heads, kv_heads = hp["num_attention_heads"], hp["num_key_value_heads"]
    for shard in sorted(hf_dir.glob("model*.safetensors")):
        with safe_open(shard, framework="np") as f:
            for hf_name in f.keys():
                name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ValueError(f"{shard.name}: no llama.cpp name for tensor {hf_name}")
                data = f.get_tensor(hf_name).astype(np.float32)
                if arch in _PERMUTED and ".q_proj." in hf_name:
                    data = _interleave_rope_rows(data, heads)
                elif arch in _PERMUTED and ".k_proj." in hf_name:
                    data = _interleave_rope_rows(data, kv_heads)
                yield name, data


def _interleave_rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Within each head, row pairs (i, i + half) become neighbours (2i, 2i + 1)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _add_tensor(writer: GGUFWriter, name: str, data: np.ndarray, declared: Q | None,
                ggml_type: Q) -> None:
    if declared is not None:
        zeros = np.zeros(gguf.quant_shape_to_byte_shape(data.shape, declared), np.uint8)
        writer.add_tensor(name, zeros, raw_dtype=declared)
        return
    qtype = _tensor_type(name, data, ggml_type)
    try:
        packed = gguf.quants.quantize(data, qtype)
    except gguf.QuantError:    # rows that are not whole blocks: the converter falls back
        qtype = Q.F16
        packed = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, packed, raw_dtype=qtype)


def _tensor_type(name: str, data: np.ndarray, ggml_type: Q) -> Q:
    """Vectors, norms and anything but a weight (biases) stay F32, as llama.cpp's kernels want."""
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32
    return ggml_type


# --- damage ------------------------------------------------------------------------------------

def tensor_offset(path: str | Path, name: str) -> int:
    """Where tensor `name`'s data starts in the file, in bytes."""
    return next(int(t.data_offset) for t in GGUFReader(path).tensors if t.name == name)


def last_tensor(path: str | Path) -> str:
    """The name of the tensor whose data ends the file."""
    return max(GGUFReader(path).tensors, key=lambda t: int(t.data_offset)).name


def truncate(path: str | Path, size: int) -> None:
    """Cut the file to its first `size` bytes, as an interrupted download leaves it."""
    os.truncate(path, size)


def overwrite(path: str | Path, offset: int, data: bytes) -> None:
    """Replace the bytes at `offset` with `data`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
