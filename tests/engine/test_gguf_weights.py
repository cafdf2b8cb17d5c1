"""backend/gguf_weights.py on its own: the config read from a GGUF file's metadata (and the key
named when it cannot be), llama.cpp's tensor names mapped to Hugging Face's, the tensor checks
against the metadata, and the tensors read back dequantized with Llama's Q/K rows in Hugging
Face's order. The files are a few hundred bytes, written here with llama.cpp's `gguf` package.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quant_shape_to_byte_shape
from gguf.quants import quantize

from prefixgate.backend import gguf_weights
from prefixgate.backend.gguf_weights import (
    ROPE_FREQS,
    config_from_gguf,
    hf_name,
    is_gguf,
    read_tensors,
    tensor_problems,
)
from prefixgate.common.gguf_file import open_gguf
from prefixgate.common.schema import ConfigError
from tests.engine.gguf_writer import _interleave_rope_rows

# one block: hidden 8, two query heads sharing one KV head of 4 dimensions, 12 tokens
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 8, 2, 1, 4, 16, 12
META = {"context_length": 64, "embedding_length": HIDDEN, "feed_forward_length": FFN,
        "block_count": 1, "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
        "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 5e5}
# Hugging Face name -> shape (rows, columns), as the loader expects them
SHAPES = {
    "model.embed_tokens.weight": (VOCAB, HIDDEN),
    "model.norm.weight": (HIDDEN,),
    "model.layers.0.input_layernorm.weight": (HIDDEN,),
    "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
    "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
    "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
    "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN),
    "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
    "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
}
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random fp32 tensors of SHAPES, by Hugging Face name."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def write(path: Path, tensors: dict[str, np.ndarray | tuple[np.ndarray, Q]], arch: str = "llama",
          meta: dict | None = None) -> Path:
    """A GGUF file: `meta` under `<arch>.` (None values left out; typed by their Python type),
    bos/eos ids 1/2, and the tensors by llama.cpp name, fp32 arrays as F32 or (packed, type)."""
    writer = GGUFWriter(path, arch)
    for key, value in {**META, **(meta or {})}.items():
        if value is None:
            continue
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, data in tensors.items():
        if isinstance(data, tuple):
            writer.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def as_gguf(tensors: dict[str, np.ndarray], permute: bool = True) -> dict[str, np.ndarray]:
    """Hugging Face tensors as llama.cpp's converter writes a Llama: its names, Q/K rows
    interleaved (`permute`)."""
    out = {}
    for name, data in tensors.items():
        if permute and name.endswith("q_proj.weight"):
            data = _interleave_rope_rows(data, HEADS)
        elif permute and name.endswith("k_proj.weight"):
            data = _interleave_rope_rows(data, KV_HEADS)
        out[GGUF_NAMES[name]] = data
    return out


@pytest.fixture
def llama_file(tmp_path) -> Path:
    return write(tmp_path / "tiny.gguf", as_gguf(hf_tensors()))


def test_is_gguf_goes_by_the_suffix_and_refuses_directories(tmp_path):
    (tmp_path / "model.GGUF").write_bytes(b"")
    (tmp_path / "dir.gguf").mkdir()
    assert is_gguf(tmp_path / "model.GGUF") and is_gguf("not/there/yet.gguf")
    assert not is_gguf(tmp_path / "dir.gguf")
    assert not is_gguf(tmp_path / "model.safetensors")


def test_hf_names_of_llama_cpp_tensors():
    for hf, gguf_name in GGUF_NAMES.items():
        assert hf_name(gguf_name) == hf
    assert hf_name("blk.17.attn_k.bias") == "model.layers.17.self_attn.k_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight"
    for unknown in ("blk.0.attn_qkv.weight", "blk.x.attn_q.weight", ROPE_FREQS, "token_embd"):
        assert hf_name(unknown) is None


def test_config_from_the_metadata(llama_file):
    config = config_from_gguf(open_gguf(llama_file))
    assert (config.model_type, config.hidden_size, config.intermediate_size,
            config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.max_position_embeddings) == (
        "llama", HIDDEN, FFN, 1, HEADS, KV_HEADS, HEAD_DIM, 64)
    assert config.rope_theta == 5e5 and config.rms_norm_eps == pytest.approx(1e-5)
    assert config.vocab_size == VOCAB           # no vocab_size key: the embedding's rows
    assert config.tie_word_embeddings            # no output.weight
    assert not config.attention_bias             # no blk.0.attn_q.bias
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_config_defaults_and_what_the_tensors_say(tmp_path):
    tensors = as_gguf(hf_tensors())
    tensors["output.weight"] = np.zeros((VOCAB, HIDDEN), np.float32)
    for proj, rows in (("q", HEADS * HEAD_DIM), ("k", HEAD_DIM), ("v", HEAD_DIM)):
        tensors[f"blk.0.attn_{proj}.bias"] = np.zeros(rows, np.float32)
    path = write(tmp_path / "q.gguf", tensors, arch="qwen2",
                 meta={"attention.head_count_kv": None, "rope.freq_base": None,
                       "vocab_size": 32})
    config = config_from_gguf(open_gguf(path))
    assert config.model_type == "qwen2"
    assert config.num_key_value_heads == HEADS   # no head_count_kv: as many as query heads
    assert config.rope_theta == 10000.0
    assert config.vocab_size == 32               # the key wins over the embedding
    assert not config.tie_word_embeddings and config.attention_bias


@pytest.mark.parametrize("arch,meta,key,reason", [
    ("gpt2", {}, "general.architecture", "'gpt2' is not supported (supported: llama, qwen2)"),
    ("llama", {"feed_forward_length": None}, "llama.feed_forward_length",
     "missing from the GGUF metadata"),
    ("qwen2", {"attention.layer_norm_rms_epsilon": None},
     "qwen2.attention.layer_norm_rms_epsilon", "missing from the GGUF metadata"),
    ("llama", {"feed_forward_length": [16, 32]}, "llama.feed_forward_length",
     "per-layer values are not supported"),
    ("llama", {"rope.dimension_count": 2}, "llama.rope.dimension_count",
     "partial rotary embeddings are not supported"),
    ("llama", {"rope.scaling.type": "yarn"}, "llama.rope.scaling.type",
     "'yarn' is not supported"),
])
def test_config_errors_name_the_metadata_key(arch, meta, key, reason, tmp_path):
    path = write(tmp_path / "bad.gguf", as_gguf(hf_tensors()), arch=arch, meta=meta)
    with pytest.raises(ConfigError) as e:
        config_from_gguf(open_gguf(path))
    assert (e.value.path, e.value.reason) == (key, reason)


def test_a_good_file_has_no_tensor_problems(llama_file):
    assert tensor_problems(open_gguf(llama_file), SHAPES) == []


def test_tensor_problems_name_each_fault(tmp_path):
    tensors = as_gguf(hf_tensors())
    del tensors["blk.0.ffn_up.weight"]
    tensors["blk.0.ffn_gate.weight"] = np.zeros((FFN, HIDDEN + 1), np.float32)
    tensors["blk.0.attn_qkv.weight"] = np.zeros((3, HIDDEN), np.float32)
    tensors[ROPE_FREQS] = np.ones(HEAD_DIM // 2, np.float32)      # known: not a problem
    byte_shape = quant_shape_to_byte_shape((HIDDEN, 256), Q.Q2_K)
    tensors["blk.0.ffn_down.weight"] = (np.zeros(byte_shape, np.uint8), Q.Q2_K)
    problems = tensor_problems(open_gguf(write(tmp_path / "bad.gguf", tensors)), SHAPES)
    assert sorted(problems) == sorted([
        f"shape mismatch for blk.0.ffn_gate.weight: file [{FFN}, {HIDDEN + 1}], metadata "
        f"implies [{FFN}, {HIDDEN}]",
        "unexpected tensor blk.0.attn_qkv.weight",
        "tensor blk.0.ffn_down.weight has type Q2_K, which is not supported (supported: "
        "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)",
        f"shape mismatch for blk.0.ffn_down.weight: file [{HIDDEN}, 256], metadata implies "
        f"[{HIDDEN}, {FFN}]",
        "missing tensor blk.0.ffn_up.weight (model.layers.0.mlp.up_proj.weight)",
    ])


def test_llama_q_and_k_rows_come_back_in_hugging_faces_order(tmp_path):
    """llama.cpp's rows of one head, [0, 2, 1, 3] in Hugging Face's numbering (rotary pairs
    side by side), are read back as [0, 1, 2, 3]; Qwen2's are written and read as they are."""
    tensors = hf_tensors()
    k = np.arange(HEAD_DIM, dtype=np.float32)[:, None].repeat(HIDDEN, 1)      # row i is all i
    file_k = k[[0, 2, 1, 3]]
    for arch, rows in (("llama", [0, 1, 2, 3]), ("qwen2", [0, 2, 1, 3])):
        gguf_tensors = as_gguf(tensors)
        gguf_tensors["blk.0.attn_k.weight"] = file_k
        path = write(tmp_path / f"{arch}.gguf", gguf_tensors, arch=arch)
        reader = open_gguf(path)
        read = {name: t for _, name, t in read_tensors(reader, config_from_gguf(reader))}
        assert read["model.layers.0.self_attn.k_proj.weight"][:, 0].tolist() == rows


