"""The fused elementwise operators for bf16 on a CPU (backend/cpu_ops.py, cpu_ops.cpp): each
computes what its PyTorch definition does, a model gives the same logits through them, and
without them (no compiler, or PREFIXGATE_CPU_OPS=0) the engine still serves."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from prefixgate.backend import cpu_linear, cpu_ops
from prefixgate.backend.loader import cpu_flags, load_model
from tests.engine.test_cpu_linear import assert_same_bf16_logits, logits_of
from tests.helpers import make_tiny_model

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler to build the operators with")


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load(cpu_flags())
    assert module is not None, "the operators did not build on a machine with a compiler"
    return module


def bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def one_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """`got` (bf16) is `exact` (fp32) rounded once: within half a unit of bf16's last place,
    plus the rounding of bf16 inputs the exact value was computed from."""
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_rounds_as_the_pytorch_definition_does(ops, rows):
    x, weight = bf16(rows, 576, scale=3), bf16(576, seed=1)
    with cpu_ops.plain():
        expected = cpu_ops.rms_norm(x, weight, 1e-5)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), expected)       # the same two roundings


@needs_compiler
@pytest.mark.parametrize("width", [576, 70])          # 70: not a multiple of a vector's width
def test_add_rms_norm_adds_in_place_and_normalizes_the_sum(ops, width):
    x, residual, weight = bf16(9, width), bf16(9, width, seed=1), bf16(width, seed=2)
    expected_sum = x + residual
    with cpu_ops.plain():
        expected = cpu_ops.rms_norm(expected_sum, weight, 1e-6)
    got = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_sum) and torch.equal(got, expected)


@needs_compiler
@pytest.mark.parametrize("head_dim", [64, 20])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(ops, head_dim):
    rows, heads, kv_heads = 5, 4, 2
    qkv = bf16(rows, heads + 2 * kv_heads, head_dim)
    angles = torch.arange(rows)[:, None] * torch.rand(head_dim // 2)[None]
    cos, sin = angles.cos(), angles.sin()
    before = qkv.clone()
    ops.rope_(qkv, heads + kv_heads, cos, sin)
    x1, x2 = before[:, :heads + kv_heads].float().chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    one_rounding(qkv[:, :heads + kv_heads], exact)
    assert torch.equal(qkv[:, heads + kv_heads:], before[:, heads + kv_heads:])


@needs_compiler
@pytest.mark.parametrize("width", [3072, 40])
def test_silu_and_mul_is_swiglu(ops, width):
    x = bf16(6, width, scale=4)
    gate, up = x.float().chunk(2, dim=-1)
    one_rounding(ops.silu_and_mul(x), F.silu(gate) * up)


@needs_compiler
def test_bad_input_is_an_error_not_a_crash(ops):
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_and_mul(bf16(4, 8).t())


@needs_compiler
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_model_gives_the_same_logits_through_the_fused_operators(ops, tmp_path, arch):
    model, config = load_model(make_tiny_model(tmp_path, arch), dtype="bfloat16")
    cpu_linear.prepare_for_inference(model)
    with cpu_ops.plain():
        expected = logits_of(model, config, torch.bfloat16)
    for a, b in zip(expected, logits_of(model, config, torch.bfloat16), strict=True):
        assert_same_bf16_logits(a, b)


SERVE_ONE = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend import cpu_ops
engine = LLMEngine(EngineArgs(model=sys.argv[1], dtype="bfloat16", kv_cache_memory="64MiB"))
engine.add_request("r", [5, 17, 99, 3], SamplingParams(max_tokens=4, temperature=0))
tokens = []
while engine.has_work():
    tokens += [t for out in engine.step() for t in out.token_ids]
print("fused" if cpu_ops.available() else "plain", len(tokens))
"""


@pytest.mark.parametrize("env", [{"PREFIXGATE_CPU_OPS": "0"}, {"CXX": "/nonexistent/c++"}],
                         ids=["switched-off", "no-compiler"])
def test_without_the_operators_the_engine_still_serves(tmp_path, env):
    model_dir = make_tiny_model(tmp_path / "model", "llama")
    run = subprocess.run(
        [sys.executable, "-c", SERVE_ONE, str(model_dir)], capture_output=True, text=True,
        timeout=120, env={**os.environ, "PREFIXGATE_CACHE": str(tmp_path / "cache"), **env})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "plain 4"
    if "CXX" in env:        # a failed build says so once, and why
        assert "fused CPU operators unavailable" in run.stdout
