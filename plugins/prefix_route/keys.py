"""A request's prefix keys, as every prefix_route piece reads them: computed once per request.

Over token ids (prerender's `ctx.tokens`, or a /v1/completions prompt given as ids) the keys
are the engine's own block-hash chain; without them, or when a dynamic value sits inside the
prompt where token ids cannot be cut, a chain over the canonical text rendering (of a Messages
request: of the chat request vLLM makes of it), cut at the first dynamic value (`dynamic_cut`).
A prompt shorter than one block still gets a `short` key. A request carrying vLLM's
`cache_salt` (its tenant's: proxy/isolation.py) chains from the salted root, as the engine
does (`salted_root`; the text chain from `text_root`), so two tenants' equal prompts get
unrelated keys and the KV-event index's salted blocks match. The ring position mixes the
request's model into a key, so two models — a base model and its LoRA adapter, whose KV blocks
differ — never share a home.
"""
from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

import xxhash

from prefixgate.common.block_hash import block_hash_chain, salted_root
from prefixgate.plugins.prefix_keys import (
    DynamicSpans,
    byte_hash_chain,
    prompt_body,
    prompt_token_ids,
    render,
    render_parts,
    tail_hash,
    text_root,
)

STATE_KEY = "prefix_route"          # where a request's Keys are kept (ctx.state)


@dataclass(slots=True)
class Keys:
    mode: str                 # "tokens" or "text"
    chain: list[int]          # chained block hashes, at most max_blocks
    short: int | None         # a key for a prompt without one full block (None: no key)
    cut: bool                 # the text chain stops at a dynamic value
    matched: dict | None = None   # cache_aware: upstream name -> leading blocks it holds


class PrefixKeys:
    """The keys of a request under prefix_route's settings (`block_tokens`, `block_bytes`,
    `max_blocks`, `prefix_blocks`, `dynamic_cut`)."""

    def __init__(self, cfg: dict):
        self.block_tokens = cfg["block_tokens"]
        self.block_bytes = cfg["block_bytes"]
        self.max_blocks = cfg["max_blocks"]
        self.prefix_blocks = cfg["prefix_blocks"]
        self.dynamic_cut = cfg["dynamic_cut"]
        self._spans: DynamicSpans | None = None

    def of(self, ctx) -> Keys:
        """The request's keys, computed on first use."""
        keys = ctx.state.get(STATE_KEY)
        if keys is None:
            keys = ctx.state[STATE_KEY] = self._compute(ctx)
        return keys

    def route_key(self, keys: Keys) -> int | None:
        """The hash of the prompt's first `prefix_blocks` blocks (or of its only, partial one)."""
        if keys.chain:
            return keys.chain[min(self.prefix_blocks, len(keys.chain)) - 1]
        return keys.short

    def _compute(self, ctx) -> Keys:
        spans = self._dynamic_spans(ctx)
        tokens = ctx.tokens if ctx.tokens is not None else prompt_token_ids(ctx.body)
        body = prompt_body(ctx.path, ctx.body) if tokens is None or spans else ctx.body
        salt = ctx.cache_salt
        if tokens is not None and not (spans and _has_dynamic(body, spans)):
            bt = self.block_tokens
            root = salted_root(salt)
            if ctx.block_hashes is not None and ctx.block_tokens == bt and not salt:
                chain = ctx.block_hashes[:self.max_blocks]     # already hashed (prerender)
            else:       # (prerender's hashes are unsalted: they are shared by its cache)
                chain = block_hash_chain(tokens, bt, self.max_blocks, parent=root)
                ctx.block_hashes, ctx.block_tokens = chain, bt
            short = (tail_hash([], array("q", tokens).tobytes(), root)
                     if not chain and tokens else None)
            return Keys("tokens", chain, short, False)
        # No tokens, or a dynamic value the token ids cannot be cut at: key on the text.
        data, cut = render(body, spans)
        root = text_root(salt)
        chain = byte_hash_chain(data, self.block_bytes, self.max_blocks, root)
        short = tail_hash([], data, root) if not chain and data else None
        return Keys("text", chain, short, cut)

    def _dynamic_spans(self, ctx) -> DynamicSpans | None:
        if self.dynamic_cut == "never":
            return None
        if self.dynamic_cut == "auto" and ctx.normalized:
            return None             # normalize moved the dynamic values out already
        if self._spans is None:
            self._spans = DynamicSpans()
        return self._spans


def _has_dynamic(body: dict, spans: DynamicSpans) -> bool:
    return any(spans.first(p) >= 0 for p in render_parts(body))


@functools.lru_cache(maxsize=1024)
def _model_salt(model: str) -> int:
    return xxhash.xxh64_intdigest(model.encode("utf-8", "surrogatepass"))


def ring_position(key: int, model: str | None) -> int:
    """Where a prefix key sits on the ring for `model`: the same prompt to two models lands
    on unrelated homes (None: the key itself)."""
    return key if model is None else key ^ _model_salt(model)
