"""Our Llama-family model over a paged KV cache agrees with Hugging Face transformers.

Each case builds a tiny random checkpoint with transformers, loads it with our loader, and runs
it through a small paged cache whose blocks are handed out in shuffled order (so a wrong block
table or slot mapping shows up as wrong logits): one prefill, a chunked prefill, token-by-token
decode, and several sequences flattened into one step.
"""
from __future__ import annotations

import pytest
import torch

from prefixgate.backend.loader import load_model
from tests.engine.helpers import PagedCache
from tests.helpers import make_tiny_model

ATOL = 2e-4  # fp32 vs fp32: only summation order differs


def _load_pair(model_dir, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    ours, config = load_model(model_dir, dtype=dtype, device=device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return ours, hf, config


@torch.no_grad()
def _hf_logits(hf, tokens) -> torch.Tensor:
    ids = torch.tensor([tokens], device=hf.device)
    return hf(ids).logits[0].float()


def _prompt(n, seed=1, vocab=384):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


MODEL_CASES = {
    "llama": dict(kind="llama"),
    "qwen2": dict(kind="qwen2"),
    "mistral": dict(kind="mistral"),
    "llama3_rope_scaling": dict(
        kind="llama", rope_theta=500000.0, max_position_embeddings=1024,
        # A short original context makes the scaling bite within a 48-token test sequence.
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "tied_embeddings": dict(kind="llama", tie_word_embeddings=True),
    "llama_attention_bias": dict(kind="llama", attention_bias=True, num_key_value_heads=4),
}


@pytest.fixture(scope="module", params=list(MODEL_CASES))
def pair(request, tmp_path_factory):
    case = dict(MODEL_CASES[request.param])
    d = make_tiny_model(tmp_path_factory.mktemp(request.param), case.pop("kind"), **case)
    return _load_pair(d)


def test_config_reads_what_transformers_wrote(pair):
    ours, hf, config = pair
    assert config.model_type == hf.config.model_type
    assert config.attention_bias == (config.model_type == "qwen2"
                                     or getattr(hf.config, "attention_bias", False))
    # transformers 5 calls it rope_parameters, 4.x rope_scaling.
    hf_rope = (getattr(hf.config, "rope_parameters", None)
               or getattr(hf.config, "rope_scaling", None) or {})
    assert (config.rope_scaling is not None) == (hf_rope.get("rope_type") == "llama3")
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for n, p in hf.named_parameters()
        if not (config.tie_word_embeddings and n == "lm_head.weight")
    )


def test_single_prefill_matches(pair):
    ours, hf, config = pair
    tokens = _prompt(48)
    got = PagedCache(config).step(ours, {0: tokens})[0]
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches(pair):
    ours, hf, config = pair
    tokens = _prompt(48, seed=2)
    ref = _hf_logits(hf, tokens)
    cache = PagedCache(config, seed=3)
    first = cache.step(ours, {0: tokens[:17]})[0]  # chunk boundary inside a block
    second = cache.step(ours, {0: tokens[17:40]})[0]
    decoded = [cache.step(ours, {0: [t]})[0] for t in tokens[40:]]
    torch.testing.assert_close(torch.cat([first, second, *decoded]), ref, atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers_generate(pair):
    ours, hf, config = pair
    prompt, n_new = _prompt(21, seed=4), 24
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new,
                      do_sample=False, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    cache = PagedCache(config, seed=5)
    logits = cache.step(ours, {0: prompt})[0][-1]
    generated = []
    for _ in range(n_new):
        generated.append(int(logits.argmax()))
        logits = cache.step(ours, {0: [generated[-1]]})[0][-1]
    assert generated == expected


def test_mixed_batch_of_prefills_and_decodes_matches(pair):
    """Several sequences of different lengths in one flattened step, then batched decode."""
    ours, hf, config = pair
    prompts = {0: _prompt(9, seed=6), 1: _prompt(30, seed=7), 2: _prompt(1, seed=8)}
    cache = PagedCache(config, seed=9)
    got = cache.step(ours, prompts)
    for sid, tokens in prompts.items():
        torch.testing.assert_close(got[sid], _hf_logits(hf, tokens), atol=ATOL, rtol=0)
    nxt = {sid: [int(got[sid][-1].argmax())] for sid in prompts}
    got = cache.step(ours, nxt)
    for sid, tokens in prompts.items():
        torch.testing.assert_close(got[sid][-1], _hf_logits(hf, tokens + nxt[sid])[-1],
                                   atol=ATOL, rtol=0)
    # A prefill chunk for one sequence alongside a decode for another (chunked-prefill steps).
    more = _prompt(5, seed=10)
    got = cache.step(ours, {1: more, 0: [3]})
    torch.testing.assert_close(got[1], _hf_logits(hf, prompts[1] + nxt[1] + more)[-5:],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(got[0][-1], _hf_logits(hf, prompts[0] + nxt[0] + [3])[-1],
                               atol=ATOL, rtol=0)


def test_bfloat16_on_cpu_is_as_accurate_as_transformers_bfloat16(tmp_path):
    """Half precision cannot match exactly; measure both against the fp32 reference instead."""
    d = make_tiny_model(tmp_path / "bf16", "qwen2")
    ours, hf, config = _load_pair(d, dtype=torch.bfloat16)
    _, hf32, _ = _load_pair(d)
    assert next(ours.parameters()).dtype == torch.bfloat16
    tokens = _prompt(32, seed=11)
    got = PagedCache(config, dtype=torch.bfloat16).step(ours, {0: tokens})[0]
    exact, theirs = _hf_logits(hf32, tokens), _hf_logits(hf, tokens)
    assert (got - exact).abs().max() <= 2 * (theirs - exact).abs().max()

    def agree(x):
        return (x.argmax(-1) == exact.argmax(-1)).float().mean()

    assert agree(got) >= agree(theirs) - 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cuda_half_precision_matches_transformers(tmp_path, kind, dtype):
    model = make_tiny_model(tmp_path / kind, kind)
    ours, hf, config = _load_pair(model, dtype=dtype, device="cuda")
    tokens = _prompt(40, seed=12)
    cache = PagedCache(config, dtype=dtype, device="cuda")
    got = torch.cat([cache.step(ours, {0: tokens[:25]})[0]] +
                    [cache.step(ours, {0: [t]})[0] for t in tokens[25:]])
    ref = _hf_logits(hf, tokens)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
