"""backend/hf_export.py on its own: a GGUF file written out as a Hugging Face directory.

A tiny random Llama and Qwen2 checkpoint is converted to an F32 GGUF by llama.cpp's rules
(tests/engine/gguf_writer.py) and exported back: every tensor must equal the checkpoint's (Q/K
rows in Hugging Face's order again), transformers must load the directory and give the
checkpoint's logits, and the tokenizer, chat template and end-of-sequence ids must survive.
Refusals name what is wrong and leave no half-written model behind.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import load_file

from prefixgate.backend.checkpoint_files import SINGLE_NAME, WeightError
from prefixgate.backend.gguf_weights import ROPE_FREQS
from prefixgate.backend.hf_export import export_hf
from prefixgate.backend.loader import verify_weights
from prefixgate.common.tokenizer import Tokenizer
from tests.engine.gguf_writer import write_gguf
from tests.engine.helpers import load_hf
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "Hello world, 2024-06-01: 12345 <|im_end|> 中文"
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "max_position_embeddings",
              "tie_word_embeddings", "bos_token_id", "eos_token_id")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory) -> Path:
    return write_gguf(checkpoint, tmp_path_factory.mktemp("gguf") / "model.gguf", Q.F32)


@pytest.fixture(scope="module")
def exported(gguf_file) -> Path:
    return export_hf(gguf_file, gguf_file.parent / "exported")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_every_tensor_comes_back_exactly(checkpoint, exported):
    want, got = load_file(checkpoint / SINGLE_NAME), load_file(exported / SINGLE_NAME)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name


def test_the_config_is_the_checkpoints(checkpoint, exported):
    want, got = read_json(checkpoint / "config.json"), read_json(exported / "config.json")
    assert got["architectures"] == want["architectures"]
    assert got["model_type"] == want["model_type"]
    assert {k: got.get(k) for k in SHAPE_KEYS} == {k: want.get(k) for k in SHAPE_KEYS}
    assert got["rope_theta"] == want.get("rope_theta", want.get("rope_parameters", {}).get(
        "rope_theta"))
    assert got["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"])
    assert (got["torch_dtype"], got["hidden_act"]) == ("float32", "silu")


def test_transformers_loads_the_export_and_gives_the_checkpoints_logits(checkpoint, exported):
    prompt = torch.tensor([[5, 17, 3, 90, 41, 41, 7, 200]])
    with torch.no_grad():
        want = load_hf(checkpoint)(prompt).logits
        got = load_hf(exported)(prompt).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_export_passes_verify_weights(exported):
    report = verify_weights(exported)
    assert report.ok, report.render()


def test_the_tokenizer_and_chat_template_survive(checkpoint, exported):
    want, got = Tokenizer.load(checkpoint), Tokenizer.load(exported)
    assert got.encode(TEXT) == want.encode(TEXT)
    assert got.decode(want.encode(TEXT)) == want.decode(want.encode(TEXT))
    config = read_json(exported / "tokenizer_config.json")
    assert config["chat_template"] == read_json(checkpoint / "tokenizer_config.json")[
        "chat_template"]
    assert config["eos_token"] == "<|im_end|>"
    generation = read_json(exported / "generation_config.json")
    eos = read_json(checkpoint / "config.json")["eos_token_id"]
    assert generation["eos_token_id"] == eos and eos in want.eos_token_ids


def test_bfloat16_export(checkpoint, gguf_file, tmp_path):
    out = export_hf(gguf_file, tmp_path / "bf16", dtype="bfloat16")
    want, got = load_file(checkpoint / SINGLE_NAME), load_file(out / SINGLE_NAME)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    assert read_json(out / "config.json")["torch_dtype"] == "bfloat16"


def test_an_unknown_dtype_is_refused_before_writing(gguf_file, tmp_path):
    with pytest.raises(ValueError, match="dtype 'fp8': expected one of float32, bfloat16, "
                                         "float16"):
        export_hf(gguf_file, tmp_path / "out", dtype="fp8")
    assert not (tmp_path / "out").exists()


def test_an_existing_model_is_kept_unless_overwrite(gguf_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already holds a model"):
        export_hf(gguf_file, out)
    assert (out / "config.json").read_text() == "{}" and not (out / SINGLE_NAME).exists()
    export_hf(gguf_file, out, overwrite=True)
    assert read_json(out / "config.json")["architectures"] and (out / SINGLE_NAME).is_file()


def test_a_file_that_is_not_gguf_is_a_weight_error(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(WeightError, match="is not a GGUF file"):
        export_hf(tmp_path / "model.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def with_rope_freqs(src: Path, dst: Path) -> Path:
    """A copy of `src` with Llama 3.1-style per-dimension rope factors added."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub_type = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    head_dim = reader.fields[f"{arch}.embedding_length"].contents() // reader.fields[
        f"{arch}.attention.head_count"].contents()
    writer.add_tensor(ROPE_FREQS, np.ones(head_dim // 2, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_rope_factors_cannot_be_exported(gguf_file, tmp_path):
    path = with_rope_freqs(gguf_file, tmp_path / "rope.gguf")
    with pytest.raises(WeightError, match=f"{ROPE_FREQS}: per-dimension rope factors cannot "
                                          "be exported"):
        export_hf(path, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()
