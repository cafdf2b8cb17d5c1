"""The engine's inference form of a model (backend/cpu_linear.py): q/k/v and gate/up fused into
one product each, linear layers prepacked for oneDNN in bf16; and the dtype the engine picks
on a CPU (bf16 only where the CPU multiplies it natively)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixgate.backend import cpu_linear, cpu_ops
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.loader import (
    cpu_flags,
    default_cpu_dtype,
    load_model,
    serving_dtype,
)
from tests.engine.helpers import PagedCache
from tests.helpers import make_tiny_model

CPU = torch.device("cpu")
BF16_HERE = cpu_linear.can_pack(torch.bfloat16, CPU)
needs_bf16_packing = pytest.mark.skipif(not BF16_HERE, reason="oneDNN has no bf16 on this CPU")
PROMPTS = {0: [5, 17, 99, 3, 250, 41, 8, 77, 13], 1: [200, 7, 7, 31]}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    # qwen2: biased q/k/v (their biases fuse too); llama: a tied head
    kw = {"tie_word_embeddings": True} if request.param == "llama" else {}
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, **kw)


def logits_of(model, config, dtype) -> list[torch.Tensor]:
    """Prefill of two prompts in one step, then two decode steps: every step's logits."""
    cache = PagedCache(config, dtype=dtype)
    out = [cache.step(model, PROMPTS)]
    for token in (11, 12):
        out.append(cache.step(model, {0: [token], 1: [token + 1]}))
    return [step[s] for step in out for s in sorted(step)]


