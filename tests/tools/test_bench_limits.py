"""`python -m prefixgate.backend.bench.limits --quick` on the demo model: this machine's GEMM
peaks and memory bandwidth, measured, and the floors they put under prefill and decode."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from prefixgate.backend import cpu_ops
from prefixgate.backend.bench import limits


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The quick probe's JSON and printed report (one run for the module's tests)."""
    out = tmp_path_factory.mktemp("limits") / "limits.json"
    argv = ["--quick", "--model", "demo", "--prefill-tokens", "512,2400,8000",
            "--batches", "1,8,32", "--context", "512", "--out", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert limits.main(argv) == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_quick_probe_measures_positive_peaks_and_bandwidth(probe):
    result, printed = probe
    lim = result["limits"]
    assert set(lim["gemm_gflops"]) == {"float32", "bfloat16"}
    assert all(g > 0 for g in lim["gemm_gflops"].values())
    assert lim["bandwidth_gbs"] > 0 and all(v > 0 for v in lim["bandwidth"]["gbs"].values())
    # the engine's GEMV that reads 4 streams at once, where its compiled operators build
    assert ("gemv_streams" in lim["bandwidth"]["gbs"]) == cpu_ops.available()
    assert {"sum", "gemv", "copy"} <= set(lim["bandwidth"]["gbs"])
    # every call measured, or the reason it could not be (no oneDNN for a dtype here)
    assert {r["call"] for r in lim["gemm"]} == {"linear", "mkldnn_prepacked"}
    assert all(("gflops" in r) != ("error" in r) for r in lim["gemm"])
    assert lim["threads"] == 1 and lim["torch"] == torch.__version__ and lim["cores"]
    cpu = lim["cpu"]
    assert set(cpu["flags"]) >= {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert cpu["model_name"]
    assert "GEMM peak float32" in printed and "memory read" in printed
    assert "prefill of N tokens" in printed and "decode step at 512 tokens" in printed


def test_floors_grow_with_tokens_and_batch(probe):
    result, _ = probe
    fl = result["floors"]
    for dtype in ("float32", "bfloat16"):
        prefill = [fl["prefill_s"][dtype][n] for n in ("512", "2400", "8000")]
        assert 0 < prefill[0] < prefill[1] < prefill[2]
        # at least linear in the tokens (attention grows faster)
        assert prefill[2] / prefill[0] >= 8000 / 512 * 0.99
        steps = [fl["decode_step"][dtype][b] for b in ("1", "8", "32")]
        assert 0 < steps[0]["s"] <= steps[1]["s"] <= steps[2]["s"]
        for step in steps:
            assert step["s"] == max(step["memory_s"], step["compute_s"])
    # every weight once per step: half the bytes in bf16
    assert fl["weight_bytes"]["float32"] == 2 * fl["weight_bytes"]["bfloat16"]
    assert fl["decode_step"]["float32"]["1"]["bytes"] > fl["weight_bytes"]["float32"]


def test_fraction_of_floor_from_the_saved_json(probe):
    result, _ = probe
    floors = limits.Floors.from_dict(result)
    fl = result["floors"]
    prefill = fl["prefill_s"]["bfloat16"]["2400"]
    assert floors.prefill_s(2400, "bfloat16") == pytest.approx(prefill)
    assert floors.prefill_fraction(2400, prefill, "bfloat16") == pytest.approx(1.0)
    assert floors.prefill_fraction(2400, 2 * prefill, "bfloat16") == pytest.approx(0.5)
    # a prefill after a cached prefix costs less than the whole prompt
    assert floors.prefill_s(480, "float32", cached=1920) < floors.prefill_s(2400, "float32")
    step = fl["decode_step"]["float32"]["8"]["s"]
    assert floors.decode_fraction(8, step * 1.25, "float32", 512) == pytest.approx(0.8)


def test_measure_limits_puts_torch_threads_back():
    before = torch.get_num_threads()
    lim = limits.measure_limits(threads=1, effort=limits.Effort.quick())
    assert torch.get_num_threads() == before and lim.threads == 1
    assert lim.gemm_gflops["float32"] > 0 and lim.seconds > 0
    assert limits.Limits.from_dict(lim.to_dict()) == lim


def test_model_cost_counts_the_checkpoints_weights_from_its_config():
    """The counts come from the config (the loader's table of a checkpoint's tensors), so a
    model whose linears are prepacked counts the same as the plain one it was loaded as."""
    from prefixgate.backend.config import resolve_model
    from prefixgate.backend.cpu_linear import prepare_for_inference
    from prefixgate.backend.loader import load_model

    model, config = load_model(resolve_model("demo"), dtype="float32")
    loaded = sum(p.numel() for p in model.model.layers.parameters())
    cost = limits.ModelCost.of(limits.model_config("demo"))
    assert cost.flops.layer_params == loaded and cost.kv_heads == config.num_key_value_heads
    prepare_for_inference(model)            # fused (and in bf16 packed): the count holds
    assert limits.ModelCost.of(config) == cost
    assert limits.ModelCost.from_dict(cost.to_dict()) == cost
