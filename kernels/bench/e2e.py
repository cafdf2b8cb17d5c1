"""End-to-end part of the kernel benchmark: the bundled engine on a Qwen2-0.5B-shaped model with
random weights, Triton kernels + CUDA graphs vs the PyTorch reference path (eager), on the
workload nano-vllm reports (~1,430 tok/s on a laptop RTX 4070 with Qwen3-0.6B): 256 requests,
input and output lengths uniform in [100, 1024], all submitted at once, ignore_eos.
"""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

QWEN2_0_5B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "tie_word_embeddings": True}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "tie_word_embeddings": True}


def make_model_dir(out: Path, shape: dict, seed: int = 0) -> Path:
    """A Qwen2 checkpoint with random weights (GPT-2-style init) and a small BPE tokenizer.

    The tokenizer covers only a few hundred ids; larger ids decode to nothing, which is all a
    throughput run needs."""
    from safetensors.torch import save_file

    from prefixgate.backend.demo import train_bpe_tokenizer, write_tokenizer_files
    from prefixgate.backend.models import LlamaConfig, build_model

    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog 0123456789"] * 8, 300)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "attention_bias": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
              "bos_token_id": None, "eos_token_id": tok.token_to_id("<|im_end|>"), **shape}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(out, tok, model_max_length=32768)
    with torch.device("meta"):
        meta_model = build_model(LlamaConfig.from_dict(config))
        shapes = {n: tuple(p.shape) for n, p in meta_model.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    std, resid = 0.02, 0.02 / (2 * shape["num_hidden_layers"]) ** 0.5
    tensors = {}
    for name, s in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(s, dtype=torch.bfloat16)
        else:
            sd = resid if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            tensors[name] = (torch.randn(s, generator=gen) * sd).to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(n)]


def run_engine(model_dir: Path, device: str, backend: str, eager: bool, requests,
               cpu: bool) -> dict:
    from prefixgate.backend.config import EngineArgs
    from prefixgate.backend.engine import LLMEngine
    from prefixgate.backend.sampling import SamplingParams

    args = EngineArgs(model=str(model_dir), device=device, dtype="float32" if cpu else "bfloat16",
                      attention_backend=backend, enforce_eager=eager, max_num_seqs=256,
                      max_num_batched_tokens=256 if cpu else 8192, max_model_len=4096,
                      kv_cache_memory="256MiB" if cpu else "24GiB")
    t0 = time.perf_counter()
    engine = LLMEngine(args)
    startup_s = time.perf_counter() - t0

    def drive(batch, tag):
        first: dict[str, float] = {}
        arrival = time.monotonic()
        for i, (ids, out_len) in enumerate(batch):
            params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{tag}{i}", ids, params, arrival_time=arrival)
        tokens = 0
        t = time.perf_counter()
        while engine.has_work():
            for o in engine.step():
                tokens += len(o.token_ids)
                first.setdefault(o.request_id, time.monotonic() - arrival)
        return tokens, time.perf_counter() - t, sorted(first.values())

    drive(requests[:2], "warm")      # Triton JIT and allocator warm-up, outside the timing
    tokens, elapsed, ttft = drive(requests, "r")
    return {"backend": backend, "cuda_graphs": not eager and device == "cuda",
            "requests": len(requests), "output_tokens": tokens, "elapsed_s": elapsed,
            "tokens_per_s": tokens / elapsed, "ttft_median_s": statistics.median(ttft),
            "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))], "startup_s": startup_s}


def bench_e2e(a, device: str) -> dict:
    cpu = device == "cpu"
    shape = TINY if cpu else QWEN2_0_5B
    with tempfile.TemporaryDirectory(prefix="prefixgate-bench-") as tmp:
        model_dir = make_model_dir(Path(tmp) / "qwen2-random", shape)
        reqs = workload(a.e2e_requests, a.e2e_min_len, a.e2e_max_len, shape["vocab_size"])
        fast = run_engine(model_dir, device, "triton", False, reqs, cpu)
        print(json.dumps(fast), flush=True)
        torch.cuda.empty_cache() if not cpu else None
        base = run_engine(model_dir, device, "torch", True, reqs[:a.e2e_baseline_requests], cpu)
        print(json.dumps(base), flush=True)
    result = {"kernels_cuda_graphs": fast, "reference_eager": base, "model": shape,
              "throughput_ratio": fast["tokens_per_s"] / base["tokens_per_s"],
              "ttft_median_ratio": base["ttft_median_s"] / fast["ttft_median_s"],
              "nano_vllm_rtx4070_tokens_per_s": 1430}
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k}), flush=True)
    return result
