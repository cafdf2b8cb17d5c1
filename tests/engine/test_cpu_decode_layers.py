"""A decode step's layers in one compiled call (backend/cpu_decode_layers.py): the logits are
bit for bit the modules' (the same kernels in the same order), it takes exactly the steps
whose every operator would have gone to those kernels, and bad input is an error."""
from __future__ import annotations

import shutil

import pytest
import torch

from prefixgate.backend import cpu_decode_layers, cpu_linear, cpu_ops
from prefixgate.backend.attention import AttentionMetadata
from prefixgate.backend.loader import cpu_flags, load_model
from tests.engine.helpers import PagedCache
from tests.helpers import make_tiny_model

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler to build the operators with")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load(cpu_flags())
    assert module is not None, "the operators did not build on a machine with a compiler"
    return module


def prepared(tmp_path, arch: str, dtype: torch.dtype, **overrides):
    """A tiny model of head_dim 64 (decode attention reads it in place), prepared as the
    engine prepares it."""
    if dtype == torch.bfloat16 and not (cpu_ops.few_rows_of(dtype)
                                        and cpu_linear.can_pack(dtype, torch.device("cpu"))):
        pytest.skip("no bf16 few-rows products (AVX-512) or packed products on this CPU")
    kw = {"tie_word_embeddings": True} if arch == "llama" else {}
    model_dir = make_tiny_model(tmp_path, arch, hidden_size=256, num_attention_heads=4,
                                **kw, **overrides)
    model, config = load_model(model_dir, dtype=dtype)
    cpu_linear.prepare_for_inference(model)
    return model, config


def decode_logits(model, config, dtype, batch: int) -> list[torch.Tensor]:
    """`batch` prompts of different lengths prefilled, then 5 decode steps of all of them."""
    cache = PagedCache(config, dtype=dtype)
    prompts = {s: [(7 * s + i) % 250 + 3 for i in range(5 + 3 * s)] for s in range(batch)}
    cache.step(model, prompts)
    steps = []
    for token in range(10, 15):
        step = cache.step(model, {s: [token + s] for s in range(batch)})
        steps.append(torch.cat([step[s] for s in range(batch)]))
    return steps


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: q/k/v biases; llama: a tied head
@pytest.mark.parametrize("batch", [1, 3, 6, 8, 12])    # 8, 12: past bf16's few rows, oneDNN's
def test_decode_steps_give_the_modules_logits_bit_for_bit(ops, tmp_path, arch, dtype, batch):
    model, config = prepared(tmp_path, arch, dtype)
    assert model.model.decode_layers is not None
    with cpu_ops.plain("decode_layers"):
        expected = decode_logits(model, config, dtype, batch)
    got = decode_logits(model, config, dtype, batch)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def decode_meta(lens: list[int], tokens_per_sequence: int = 1, **kw) -> AttentionMetadata:
    pages = max(lens) // 16 + 1
    rows = len(lens) * tokens_per_sequence
    return AttentionMetadata(
        slot_mapping=torch.arange(rows), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.arange(len(lens) * pages, dtype=torch.int32).view(len(lens), pages),
        query_start_loc=torch.arange(0, rows + 1, tokens_per_sequence, dtype=torch.int32),
        max_seq_len=max(lens), is_decode=tokens_per_sequence == 1, **kw)


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
def test_it_takes_only_the_steps_whose_every_operator_is_a_compiled_kernel(ops, tmp_path, dtype):
    model, config = prepared(tmp_path, "llama", dtype)
    layers = model.model.decode_layers
    cache = PagedCache(config, dtype=dtype).kv
    most = cpu_ops.few_rows_of(dtype)[-1]

    def takes(rows: int, meta=None, kv=cache) -> bool:
        x = torch.zeros(rows, config.hidden_size, dtype=dtype)
        return layers.takes(x, meta or decode_meta([20] * rows), kv)

    assert takes(1) and takes(most)
    # past the few rows: bf16's products are oneDNN's on the packed weights, in the loop as in
    # the modules; fp32's F.linear, in the modules only
    assert takes(most + 1) == (dtype == torch.bfloat16)
    assert not takes(4, decode_meta([20, 20], tokens_per_sequence=2))   # a prefill's rows
    assert not takes(1, decode_meta([20], kv_mantissa_bits=3))      # rounded KV: the modules
    assert not takes(1, decode_meta([20], attention_backend="ref"))
    fp8 = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in cache]
    assert not takes(1, kv=fp8)
    for part in ("decode_layers", "few_rows", "decode_attention", "write_kv", "elementwise"):
        with cpu_ops.plain(part):
            assert not takes(1)


@needs_compiler
def test_no_loop_where_a_product_keeps_no_plain_weight(ops, tmp_path):
    model, _ = prepared(tmp_path, "llama", torch.float32)
    assert model.model.decode_layers is not None
    plain_model, _ = load_model(make_tiny_model(tmp_path / "plain", "llama", hidden_size=256,
                                                num_attention_heads=4), dtype="float32")
    plain_model.fuse_projections()                  # nn.Linear products: no few-rows weight
    assert not cpu_decode_layers.attach(plain_model)
    assert plain_model.model.decode_layers is None


@needs_compiler
def test_bad_input_is_an_error_not_a_crash(ops, tmp_path):
    model, config = prepared(tmp_path, "llama", torch.float32)
    layers = model.model.decode_layers
    x = torch.zeros(1, config.hidden_size)
    cos = sin = torch.zeros(1, config.head_dim // 2)
    kv = PagedCache(config).kv
    meta = decode_meta([4])
    with pytest.raises(RuntimeError, match="one k and v cache per layer"):
        layers(x, cos, sin, meta, kv[:-1])
    with pytest.raises(RuntimeError, match="one of each weight per layer"):
        cpu_ops.decode_layers([torch.ones(4)], [], [], [], [], 1, 1, 64, 6, 1e-6, 1.0)
    with pytest.raises(RuntimeError):
        layers(x.double(), cos, sin, meta, kv)
