"""A synthetic request trace with the prefix structure of real LLM traffic.

Four kinds of request, drawn per arrival (fractions of requests):

    chat   multi-turn sessions: a Zipf-popular system prompt, then user/assistant turns; each
           turn's prompt is the whole history so far (so it extends the previous turn's)
    rag    a RAG system prompt + a Zipf-popular document + a short question
    oneshot  a Zipf-popular system prompt + one user message
    long   a very long, unique prompt (a code base, a book chapter)

Open loop: arrivals are Poisson; a session's next turn comes a think time after the previous
one arrived. Token ids are random (a vocabulary of 32k), so only the structure is realistic;
the prefix chain of every prompt is computed incrementally (a turn continues the chain of
the history before it), which keeps 100k requests cheap to generate.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

import numpy as np

from prefixgate.common.block_hash import ROOT_HASH, block_hash_chain

POOL = 1 << 23     # token ids drawn once; segments start at random offsets in it


@dataclass
class TraceConfig:
    requests: int = 100_000
    rate: float = 50.0              # arrivals per second (new sessions count their first turn)
    seed: int = 0
    block_tokens: int = 16
    vocab: int = 32_000
    mix: tuple = (("chat", 0.30), ("rag", 0.25), ("oneshot", 0.44), ("long", 0.01))
    system_prompts: int = 200       # distinct chat/oneshot system prompts
    system_zipf: float = 1.1
    system_tokens: tuple = (200, 3000)
    rag_prompts: int = 4
    docs: int = 3000
    doc_zipf: float = 0.9
    doc_tokens: tuple = (500, 4000)
    turns_mean: float = 4.0         # geometric number of turns per session
    think_s: float = 30.0           # mean time between a session's turns
    user_tokens: tuple = (20, 400)
    output_tokens: tuple = (30, 500)
    long_tokens: tuple = (16_000, 32_000)


@dataclass(slots=True)
class Request:
    t: float
    kind: str
    tokens: np.ndarray              # int64 token ids
    chain: list[int]                # block hashes of the prompt's full blocks
    output: np.ndarray
    history_chain: list[int] | None = None   # chat: chain of prompt + output (next turn's head)


@dataclass(order=True)
class _Next:
    t: float
    n: int
    session: object = field(compare=False)


class _Session:
    __slots__ = ("history", "chain", "turns_left")

    def __init__(self, history, chain, turns_left):
        self.history, self.chain, self.turns_left = history, chain, turns_left


class SyntheticTrace:
    """The synthetic trace of a TraceConfig (module doc): iterates its Requests in arrival
    order."""

    def __init__(self, cfg: TraceConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.py = random.Random(cfg.seed)
        self.pool = self.rng.integers(0, cfg.vocab, POOL)
        bt = cfg.block_tokens
        self.systems = [self._segment(*cfg.system_tokens) for _ in range(cfg.system_prompts)]
        self.system_chains = [block_hash_chain(s, bt) for s in self.systems]
        self.system_cdf = _zipf_cdf(cfg.system_prompts, cfg.system_zipf)
        self.rags = [self._segment(150, 600) for _ in range(cfg.rag_prompts)]
        self.docs: dict[int, list[int]] = {}
        self.doc_cdf = _zipf_cdf(cfg.docs, cfg.doc_zipf)
        self.rag_chains: dict[tuple[int, int], list[int]] = {}
        kinds, p = zip(*cfg.mix)
        self.kinds, self.kind_cdf = list(kinds), np.cumsum(p) / sum(p)

    def _draw(self, cdf: np.ndarray) -> int:
        return min(int(np.searchsorted(cdf, self.py.random(), side="right")), len(cdf) - 1)

    def _segment(self, lo: int, hi: int) -> np.ndarray:
        """Random token ids, of log-uniform length: a view into one pre-drawn pool (drawing
        each segment anew costs more than everything else the trace does)."""
        n = int(math.exp(self.py.uniform(math.log(lo), math.log(hi))))
        start = self.py.randrange(len(self.pool) - n)
        return self.pool[start:start + n]

    def __iter__(self):
        cfg, rng = self.cfg, self.rng
        pending: list[_Next] = []          # sessions' next turns
        t, made, n = 0.0, 0, 0
        next_arrival = self.py.expovariate(cfg.rate)
        while made < cfg.requests:
            if pending and pending[0].t <= next_arrival:
                nxt = heapq.heappop(pending)
                req = self._turn(nxt.t, nxt.session)
            else:
                t = next_arrival
                next_arrival = t + self.py.expovariate(cfg.rate)
                kind = self.kinds[self._draw(self.kind_cdf)]
                if kind == "chat":
                    i = self._draw(self.system_cdf)
                    turns = int(rng.geometric(1 / cfg.turns_mean))   # >= 1
                    nxt_session = _Session(self.systems[i], self.system_chains[i], turns)
                    req = self._turn(t, nxt_session)
                else:
                    req = getattr(self, "_" + kind)(t)
            if req.kind == "chat" and req.history_chain is not None:
                s = req.history_chain_session
                if s.turns_left > 0:
                    n += 1
                    heapq.heappush(pending, _Next(req.t + self.py.expovariate(1 / cfg.think_s),
                                                  n, s))
            made += 1
            yield req

    # --- request kinds ----------------------------------------------------------------------
    def _turn(self, t: float, s: _Session) -> Request:
        bt = self.cfg.block_tokens
        prompt = np.concatenate((s.history, self._segment(*self.cfg.user_tokens)))
        chain = _continue(s.chain, prompt, bt)
        output = self._segment(*self.cfg.output_tokens)
        history = np.concatenate((prompt, output))
        s.history, s.chain = history, _continue(chain, history, bt)
        s.turns_left -= 1
        req = _ChatRequest(t, "chat", prompt, chain, output, s.chain)
        req.history_chain_session = s
        return req

    def _rag(self, t: float) -> Request:
        r = self.py.randrange(len(self.rags))
        d = self._draw(self.doc_cdf)
        if d not in self.docs:
            self.docs[d] = self._segment(*self.cfg.doc_tokens)
        head = np.concatenate((self.rags[r], self.docs[d]))
        key = (r, d)
        if key not in self.rag_chains:
            self.rag_chains[key] = block_hash_chain(head, self.cfg.block_tokens)
        prompt = np.concatenate((head, self._segment(15, 120)))
        return Request(t, "rag", prompt, _continue(self.rag_chains[key], prompt,
                                                   self.cfg.block_tokens),
                       self._segment(*self.cfg.output_tokens))

    def _oneshot(self, t: float) -> Request:
        i = self._draw(self.system_cdf)
        prompt = np.concatenate((self.systems[i], self._segment(*self.cfg.user_tokens)))
        return Request(t, "oneshot", prompt, _continue(self.system_chains[i], prompt,
                                                       self.cfg.block_tokens),
                       self._segment(*self.cfg.output_tokens))

    def _long(self, t: float) -> Request:
        prompt = self._segment(*self.cfg.long_tokens)
        return Request(t, "long", prompt, block_hash_chain(prompt, self.cfg.block_tokens),
                       self._segment(*self.cfg.output_tokens))


@dataclass(slots=True)
class _ChatRequest(Request):
    history_chain_session: object = None


def _continue(head_chain: list[int], tokens: list[int], bt: int) -> list[int]:
    """The chain of `tokens`, reusing `head_chain` (the chain of a prefix of `tokens`)."""
    nb = min(len(head_chain), len(tokens) // bt)
    parent = head_chain[nb - 1] if nb else ROOT_HASH
    return head_chain[:nb] + block_hash_chain(tokens[nb * bt:], bt, parent=parent)


def _zipf_cdf(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    return np.cumsum(w) / w.sum()
