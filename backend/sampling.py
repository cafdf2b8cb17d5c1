"""Sampling: per-request parameters, the batched sampler, draft verification, the stop checks.

A batch mixes greedy and random requests. Greedy rows take the argmax; random rows are scaled
by their temperature, cut by top-k and top-p, and drawn with the exponential-race trick
(argmax of p / Exp(1) noise) so one batched op samples every row while each row's noise can
still come from its own seeded generator.

`verify` checks speculative drafts (backend/spec_decode.py) against the target's own
distributions, so that the output is distributed exactly as without drafts: a greedy row keeps
draft tokens while they equal the argmax; a random row keeps draft token d with probability
p(d) and, at the first rejection, draws from p with d removed (speculative sampling, Leviathan
et al. 2023, with a draft distribution that is all on d). Every draft kept, one more token is
drawn from the distribution after the last one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0        # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 (or -1) disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        # Below ~1e-5 dividing by the temperature overflows the logits: that is greedy anyway.
        return self.temperature < _MIN_TEMPERATURE or self.top_k == 1

    def make_generator(self, device="cpu") -> torch.Generator | None:
        """A private generator for a seeded request, so its draws don't depend on its batch."""
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of `logits` [N, vocab] (float32)."""
    tokens = logits.argmax(dim=-1)
    rand_rows = [i for i, p in enumerate(params) if not p.greedy]
    if rand_rows:
        idx = torch.tensor(rand_rows, device=logits.device)
        probs = _filtered_probs(logits[idx], [params[i] for i in rand_rows])
        tokens[idx] = _race(probs, [generators[i] for i in rand_rows])
    return tokens.tolist()


def _race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of `probs` [N, vocab]: argmax of p / Exp(1) noise, row i's noise from
    generators[i]."""
    noise = torch.empty_like(probs)
    for j, gen in enumerate(generators):
        noise[j].exponential_(generator=gen)
    return probs.div_(noise).argmax(dim=-1)


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[list[int]]:
    """The tokens each sequence keeps: its accepted draft prefix and one token of the target's.

    Sequence i owns len(drafts[i]) + 1 consecutive rows of `logits` (float32): the
    distributions after its last token and after each of its draft tokens."""
    greedy = logits.argmax(dim=-1).tolist()
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    out: list[list[int]] = []
    rand = []                           # random sequences: (i, the rows they own)
    for i, (d, p) in enumerate(zip(drafts, params)):
        if p.greedy:
            rows = greedy[starts[i]:starts[i + 1]]
            n = next((j for j, tok in enumerate(d) if tok != rows[j]), len(d))
            out.append(d[:n] + [rows[n]])
        else:
            out.append([])
            rand.append(i)
    if rand:
        _verify_random(logits, drafts, params, generators, starts, rand, out)
    return out


def _verify_random(logits, drafts, params, generators, starts, rand, out) -> None:
    dev = logits.device
    rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=dev) for i in rand])
    probs = _filtered_probs(logits[rows], [params[i] for i in rand
                                           for _ in range(len(drafts[i]) + 1)])
    # p(d) of every draft token, against a uniform draw each from the sequence's own generator
    offsets, chances, draws = [0], [], []
    for i in rand:
        k = len(drafts[i])
        offsets.append(offsets[-1] + k + 1)
        if k:
            at = torch.arange(offsets[-2], offsets[-2] + k, device=dev)
            chances.append(probs[at, torch.tensor(drafts[i], device=dev)])
            draws.append(torch.rand(k, generator=generators[i], device=dev, dtype=probs.dtype))
    accept = (torch.cat(draws) < torch.cat(chances)).tolist() if chances else []
    final_rows, rejected, pos = [], [], 0
    for j, i in enumerate(rand):
        k = len(drafts[i])
        n = next((t for t in range(k) if not accept[pos + t]), k)
        pos += k
        out[i] = drafts[i][:n]
        final_rows.append(offsets[j] + n)
        rejected.append(drafts[i][n] if n < k else None)
    final = probs[torch.tensor(final_rows, device=dev)]
    for r, tok in enumerate(rejected):
        if tok is not None:             # the residual (p - q)+ of a one-hot draft q: p without d
            final[r, tok] = 0.0
    tokens = _race(final, [generators[i] for i in rand]).tolist()
    for i, tok in zip(rand, tokens):
        out[i].append(tok)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=dev).unsqueeze(1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest head whose mass reaches top_p: drop a token when the mass *before* it
    # already reaches p. The first token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, device=dev, dtype=probs.dtype).unsqueeze(1)
    drop |= mass_before >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def stop_token_reason(token_id: int, num_output: int, params: SamplingParams,
                      eos_ids: set[int] | frozenset[int]) -> str | None:
    """Why generation stops after `token_id` (the `num_output`-th output token), or None."""
    if not params.ignore_eos and token_id in eos_ids:
        return "stop"
    if token_id in params.stop_token_ids:
        return "stop"
    if num_output >= params.max_tokens:
        return "length"
    return None


def find_stop_string(text: str, stop: list[str], start: int = 0) -> int:
    """Index in `text` where the earliest stop string begins (searching from `start`), or -1."""
    best = -1
    for s in stop:
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
