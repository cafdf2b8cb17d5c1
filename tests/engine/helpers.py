"""Engine test helpers: transformers' own greedy generation as the reference, the engine's
/metrics and token-id completions over HTTP, our model driven over a paged KV cache without an
engine (`PagedCache`), random prompts, `LLMEngine` runs with and without speculative
decoding, compared token for token, and for GGUF files transformers' model of the same file and
our model's next-token choices along a given text."""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch

from prefixgate.backend.attention import AttentionMetadata
from prefixgate.backend.config import EngineArgs, parse_speculative_config
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.spec_decode import StepCost
from tests.helpers import VOCAB_SIZE


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


# --- the reference and the server's answers ---------------------------------------------------

def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation, EOS ignored (the engine requests set ignore_eos)."""
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The engine's /metrics as {name: value} (unlabelled series only)."""
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*) ([-+\d.eE]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def complete_ids(session, url, prompt: list[int], max_tokens: int, stream=False,
                       **extra) -> dict:
    """POST /v1/completions with token ids, greedy; returns {"token_ids", "usage",
    "finish_reason"}."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **extra}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            data = await r.json()
            return {"token_ids": data["choices"][0]["token_ids"], "usage": data["usage"],
                    "finish_reason": data["choices"][0]["finish_reason"]}
        ids, usage, reason = [], None, None
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                ids += c.get("token_ids", [])
                reason = c["finish_reason"] or reason
            usage = chunk.get("usage") or usage
        return {"token_ids": ids, "usage": usage, "finish_reason": reason}


# --- our model over a paged KV cache, without an engine ---------------------------------------

class PagedCache:
    """Minimal stand-in for the engine's KV cache bookkeeping, enough to drive the model."""

    def __init__(self, config, num_blocks=96, block_size=4, dtype=torch.float32, device="cpu",
                 seed=0):
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(config.num_hidden_layers)]
        self.block_size, self.device = block_size, device
        self.free = torch.randperm(num_blocks,
                                   generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slot(self, sid: int, pos: int) -> int:
        table = self.tables.setdefault(sid, [])
        if pos // self.block_size >= len(table):
            table.append(self.free.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.no_grad()
    def step(self, model, batch: dict[int, list[int]], backend=None) -> dict[int, torch.Tensor]:
        """Run one forward over the new tokens of every sequence in `batch`; logits per
        sequence."""
        ids, positions, slots, starts = [], [], [], [0]
        for sid, tokens in batch.items():
            start = self.lens.get(sid, 0)
            for i, tok in enumerate(tokens):
                ids.append(tok)
                positions.append(start + i)
                slots.append(self._slot(sid, start + i))
            self.lens[sid] = start + len(tokens)
            starts.append(starts[-1] + len(tokens))
        width = max(len(self.tables[s]) for s in batch)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in batch]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([self.lens[s] for s in batch], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_seq_len=max(self.lens[s] for s in batch),
            is_decode=all(len(t) == 1 for t in batch.values()),
            attention_backend=backend,
        )
        hidden = model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                       self.kv)
        logits = model.compute_logits(hidden)
        return {sid: logits[starts[i]:starts[i + 1]] for i, sid in enumerate(batch)}


# --- speculative decoding through LLMEngine ---------------------------------------------------
# The same requests through an engine without and one with `speculative_config`, in float32 on
# the CPU (deterministic, so greedy outputs compare token for token), with what the model runner
# was given to verify recorded on the way.

SPEC = parse_speculative_config({"num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                 "prompt_lookup_min": 2})
BLOCK = 16


def quoting_prompt(n: int, seed: int) -> list[int]:
    """`n` tokens made of a few random spans, each repeated: n-grams that recur (as in a prompt
    that quotes itself), so drafts are proposed from the first decode step on."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        span = prompt_of(rng.randrange(3, 9), rng.randrange(1 << 30))
        out += span * rng.randrange(1, 4)
    return out[:n]


class FixedCost(StepCost):
    """A step-cost fit that the engine's timings never reach: its break-even rate stays 0 at
    every batch size. With `min_acceptance_rate: 0` no sequence is ever paused, so what is
    drafted depends on the tokens alone, not on how fast this CPU ran each step."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


def make_engine(model_dir, spec=None, fixed_cost=False, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("step_overhead_tokens", 0)
    e = LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", device="cpu",
                             block_size=BLOCK, speculative_config=spec, **kw))
    if fixed_cost and e.speculator is not None:
        e.speculator.cost = FixedCost()
    return e


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)     # the tokens each step added
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclass
class Draft:
    """A drafted decode as the model runner was given it (seen before it ran)."""
    num_output: int
    length: int
    max_tokens: int
    num_draft: int