def assert_same_bf16_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 activations, each product rounded in another order: the values agree at bf16's
    resolution of the logits' scale, and so does the choice — a's argmax is b's up to that
    resolution (a random model's logits are flat: near-ties are common)."""
    tolerance = 0.05 * a.abs().max().item()
    torch.testing.assert_close(b, a, atol=tolerance, rtol=0)
    assert (b.gather(-1, a.argmax(-1, keepdim=True))[:, 0] >= b.max(-1).values - tolerance).all()


def test_fused_projections_compute_what_the_separate_ones_do(model_dir):
    plain, config = load_model(model_dir, dtype="float32")
    fused, _ = load_model(model_dir, dtype="float32")
    fused.fuse_projections()
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.out_features == (
        (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim)
    assert not hasattr(mlp, "up_proj") and mlp.gate_up_proj.out_features == (
        2 * config.intermediate_size)
    for a, b in zip(logits_of(plain, config, torch.float32),
                    logits_of(fused, config, torch.float32), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


@needs_bf16_packing
@pytest.mark.parametrize("keep_plain", [False, True])    # True: 1-4 rows through cpu_ops' kernel
def test_a_packed_linear_multiplies_as_a_plain_one(keep_plain):
    cpu_ops.load(cpu_flags())
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    packed = cpu_linear.PackedLinear(weight, bias, keep_plain=keep_plain)
    assert (packed.weight is not None) == (keep_plain and cpu_ops.multiplies_bf16_rows())
    for rows in (1, 3, 8, 300):
        x = torch.randn(rows, 64).bfloat16()
        expected = F.linear(x.float(), weight.float(), bias.float())
        got = packed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        # both round the fp32 sum to bf16 once: within a unit of bf16's last place
        torch.testing.assert_close(got.float(), expected, rtol=1 / 128, atol=1 / 64)


@needs_bf16_packing
def test_a_packed_model_gives_the_logits_of_the_plain_one(model_dir):
    plain, config = load_model(model_dir, dtype="bfloat16")
    packed, _ = load_model(model_dir, dtype="bfloat16")
    count = cpu_linear.prepare_for_inference(packed)
    linears = [m for m in packed.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == [] and count == 4 * config.num_hidden_layers + 1  # layers' four + the head
    assert packed.cpu_head is not None or packed.lm_head is not None
    for a, b in zip(logits_of(plain, config, torch.bfloat16),
                    logits_of(packed, config, torch.bfloat16), strict=True):
        assert_same_bf16_logits(a, b)


@needs_bf16_packing
def test_plain_weights_are_kept_only_where_they_fit_in_memory(model_dir, monkeypatch, caplog):
    model, config = load_model(model_dir, dtype="bfloat16")
    cpu_linear.prepare_for_inference(model)
    layers = [m for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    if cpu_ops.multiplies_bf16_rows():          # a tiny model's copies fit in 10% of any machine
        assert all(layer.weight is not None for layer in layers)
    monkeypatch.setattr(cpu_linear, "PLAIN_COPY_SHARE", 0.0)
    tight, _ = load_model(model_dir, dtype="bfloat16")
    with caplog.at_level("INFO", logger="prefixgate.engine"):
        cpu_linear.prepare_for_inference(tight)
    assert all(m.weight is None for m in tight.modules() if isinstance(m, cpu_linear.PackedLinear))
    if cpu_ops.multiplies_bf16_rows():
        assert "bf16 few-rows products off" in caplog.text
    for a, b in zip(logits_of(model, config, torch.bfloat16),
                    logits_of(tight, config, torch.bfloat16), strict=True):
        assert_same_bf16_logits(a, b)
    assert 0 < cpu_linear.usable_memory_bytes()


def test_fp32_stays_plain_and_other_devices_are_not_packed(model_dir):
    model, _ = load_model(model_dir, dtype="float32")
    assert cpu_linear.prepare_for_inference(model) == 0
    assert not any(isinstance(m, cpu_linear.PackedLinear) for m in model.modules())
    if cpu_ops.available():     # a decode step's products through the few-rows kernel, same weights
        layers = [m for m in model.modules() if isinstance(m, cpu_linear.FewRowsLinear)]
        assert layers and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert {m.weight.data_ptr() for m in layers} <= {p.data_ptr() for p in model.parameters()}
    assert not cpu_linear.can_pack(torch.float16, CPU)
    assert not cpu_linear.can_pack(torch.bfloat16, torch.device("cuda"))


def test_fp32_decode_batches_go_through_the_few_rows_kernel_and_prefill_through_mkl(model_dir):
    """Up to FEW_ROWS' last row the kernel multiplies, past it F.linear; the same products
    either way, and a batched model's logits are the plain model's."""
    cpu_ops.load(cpu_flags())
    if not cpu_ops.available():
        pytest.skip("no compiled operators here: fp32 layers stay nn.Linear")
    plain, config = load_model(model_dir, dtype="float32")
    model, _ = load_model(model_dir, dtype="float32")
    cpu_linear.prepare_for_inference(model)
    layer = next(m for m in model.modules() if isinstance(m, cpu_linear.FewRowsLinear))
    last = cpu_ops.FEW_ROWS.stop - 1
    for rows in (1, 16, 17, 40, last, last + 1, 300):
        x = torch.randn(rows, layer.in_features)
        assert cpu_ops.takes_few_rows(x, layer.weight) == (rows <= last)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   atol=1e-5, rtol=1e-5)
    plain.fuse_projections()
    batch = {s: [3 + s, 50 + s] for s in range(20)}     # 20 sequences: a step of 40, then of 20

    def two_steps(net) -> list[dict[int, torch.Tensor]]:
        cache = PagedCache(config, dtype=torch.float32)
        return [cache.step(net, batch), cache.step(net, {s: [7] for s in batch})]

    for a, b in zip(two_steps(plain), two_steps(model), strict=True):
        for s in batch:
            torch.testing.assert_close(b[s], a[s], atol=2e-5, rtol=0)


def test_bf16_is_the_default_only_where_the_cpu_multiplies_it(tmp_path):
    assert default_cpu_dtype(frozenset({"avx512f", "avx512_bf16"})) == torch.bfloat16
    assert default_cpu_dtype(frozenset({"amx_tile", "amx_bf16"})) == torch.bfloat16
    assert default_cpu_dtype(frozenset({"avx2", "fma", "avx512f"})) == torch.float32
    assert default_cpu_dtype(frozenset()) == torch.float32
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Zen\nflags\t\t: fpu sse2 avx512f "
                       "avx512_bf16 amx_tile\nbugs\t\t: none\n\nprocessor\t: 1\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "sse2", "avx512f", "avx512_bf16", "amx_tile"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    # an explicit dtype always wins; CUDA keeps the checkpoint's (None)
    assert serving_dtype("float32", CPU) == "float32"
    assert serving_dtype(None, torch.device("cuda")) is None
    here = "bfloat16" if default_cpu_dtype(cpu_flags()) == torch.bfloat16 else "float32"
    assert serving_dtype(None, CPU) == serving_dtype("auto", CPU) == here


def test_the_engine_serves_in_its_default_dtype_packed_where_it_can(model_dir):
    engine = LLMEngine(EngineArgs(model=str(model_dir), device="cpu", num_kv_blocks=32))
    expected = default_cpu_dtype(cpu_flags())
    assert engine.model.model.embed_tokens.weight.dtype == expected
    assert engine.runner.kv_caches[0][0].dtype == expected
    assert (engine.packed_linears > 0) == (expected == torch.bfloat16 and BF16_HERE)