def test_f32_tensors_round_trip_exactly_under_hugging_face_names(llama_file):
    reader = open_gguf(llama_file)
    read = list(read_tensors(reader, config_from_gguf(reader)))
    assert [(gguf_name, name) for gguf_name, name, _ in read] == [
        (GGUF_NAMES[name], name) for name in SHAPES]
    for (_, name, tensor), want in zip(read, hf_tensors().values()):
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, torch.from_numpy(want)), name
    # F32 data is copied out of the read-only file mapping (a view of it could not be written)
    start = reader.data.ctypes.data
    for _, name, tensor in read:
        assert not start <= tensor.data_ptr() < start + reader.data.nbytes, name


@pytest.mark.parametrize("qtype,tolerance", [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 0.05)])
def test_quantized_tensors_are_dequantized(qtype, tolerance, tmp_path):
    tensors = hf_tensors()
    rng = np.random.default_rng(1)
    tensors["model.layers.0.mlp.down_proj.weight"] = want = rng.standard_normal(
        (HIDDEN, 64)).astype(np.float32)          # rows of whole Q8_0 blocks (32 values)
    gguf_tensors = as_gguf(tensors)
    gguf_tensors["blk.0.ffn_down.weight"] = (quantize(want, qtype), qtype)
    reader = open_gguf(write(tmp_path / "q.gguf", gguf_tensors))
    read = {name: t for _, name, t in read_tensors(reader, config_from_gguf(reader))}
    got = read["model.layers.0.mlp.down_proj.weight"]
    assert got.dtype == torch.float32 and tuple(got.shape) == (HIDDEN, 64)
    error = (got - torch.from_numpy(want)).abs().max().item()
    assert 0 < error <= tolerance * np.abs(want).max()


def test_rope_freqs_are_read_under_their_own_name(tmp_path):
    tensors = as_gguf(hf_tensors())
    tensors[ROPE_FREQS] = np.array([1.0, 4.0], np.float32)
    reader = open_gguf(write(tmp_path / "r.gguf", tensors))
    read = {name: t for _, name, t in read_tensors(reader, config_from_gguf(reader))}
    assert read[gguf_weights.ROPE_FREQS].tolist() == [1.0, 4.0]
