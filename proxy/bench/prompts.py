"""Prompts of a fixed length in tokens for `prefixgate bench`.

A prompt of tier T tokens is a system message (the first `shared` fraction of T, the same for
every request of the tier, optionally headed by a per-request timestamp) plus a user message
(the rest, different for every request from its first word). With the target's tokenizer the
lengths are exact; without one a common English word counts as one token, which holds within
a few percent for the BPE vocabularies of current models.
"""
from __future__ import annotations

import datetime as dt
import json
import random
from dataclasses import dataclass, field

# Common English words that are one token in GPT-2/Llama/Qwen-style BPE vocabularies.
WORDS = (
    "the of and to in is was for on as with by he at from his an were are which this be or "
    "had not but first one their its new after who they have her she two been other when there "
    "all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "between since part well also team under year three called being second season people "
    "film before while series both early through including became government several along "
    "four game day north back work life like high south place five house year number system "
    "group music name river family public around area water power land short line open road "
    "light small field point story order white local church court black given major book "
    "party great free list week home army still water form case rule data plan left next "
    "word body king tree fire door sign rock bird fish ship star moon rain snow wind gold"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Lengths:
    """Counts tokens exactly (a `Tokenizer` from prefixgate.common.tokenizer) or roughly."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.exact = tokenizer is not None

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text))
        return len(text.split())

    def text(self, rng: random.Random, n: int) -> str:
        """About `n` tokens of words; exactly `n` with a tokenizer (a few draws at most)."""
        if n <= 0:
            return ""
        if self.tokenizer is None:
            return words(rng, n)
        for _ in range(16):
            # decoding the first n ids can re-encode to n + 1: the first word loses its
            # leading space and some words are two tokens without it ("army" = "arm" "y")
            ids = self.tokenizer.encode(" " + words(rng, n + n // 2 + 8))[:n]
            text = self.tokenizer.decode(ids).strip()
            if self.count(text) == n:
                break
        return text

    def chat_overhead(self, tools: list | None = None) -> int:
        """Tokens around the text of a system + user message: the chat template's (when
        known) and the tool definitions'."""
        tool_tokens = self.count(json.dumps(tools)) if tools else 0
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return tool_tokens
        try:
            empty = self.tokenizer.apply_chat_template(
                [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
                tools=tools or None)
        except ValueError:
            return tool_tokens
        return self.count(empty)


def timestamp_line(now: dt.datetime | None = None) -> str:
    """The per-request head that breaks prefix caching: the current time, to the microsecond."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"Current time: {now.strftime('%Y-%m-%d %H:%M:%S.%f')} UTC\n"


@dataclass
class PromptSpec:
    tokens: int                    # the whole prompt, template included when it is known
    shared: float = 0.0            # fraction of it that is the same for every request
    dynamic_head: bool = False     # a timestamp at the head of the system prompt
    tools: list = field(default_factory=list)    # tool definitions sent with every request
    seed: int = 0
    salt: str = ""                 # varies the per-request part only (one per bench run)


class PromptSet:
    """Request bodies for one tier: `body(i)` is request i's messages (and tools)."""

    def __init__(self, spec: PromptSpec, lengths: Lengths):
        self.spec, self.lengths = spec, lengths
        # the per-request part is the last (1 - shared) of the prompt; all before it (template,
        # tools, timestamp, system text) is the same for every request but the timestamp
        budget = spec.tokens - lengths.chat_overhead(spec.tools)
        self.unique_tokens = max(1, min(round(spec.tokens * (1.0 - spec.shared)), budget - 1))
        head_tokens = lengths.count(timestamp_line()) if spec.dynamic_head else 0
        system_tokens = max(budget - self.unique_tokens - head_tokens, 0)
        self.system = lengths.text(random.Random(f"{spec.seed}:{spec.tokens}:system"),
                                   system_tokens)

    def body(self, i: int) -> dict:
        rng = random.Random(f"{self.spec.seed}:{self.spec.tokens}:{self.spec.salt}:{i}")
        system = (timestamp_line() if self.spec.dynamic_head else "") + self.system
        messages = [{"role": "user", "content": self.lengths.text(rng, self.unique_tokens)}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        body = {"messages": messages}
        if self.spec.tools:
            body["tools"] = self.spec.tools
        return body

    def measured_tokens(self, body: dict) -> int:
        """The prompt length of `body` as this builder counts it (for the archive)."""
        tok = self.lengths.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            try:
                return self.lengths.count(tok.apply_chat_template(body["messages"],
                                                                  tools=body.get("tools")))
            except ValueError:
                pass
        text = " ".join(m["content"] for m in body["messages"])
        return self.lengths.count(text) + (
            self.lengths.count(json.dumps(body["tools"])) if body.get("tools") else 0)


def load_tokenizer(path: str | None):
    """`--tokenizer DIR` (or a .gguf file, or a built-in model's name: smollm2, demo): a
    Tokenizer, or None for approximate lengths."""
    if not path:
        return None
    from prefixgate.backend.config import resolve_tokenizer
    from prefixgate.common.tokenizer import Tokenizer
    return Tokenizer.load(resolve_tokenizer(path))
