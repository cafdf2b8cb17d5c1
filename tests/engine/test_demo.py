"""The built-in demo model: deterministic, cached, and a real checkpoint both loaders accept."""
from __future__ import annotations

import json

import pytest
import torch

from prefixgate.backend import demo
from prefixgate.backend.loader import load_model, verify_weights
from prefixgate.common.tokenizer import IncrementalDecoder, Tokenizer
from tests.engine.helpers import PagedCache

SAMPLE = "How a prefix cache saves time: 前缀缓存让第一个字更快出现。 🚀"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return demo.ensure_demo_model(tmp_path_factory.mktemp("cache"))


def test_building_twice_gives_identical_bytes(demo_dir, tmp_path):
    again = demo.ensure_demo_model(tmp_path)
    assert again.name == demo_dir.name == f"demo-{demo.fingerprint()}"
    names = sorted(p.name for p in demo_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (demo_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_second_call_reuses_the_cache_and_honours_the_env_var(demo_dir, monkeypatch):
    weights = demo_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    monkeypatch.setenv("PREFIXGATE_CACHE", str(demo_dir.parent))
    assert demo.ensure_demo_model() == demo_dir
    assert weights.stat().st_mtime_ns == stamp
    assert not [p for p in demo_dir.parent.iterdir() if p.name.startswith(".demo-building-")]


def test_shape_suits_the_benchmarks(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["max_position_embeddings"] >= 8192
    assert verify_weights(demo_dir).ok


def test_loads_with_our_loader_and_transformers_alike(demo_dir):
    from transformers import AutoModelForCausalLM

    ours, config = load_model(demo_dir)
    hf = AutoModelForCausalLM.from_pretrained(demo_dir).eval()
    tok = Tokenizer.from_dir(demo_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": SAMPLE}]))
    got = PagedCache(config, num_blocks=16, block_size=16).step(ours, {0: ids})[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # Random weights, but not degenerate: finite, spread-out logits that differ per position.
    assert got.isfinite().all() and got.std() > 0.1
    assert len(set(got.argmax(-1).tolist())) > 1


def test_tokenizer_matches_transformers_and_streams_cleanly(demo_dir):
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer.from_dir(demo_dir), AutoTokenizer.from_pretrained(demo_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SAMPLE}]
    text = ours.apply_chat_template(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) // 2, "the trained BPE should merge common English"
    decoder = IncrementalDecoder(ours, skip_special_tokens=False)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == text
    assert ours.eos_token_ids == {ours.token_to_id("<|im_end|>")}
