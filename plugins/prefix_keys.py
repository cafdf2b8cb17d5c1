"""Prefix keys: a prompt as a chain of block hashes, the way a paged-KV prefix cache sees it.

Block i's hash is `xxh64(hash of block i-1, block i's content)`, so one hash names the
whole prefix up to the end of its block, and two prompts share the hashes of exactly the
blocks they share from the start. Only full blocks get a hash (a KV cache only reuses full
blocks). Over token ids the chain is the engine's own (`prefixgate.common.block_hash`), so a
router's keys equal the engine's cache keys.

Without a tokenizer the chain runs over the bytes of a canonical rendering of the request
(tools, then each message's role and content, in order); a Messages request (`/v1/messages`)
is rendered as the chat request vLLM makes of it (`prompt_body`), so its `system` leads. A
per-request value — a timestamp, a request id — changes the hash of every block after it, so
unless `normalize` has moved such values to the tail, the chain is cut at the first one
(`dynamic_offset`).
"""
from __future__ import annotations

import json

import xxhash

from prefixgate.common.anthropic_messages import to_chat
from prefixgate.common.block_hash import chain_bytes, salted_root
from prefixgate.proxy.lru import LRU

# parent of a text chain's first block: never equal to a token chain's
TEXT_ROOT = 0x7072_6566_6978_7478
MESSAGES_PATH = "/v1/messages"      # Anthropic's Messages API


def prompt_body(path: str, body: dict) -> dict:
    """The body whose prompt the keys describe: a Messages request's as the chat request vLLM
    makes of it (common/anthropic_messages.py), any other request's as it is."""
    return to_chat(body) if path == MESSAGES_PATH else body


def text_root(cache_salt: str | None) -> int:
    """The parent of a text chain's first block under vLLM's `cache_salt` (None: TEXT_ROOT):
    two tenants' equal prompts get unrelated keys, as the engine gives them unrelated blocks."""
    if not cache_salt:
        return TEXT_ROOT
    return xxhash.xxh64_intdigest(TEXT_ROOT.to_bytes(8, "little")
                                  + salted_root(cache_salt).to_bytes(8, "little"))


def byte_hash_chain(data: bytes, block_bytes: int, max_blocks: int | None = None,
                    root: int = TEXT_ROOT) -> list[int]:
    """The block-hash chain over bytes (the text fallback when no tokenizer is configured);
    `root`: the first block's parent (`text_root` of a salted request)."""
    n = len(data) // block_bytes
    if max_blocks is not None:
        n = min(n, max_blocks)
    return chain_bytes(data, block_bytes, n, root)


def tail_hash(chain: list[int], rest: bytes, root: int = TEXT_ROOT) -> int:
    """A key for a prompt shorter than one block: its bytes, chained after its full blocks
    (or after `root`)."""
    return xxhash.xxh64_intdigest((chain[-1] if chain else root).to_bytes(8, "little") + rest)


# --- the canonical rendering -----------------------------------------------------------------
FIELD, RECORD = "\x1f", "\x1e"     # unit / record separators: cannot be confused with content


def render_parts(body: dict) -> list[str]:
    """The request's prompt-bearing parts in prompt order: tools, then each message."""
    parts = []
    tools = body.get("tools")
    if tools:
        tools_json = json.dumps(tools, sort_keys=True, ensure_ascii=False)
        parts.append("tools" + FIELD + tools_json + RECORD)
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}{FIELD}{content_text(m)}{RECORD}")
        return parts
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]          # a batch goes to one upstream: key it on its first prompt
    if isinstance(prompt, str):
        parts.append(prompt)
    return parts


def content_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(p.get("text", "") if isinstance(p, dict) and p.get("type") == "text"
                       else json.dumps(p, sort_keys=True, ensure_ascii=False) for p in content)
    else:
        text = ""
    if message.get("tool_calls"):
        text += FIELD + json.dumps(message["tool_calls"], sort_keys=True, ensure_ascii=False)
    return text


def prompt_token_ids(body: dict) -> list[int] | None:
    """A /v1/completions prompt given as token ids is already the token sequence."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


# --- dynamic spans ---------------------------------------------------------------------------
class DynamicSpans:
    """Finds the first per-request value in a text, with the normalize plugin's detectors.

    Results are cached by the text's hash: a system prompt repeats across requests, so the
    detector runs once per distinct text.
    """

    def __init__(self, cache_size: int = 1024):
        from prefixgate.plugins.normalize.detectors import Detector, code_spans, tokens
        self._detector, self._code_spans, self._tokens = Detector(), code_spans, tokens
        self._cache: LRU[int, int] = LRU(cache_size)

    def first(self, text: str) -> int:
        """Offset of the first dynamic value in `text`, or -1."""
        key = xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        code = self._code_spans(text)
        found = self._detector.find(text, self._tokens(text, code), code)
        offset = found[0].start if found else -1
        self._cache.put(key, offset)
        return offset


def render(body: dict, spans: DynamicSpans | None) -> tuple[bytes, bool]:
    """The canonical rendering as UTF-8, cut before the first dynamic value when `spans` is
    given; the flag says whether it was cut."""
    out = []
    for part in render_parts(body):
        cut = spans.first(part) if spans is not None else -1
        if cut >= 0:
            out.append(part[:cut])
            return "".join(out).encode("utf-8", "surrogatepass"), True
        out.append(part)
    return "".join(out).encode("utf-8", "surrogatepass"), False
