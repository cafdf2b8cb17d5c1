"""Sampling: per-request parameters, the batched sampler, and the stop checks.

A batch mixes greedy and random requests. Greedy rows take the argmax; random rows are scaled
by their temperature, cut by top-k and top-p, and drawn with the exponential-race trick
(argmax of p / Exp(1) noise) so one batched op samples every row while each row's noise can
still come from its own seeded generator.
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
        noise = torch.empty_like(probs)
        for j, i in enumerate(rand_rows):
            noise[j].exponential_(generator=generators[i])
        tokens[idx] = probs.div_(noise).argmax(dim=-1)
    return tokens.tolist()


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
