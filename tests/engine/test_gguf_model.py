"""GGUF files written by llama.cpp's conversion rules are served right; damaged ones are refused
with a message that names the fault.

Tiny random Llama and Qwen2 checkpoints are converted by `tests/engine/gguf_writer.py` into
F32, F16, Q8_0 and Q4_1 files (Q4_1: the bundled SmolLM2 file's type). transformers loads the
same file (`from_pretrained(dir, gguf_file=...)`, dequantized by the same `gguf` package) as
the reference: our loader's logits must be close to its logits, and the engine's greedy tokens
(in a batch, and served over HTTP) must equal its greedy tokens, token for token. The writer
itself is checked first: its F32 file must give transformers the logits of the checkpoint it
was converted from (the Q/K row order and the metadata are right), and the tokenizer read back
from the file must encode, decode and render the chat template as the checkpoint's does.

Each damaged file (truncated, wrong magic, a tensor missing, an architecture or tensor type we
do not serve, NaN in a tensor) must fail `load_model` and `verify_weights` with a message naming
what is wrong; the real commands `prefixgate verify-weights` and `prefixgate backend` exit 1.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from prefixgate.backend.loader import WeightError, load_model, verify_weights
from prefixgate.common.schema import ConfigError
from prefixgate.common.tokenizer import Tokenizer
from tests.engine.gguf_writer import last_tensor, overwrite, tensor_offset, truncate, write_gguf
from tests.engine.helpers import (
    PagedCache,
    complete_ids,
    generate,
    greedy,
    hf_greedy,
    load_hf,
    load_hf_gguf,
    make_engine,
    prompt_of,
)
from tests.helpers import ServerThread, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY_TOKENS = 40
PROMPT_LENGTHS = (5, 23, 61)


@torch.no_grad()
def _logits(hf_model, prompt: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([prompt])).logits[0]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module", params=["F32", "F16", "Q8_0", "Q4_1"])
def gguf_file(request, checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / f"{checkpoint.name}-{request.param}.gguf"
    return write_gguf(checkpoint, out, Q[request.param])


@pytest.fixture(scope="module")
def reference(gguf_file):
    """transformers' model, from the same GGUF file."""
    return load_hf_gguf(gguf_file)


@pytest.fixture(scope="module")
def source(tiny_llama_dir, tmp_path_factory):
    """A tiny Llama checkpoint and its F16 GGUF: served over HTTP, and where every damaged file
    starts from."""
    out = tmp_path_factory.mktemp("source") / "good.gguf"
    return SimpleNamespace(dir=tiny_llama_dir, gguf=write_gguf(tiny_llama_dir, out, Q.F16))


# --- the writer, and parity with transformers --------------------------------------------------

def test_f32_file_gives_transformers_the_checkpoints_logits(checkpoint, tmp_path):
    path = write_gguf(checkpoint, tmp_path / "model.gguf", Q.F32)
    prompt = prompt_of(29, seed=3)
    torch.testing.assert_close(_logits(load_hf_gguf(path), prompt),
                               _logits(load_hf(checkpoint), prompt), atol=1e-5, rtol=1e-5)


def test_logits_match_transformers(gguf_file, reference):
    model, config = load_model(gguf_file)
    prompt = prompt_of(47, seed=11)
    ours = PagedCache(config).step(model, {0: prompt})[0]
    torch.testing.assert_close(ours, _logits(reference, prompt), atol=1e-4, rtol=1e-4)