def record_drafts(engine: LLMEngine) -> list[Draft]:
    """Every draft the engine's runner computes from now on (the real runner still runs)."""
    seen: list[Draft] = []
    run = engine.runner.run

    def recording_run(batch):
        for seq, draft in zip(batch.seqs, batch.drafts):
            if draft:
                seen.append(Draft(seq.num_output_tokens, len(seq), seq.params.max_tokens,
                                  len(draft)))
        return run(batch)

    engine.runner.run = recording_run
    return seen


def generate(engine: LLMEngine,
             requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    out = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        out[rid] = Result()
    steps = 0
    while engine.has_work():
        for o in engine.step():
            r = out[o.request_id]
            r.tokens += o.token_ids
            r.steps.append(list(o.token_ids))
            r.text += o.text
            r.finish_reason, r.completion_tokens = o.finish_reason, o.completion_tokens
        steps += 1
        assert steps < 10_000, "engine stalled"
    return out


def greedy(max_tokens: int, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_speculated(engine: LLMEngine, drafts: list[Draft] | None = None) -> dict:
    """Drafts were verified, some tokens accepted and some rejected; the counters agree with
    what the runner computed; and every block is free again now that all requests ended."""
    s = engine.spec_stats()
    assert s["num_drafts"] > 0
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s
    per_pos = s["num_accepted_tokens_per_pos"]
    assert sum(per_pos) == s["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos   # a prefix is accepted
    assert len(per_pos) == engine.args.speculative_config.num_speculative_tokens
    if drafts is not None:
        assert len(drafts) == s["num_drafts"]
        assert sum(d.num_draft for d in drafts) == s["num_draft_tokens"]
    assert not engine.has_work()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return s


def run_both(model_dir, requests, spec=SPEC, fixed_cost=False, **engine_kw):
    """The same requests through an engine without and one with speculation."""
    plain = generate(make_engine(model_dir, **engine_kw), requests)
    e = make_engine(model_dir, spec, fixed_cost, **engine_kw)
    drafts = record_drafts(e)
    return plain, generate(e, requests), e, drafts


def assert_same(plain: dict[str, Result], spec: dict[str, Result]) -> None:
    for rid in plain:
        a, b = plain[rid], spec[rid]
        assert b.tokens == a.tokens, f"{rid} diverged"
        assert (b.text, b.finish_reason, b.completion_tokens) == (a.text, a.finish_reason,
                                                                 a.completion_tokens), rid


# --- a GGUF file's model in transformers; next-token choices along a fixed text ---------------

def load_hf_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model from a GGUF file (dequantized by the same `gguf` package as ours),
    EOS ignored as the engine's test requests ignore it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def as_bfloat16_build(model):
    """`model` (transformers', float32) as a bfloat16 load of its file makes it: built anew in
    bfloat16 (its rotary frequencies computed in float32, as they are then) and the float32
    weights loaded into it, rounded once. The same weights and buffers as
    `load_hf_gguf(path, torch.bfloat16)` without parsing the file again."""
    from transformers import AutoModelForCausalLM

    built = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16).eval()
    built.load_state_dict(model.state_dict())
    built.generation_config.eos_token_id = None
    return built


def teacher_forced_top1(model, config, prompt: list[int], tokens: list[int],
                        kv_dtype: torch.dtype) -> list[int]:
    """Our model's top-1 next token at each position of `tokens`, given `prompt` and the tokens
    before it, from one prefill over a paged KV cache of `kv_dtype`. Scored against `tokens`, it
    rates every next-token choice, where a free-running comparison stops at the first
    difference (everything after it follows another text)."""
    text = prompt + tokens[:-1]
    cache = PagedCache(config, num_blocks=-(-len(text) // BLOCK), block_size=BLOCK,
                       dtype=kv_dtype, device=next(model.parameters()).device)
    logits = cache.step(model, {0: text})[0]
    return logits[len(prompt) - 1:].argmax(-1).tolist()