def test_engine_greedy_tokens_equal_transformers(gguf_file, reference):
    prompts = {f"len{n}": prompt_of(n, seed=n) for n in PROMPT_LENGTHS}
    engine = make_engine(gguf_file)
    results = generate(engine, {rid: (p, greedy(GREEDY_TOKENS)) for rid, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert results[rid].tokens == hf_greedy(reference, prompt, GREEDY_TOKENS), rid


MIXED_TEXT = ["Hello there! How are you today?", "Numbers: 1, 42 and 2024.\n\n1. first",
              "def f(x):\n    return {x: [1, 2]}  # code", "你好，世界。", "Emoji 🙂 🚀, café",
              "<|im_start|>user\nhi<|im_end|>\n", "   spaces\t\ttabs \n\n\n"]


def test_tokenizer_from_the_file_equals_the_checkpoints(checkpoint, tmp_path):
    path = write_gguf(checkpoint, tmp_path / "model.gguf", Q.F16)
    ours, theirs = Tokenizer.load(path), Tokenizer.load(checkpoint)
    for text in MIXED_TEXT:
        ids = theirs.encode(text, add_special_tokens=True)
        assert ours.encode(text, add_special_tokens=True) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.eos_token_ids == theirs.eos_token_ids == {theirs.token_to_id("<|im_end|>")}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)


async def test_backend_serves_the_file_over_http(source):
    """`prefixgate backend --model FILE.gguf`: greedy tokens by id as transformers' on the same
    file, and a chat whose prompt is the checkpoint's template, tokenized as transformers does."""
    from transformers import AutoTokenizer

    prompt = prompt_of(30, seed=5)
    expected = hf_greedy(load_hf_gguf(source.gguf), prompt, GREEDY_TOKENS)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    chat_ids = AutoTokenizer.from_pretrained(source.dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    chat = {"model": source.gguf.stem, "messages": messages, "max_tokens": 8}
    with ServerThread(["--model", str(source.gguf), "--dtype", "float32",
                       "--num-kv-blocks", "64"]) as server:
        async with aiohttp.ClientSession() as session:
            served = await complete_ids(session, server.url, prompt, GREEDY_TOKENS)
            async with session.post(server.url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
    assert served["token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == len(chat_ids)


# --- damaged files -----------------------------------------------------------------------------

def _truncated(src, path):
    shutil.copyfile(src.gguf, path)
    name = last_tensor(path)
    truncate(path, tensor_offset(path, name) + 100)
    return WeightError, [f"tensor {name}", "truncated"]


def _bad_magic(src, path):
    shutil.copyfile(src.gguf, path)
    overwrite(path, 0, b"GGML")
    return WeightError, ["is not a GGUF file", "b'GGML'"]


def _missing_tensor(src, path):
    write_gguf(src.dir, path, Q.F16, drop={"blk.1.ffn_up.weight"})
    return WeightError, ["missing tensor blk.1.ffn_up.weight"]


def _unsupported_architecture(src, path):
    write_gguf(src.dir, path, Q.F16, architecture="gpt2")
    return ConfigError, ["general.architecture", "'gpt2'"]


def _unsupported_tensor_type(src, path):
    write_gguf(src.dir, path, Q.F16, retype={"blk.0.ffn_down.weight": Q.IQ4_NL})
    return WeightError, ["tensor blk.0.ffn_down.weight", "IQ4_NL"]


def _nan_values(src, path):
    shutil.copyfile(src.gguf, path)
    overwrite(path, tensor_offset(path, "blk.1.attn_v.weight"), np.float16("nan").tobytes())
    return WeightError, ["tensor blk.1.attn_v.weight", "NaN"]


DAMAGES = [_truncated, _bad_magic, _missing_tensor, _unsupported_architecture,
           _unsupported_tensor_type, _nan_values]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.lstrip("_"))
def test_damaged_file_is_refused_by_name(damage, source, tmp_path):
    path = tmp_path / "bad.gguf"
    error, fragments = damage(source, path)
    with pytest.raises(error) as raised:
        load_model(path)
    report = verify_weights(path)
    assert not report.ok
    for fragment in fragments:
        assert fragment in str(raised.value)
        assert fragment in report.render()


def _prefixgate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixgate.proxy.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_verify_weights_command_exit_status(source, tmp_path):
    good = _prefixgate("verify-weights", str(source.gguf))
    assert good.returncode == 0 and good.stdout.rstrip().endswith("OK"), good.stdout
    bad = tmp_path / "bad.gguf"
    _nan_values(source, bad)
    result = _prefixgate("verify-weights", str(bad))
    assert result.returncode == 1
    assert "PROBLEM: tensor blk.1.attn_v.weight" in result.stdout, result.stdout


def test_backend_refuses_a_damaged_file_before_serving(source, tmp_path):
    bad = tmp_path / "bad.gguf"
    _nan_values(source, bad)
    result = _prefixgate("backend", "--model", str(bad), "--port", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "tensor blk.1.attn_v.weight" in result.stderr
    assert "listening" not in result.stdout + result.stderr
