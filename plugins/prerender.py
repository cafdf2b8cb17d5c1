"""Plugin `prerender`: render the chat template and tokenize in the gateway, caching the prefix.

Every chat request is rendered with its model's own chat template (`prefixgate.common.tokenizer`,
jinja2 sandbox, HF semantics) and tokenized, so the router can key on the exact token blocks
the engine's prefix cache will see (`ctx.tokens`, `ctx.block_hashes`, `ctx.block_tokens`).
The tokenizer is the request's model's: `models.<name>.tokenizer` for `ctx.model`, else the
`*` entry's (or the single `model.tokenizer`), else — for a request naming no model — the only
entry there is (`proxy.config.model_settings`). One tokenizer and prefix cache per entry, all
loaded at start-up; a request whose model has no tokenizer passes through untouched. A
Messages request (`/v1/messages`) is rendered as vLLM renders it: the chat request vLLM makes
of it, shaped as vLLM's chat path hands it to the template (`messages_chat`).

Tokenizing a 10k-token system prompt on every request would cost milliseconds, so the static
prefix — the leading system messages and the tools — is rendered and tokenized once and
cached by its xxhash. A later request with the same prefix renders the conversation, checks
that the rendering still starts with the cached prefix text, and tokenizes only the tail.

Where to split matters: BPE merges across any boundary in plain text, so the prefix is cut
right after the last special token (`<|im_end|>`, `<|eot_id|>`…) of its own rendering; text
on either side of a special token is tokenized independently. The split is also verified
once per prefix (prefix ids + tail ids == ids of the whole), and a prefix whose split does
not verify is never served split.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import xxhash
from prometheus_client import Counter

from prefixgate.common import anthropic_messages, sse
from prefixgate.common.anthropic_messages import to_chat
from prefixgate.common.block_hash import ROOT_HASH, block_hash_chain
from prefixgate.common.schema import ConfigError, Key, non_negative, positive
from prefixgate.plugins.prefix_keys import MESSAGES_PATH, prompt_token_ids
from prefixgate.proxy.config.gateway import ANY_MODEL
from prefixgate.proxy.lru import LRU
from prefixgate.proxy.plugin import Plugin

PREFIX_ROLES = ("system", "developer")
WARM_KEY = "prerender.warm"      # ctx.state: the Conversation whose next turn is warmed
# what the engine sets itself: a request's chat_template_kwargs cannot override these
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                   "documents", "chat_template", "tokenize")
log = logging.getLogger(__name__)


def flatten(message):
    """Text content parts joined into one string, as the bundled engine does before it
    renders (templates expect strings); anything else is left for the template to judge."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return {**message, "content": "".join(p["text"] for p in content)}
    return message


def special_strings(tok) -> list[str]:
    """The special tokens' texts: the only safe places to split a rendered prompt."""
    out = set()
    inner = getattr(tok, "_tok", None)     # the wrapped tokenizers.Tokenizer
    if inner is not None and hasattr(inner, "get_added_tokens_decoder"):
        out.update(t.content for t in inner.get_added_tokens_decoder().values() if t.special)
    for v in getattr(tok, "special_tokens", {}).values():
        out.update([v] if isinstance(v, str) else [x for x in v if isinstance(x, str)])
    return sorted((s for s in out if s), key=len, reverse=True)


def gil_free_encoder(tok, min_chars: int = 4096):
    """`tok.encode`, except that long texts go through `encode_batch`, which releases the GIL
    while it works (plain `encode` holds it): a long tokenization in a worker thread then no
    longer stalls the event loop. Same ids either way."""
    inner = getattr(tok, "_tok", None)      # the wrapped tokenizers.Tokenizer
    if inner is None or not hasattr(inner, "encode_batch"):
        return tok.encode

    def encode(text: str) -> list[int]:
        if len(text) < min_chars:
            return tok.encode(text)
        return inner.encode_batch([text], add_special_tokens=False)[0].ids
    return encode


@dataclass(slots=True)
class Prefix:
    text: str                  # rendered prefix, cut after its last special token ("" = no split)
    ids: list[int]
    hashes: list[int]          # chain over the prefix's full blocks


@dataclass(slots=True)
class Rendered:
    text: str
    tokens: list[int]
    block_hashes: list[int]
    cache: str                 # "hit", "miss", "unsplittable" or "none"
    cached: int = 0            # leading tokens that came from the prefix cache


class PromptCache:
    """The pure part: messages (+ tools) → rendered prompt, token ids, block hashes."""

    def __init__(self, tokenizer, block_tokens: int = 16, max_entries: int = 256):
        self.tok = tokenizer
        self.block_tokens = block_tokens
        self.max_entries = max_entries
        self.specials = special_strings(tokenizer)
        self.encode = gil_free_encoder(tokenizer)
        self.entries: LRU[int, Prefix] = LRU(max_entries)
        self._merge_inline_system: bool | None = None     # probed once (Messages)
        self._disabled_thinking_effort: str | None = None

    @property
    def merge_inline_system(self) -> bool:
        """Does this template need its system messages first (vLLM's probe, once)?"""
        if self._merge_inline_system is None:
            self._merge_inline_system = needs_system_first(self.tok)
        return self._merge_inline_system

    @property
    def disabled_thinking_effort(self) -> str:
        """The reasoning_effort vLLM renders `thinking: {type: disabled}` with (probed once)."""
        if self._disabled_thinking_effort is None:
            self._disabled_thinking_effort = disabled_thinking_effort(self.tok)
        return self._disabled_thinking_effort

    @staticmethod
    def prefix_len(messages: list) -> int:
        n = 0
        while n < len(messages) and isinstance(messages[n], dict) and \
                messages[n].get("role") in PREFIX_ROLES:
            n += 1
        return n

    def key(self, messages: list, n: int, tools, kwargs: dict) -> int:
        """xxhash of what the prefix rendering depends on: the prefix messages, tools, options."""
        h = xxhash.xxh3_64()
        for m in messages[:n]:
            content = m.get("content")
            if len(m) == 2 and isinstance(m.get("role"), str):    # the common {role, content}
                h.update(m["role"].encode())
            else:
                h.update(json.dumps({k: v for k, v in m.items() if k != "content"},
                                    sort_keys=True).encode())
            h.update(b"\x1f")
            h.update(content.encode("utf-8", "surrogatepass") if isinstance(content, str)
                     else json.dumps(content, sort_keys=True).encode())
            h.update(b"\x1e")
        if tools or kwargs:
            h.update(json.dumps([tools, kwargs], sort_keys=True).encode())
        return h.intdigest()

    def lookup(self, messages: list, tools=None, kwargs: dict | None = None):
        """(prefix message count, cache key, cached prefix or None) for a request."""
        n = self.prefix_len(messages)
        if n == 0 and not tools:
            return 0, None, None
        key = self.key(messages, n, tools, kwargs or {})
        return n, key, self.entries.peek(key)     # render() touches a hit's recency

    def render(self, messages: list, tools=None, add_generation_prompt: bool = True,
               kwargs: dict | None = None, looked=None) -> Rendered:
        kwargs = kwargs or {}
        full = self.tok.apply_chat_template(messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt, **kwargs)
        n, key, entry = looked or self.lookup(messages, tools, kwargs)
        if key is None:
            return self._whole(full, "none")
        if entry is not None:
            self.entries.move_to_end(key)
            if entry.text and full.startswith(entry.text):
                return self._split(full, entry)
            if not entry.text:
                return self._whole(full, "unsplittable")
        return self._learn(key, full, messages[:n], tools, kwargs)

    def _whole(self, full: str, how: str) -> Rendered:
        ids = self.encode(full)
        return Rendered(full, ids, block_hash_chain(ids, self.block_tokens), how)

    def _split(self, full: str, entry: Prefix) -> Rendered:
        tail = self.encode(full[len(entry.text):])
        ids = entry.ids + tail
        done = len(entry.hashes) * self.block_tokens
        parent = entry.hashes[-1] if entry.hashes else ROOT_HASH
        return Rendered(full, ids, entry.hashes + block_hash_chain(
            ids[done:], self.block_tokens, parent=parent), "hit",
                        len(entry.ids))

    def _learn(self, key: int, full: str, prefix_msgs: list, tools, kwargs) -> Rendered:
        """A miss: tokenize the whole prompt, and cache the prefix if its split verifies."""
        whole = self._whole(full, "miss")
        entry = Prefix("", [], [])
        text = self._prefix_text(prefix_msgs, tools, kwargs)
        if text and full.startswith(text):
            ids = self.encode(text)
            if whole.tokens[:len(ids)] == ids and \
                    self.encode(full[len(text):]) == whole.tokens[len(ids):]:
                nb = len(ids) // self.block_tokens
                entry = Prefix(text, ids, whole.block_hashes[:nb])
        if not entry.text:
            whole.cache = "unsplittable"
        self.entries.put(key, entry)
        return whole

    def _prefix_text(self, prefix_msgs: list, tools, kwargs) -> str:
        """The prefix's own rendering, cut right after its last special token."""
        try:
            text = self.tok.apply_chat_template(prefix_msgs, tools=tools,
                                                add_generation_prompt=False, **kwargs)
        except ValueError:           # e.g. a template that insists on a user turn
            return ""
        cut = max((text.rfind(s) + len(s) for s in self.specials if s in text), default=0)
        return text[:cut]


# --- Anthropic Messages: the chat request vLLM renders of a /v1/messages request -------------
# vLLM (entrypoints/anthropic/serving.py, 0.32) converts the request to a chat request
# (common/anthropic_messages.to_chat), and its chat path shapes the messages before the template
# sees them (renderers/chat_utils.py, "string" content format): text parts joined with "\n", a
# missing content "", a tool call's JSON `arguments` parsed into a mapping (not one: {}), a tool
# message's text parts joined with "\n"; the tools go as to_chat makes them (vLLM's dump of
# its tool models).
EFFORTS = ("low", "medium", "high", "xhigh", "max")     # Anthropic's output_config.effort


def needs_system_first(tok) -> bool:
    """Does this tokenizer's chat template need inline system messages merged into the leading
    one? vLLM's probe (common/anthropic_messages.needs_system_first)."""
    return anthropic_messages.needs_system_first(getattr(tok, "chat_template", None))


def disabled_thinking_effort(tok) -> str:
    """vLLM's `_probe_disabled_thinking_effort`: "none", unless the template rejects it or
    renders it as one of the efforts (it ignores it): then "low"."""
    def render(effort: str) -> str | None:
        try:
            return tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           reasoning_effort=effort,
                                           enable_thinking=effort != "none")
        except ValueError:
            return None
    none = render("none")
    if none is None or any(render(e) == none for e in EFFORTS):
        return "low"
    return "none"


def messages_chat(body: dict, cache: PromptCache) -> tuple[list, list | None, dict] | None:
    """(messages, tools, template kwargs) as vLLM renders the Messages request `body` (None:
    a shape vLLM would not render as text, e.g. an image)."""
    chat = to_chat(body, cache.merge_inline_system)
    messages = vllm_conversation(chat["messages"])
    if messages is None:
        return None
    tools = chat.get("tools")
    user = chat.get("chat_template_kwargs")
    kwargs = template_kwargs(user)
    effort = None
    output = body.get("output_config")
    if isinstance(output, dict) and output.get("effort") is not None:
        effort = output["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = cache.disabled_thinking_effort
    if effort is not None:         # vLLM's build_chat_params
        kwargs["reasoning_effort"] = effort
        if not (isinstance(user, dict) and "enable_thinking" in user):
            kwargs["enable_thinking"] = effort != "none"
    return messages, tools, kwargs


def template_kwargs(kwargs) -> dict:
    """A request's chat_template_kwargs less what the engine sets itself."""
    if not isinstance(kwargs, dict):
        return {}
    return {k: v for k, v in kwargs.items() if k not in RESERVED_KWARGS}


def vllm_conversation(messages: list) -> list | None:
    """Chat messages as vLLM's chat path hands them to the template (section note)."""
    out = []
    for m in messages:
        text = _joined_text(m.get("content"))
        if text is None:
            return None
        msg = {"role": m["role"], "content": text}
        if m["role"] == "assistant":
            calls = m.get("tool_calls")
            if calls:
                msg["tool_calls"] = [_parsed_call(c) for c in calls]
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif m["role"] == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def _joined_text(content) -> str | None:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         for p in content):
        return "\n".join(p.get("text") or "" for p in content)
    return None


def _parsed_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


class Prerender(Plugin):
    name = "prerender"
    spec = {
        "block_tokens": Key(int, 16, positive),        # the engine's KV block size
        "cache_entries": Key(int, 256, positive),      # distinct prefixes remembered per model
        "inline_chars": Key(int, 8192, non_negative),  # larger uncached work goes to a thread
        "warm_next_turn": Key(bool, False),            # warm the history for the next turn
        "warm_answer_bytes": Key(int, 1 << 20, positive),   # longer streamed answers: not warmed
    }
    # a chat's token ids and their block-hash chain: the keys the engine's prefix cache uses
    provides = frozenset({"tokens", "block_tokens", "block_hashes"})

    def __init__(self, cfg, gw):
        super().__init__(cfg, gw)
        from prefixgate.backend.config import resolve_tokenizer
        from prefixgate.common.tokenizer import Tokenizer, TokenizerLoadError
        models = gw.config.get("models") or {}
        loaded: dict[str, object] = {}            # one Tokenizer per directory
        # every `models:` entry, with its PromptCache (None: that model has no tokenizer)
        self.caches: dict[str, PromptCache | None] = {}
        for name, entry in models.items():
            path = entry.get("tokenizer")
            if not path:
                self.caches[name] = None
                continue
            tok = loaded.get(path)
            if tok is None:
                try:
                    tok = loaded[path] = Tokenizer.load(resolve_tokenizer(path))
                except ConfigError as e:
                    raise ConfigError("", f"models.{name}.tokenizer: {e.reason}") from None
                except TokenizerLoadError as e:
                    raise ConfigError("", f"models.{name}.tokenizer: {e}") from None
            self.caches[name] = PromptCache(tok, self.cfg["block_tokens"],
                                            self.cfg["cache_entries"])
        if not loaded:
            raise ConfigError("", "needs `model.tokenizer` or `models.<name>.tokenizer` (a "
                                  "directory with tokenizer.json, a .gguf file, or a built-in "
                                  "model's name)")
        self._any = self.caches.get(ANY_MODEL)
        self._nameless = (next(iter(self.caches.values())) if len(self.caches) == 1
                          else self._any)
        reg = gw.registry
        self.lookups = Counter("prefixgate_prerender_prefix_cache", "Prompt prefix cache "
                               "lookups by result (hit, miss, unsplittable, none, error)",
                               ["result"], registry=reg)
        self.tokens = Counter("prefixgate_prerender_tokens", "Prompt tokens, by whether they "
                              "came from the prefix cache", ["source"], registry=reg)
        if self.cfg["warm_next_turn"]:      # hooks of their own: nothing on the path without
            self.on_chunk = self._keep_answer
            self.on_finish = self._warm_next_turn

    @property
    def cache(self) -> PromptCache:
        """The PromptCache a request naming no model uses (else the first one)."""
        return self._nameless or next(c for c in self.caches.values() if c is not None)

    def cache_for(self, model: str | None) -> PromptCache | None:
        """The request's model's PromptCache: its own entry's, else `*`'s; a request naming
        no model uses the only entry there is (`model_settings`). None: no tokenizer."""
        if model is None:
            return self._nameless
        caches = self.caches
        return caches[model] if model in caches else self._any

    async def on_request(self, ctx) -> None:
        cache = self.cache_for(ctx.model)
        if cache is None:
            return                   # this model has no tokenizer: the request goes on as it is
        body = ctx.body
        messages = body.get("messages")
        if isinstance(messages, list):
            anthropic = ctx.path == MESSAGES_PATH
            if anthropic:
                inputs = await self._maybe_thread(len(ctx.raw_body), messages_chat, body, cache)
                r = None if inputs is None else await self._render(ctx, cache, *inputs, True)
            else:
                r = await self._render(ctx, cache, [flatten(m) for m in messages],
                                       body.get("tools"),
                                       template_kwargs(body.get("chat_template_kwargs")),
                                       body.get("add_generation_prompt", True) is not False)
            if r is None:
                self.lookups.labels("error").inc()
                return
            ctx.tokens, ctx.block_hashes = r.tokens, r.block_hashes
            ctx.block_tokens = cache.block_tokens
            self.lookups.labels(r.cache).inc()
            if self.cfg["warm_next_turn"]:
                ctx.state[WARM_KEY] = Conversation(cache, body, [], anthropic)
            return
        ids = prompt_token_ids(body)
        prompt = body.get("prompt")
        if ids is None and isinstance(prompt, str):
            ids = await self._maybe_thread(len(prompt), cache.encode, prompt)
        if ids is not None:
            ctx.tokens = ids
            ctx.block_hashes = block_hash_chain(ids, cache.block_tokens)
            ctx.block_tokens = cache.block_tokens

    async def _render(self, ctx, cache: PromptCache, messages: list, tools, kwargs: dict,
                      add_generation_prompt: bool) -> Rendered | None:
        """The rendered request, or None when our rendering of it fails: the backend is the
        authority on what it accepts, so such a request goes on, only without tokens."""
        looked = cache.lookup(messages, tools, kwargs)
        entry = looked[2]
        size = sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str)
                   else 256 for m in messages) - (len(entry.text) if entry is not None else 0)
        try:
            r = await self._maybe_thread(size, cache.render, messages, tools,
                                         add_generation_prompt, kwargs, looked)
        except ValueError as e:      # ChatTemplateError
            log.debug("prerender: cannot render request %s: %s", ctx.request_id, e)
            return None
        self.tokens.labels("cache").inc(r.cached)
        self.tokens.labels("tokenized").inc(len(r.tokens) - r.cached)
        return r

    async def _maybe_thread(self, size: int, fn, *args, **kwargs):
        """Small work runs inline (a thread hop costs more); large uncached work runs in a
        thread so the event loop keeps streaming other requests' tokens."""
        if size <= self.cfg["inline_chars"]:
            return fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

    # --- next-turn warming (proxy/warm.py) -------------------------------------------------
    def _keep_answer(self, ctx, chunk: bytes) -> None:
        conv = ctx.state.get(WARM_KEY)
        if conv is not None:
            conv.size += len(chunk)
            if conv.size <= self.cfg["warm_answer_bytes"]:
                conv.chunks.append(chunk)

    def _warm_next_turn(self, ctx, error) -> None:
        """The answer has ended: warm the conversation it extends, on the upstream that
        computed its prompt (a P/D pair: the prefill upstream)."""
        conv = ctx.state.get(WARM_KEY)
        up = ctx.prefill_upstream or ctx.upstream
        if conv is None or error is not None or ctx.status != 200 or up is None \
                or conv.size > self.cfg["warm_answer_bytes"] or ctx.warm:
            return                  # (a warm API request has no answer to warm a turn with)

        async def render() -> list[int] | None:
            body = conv.body
            if conv.anthropic:
                reply = anthropic_answer_message(ctx.answer, conv.chunks)
                if reply is None:
                    return None
                inputs = await self._maybe_thread(
                    len(ctx.raw_body), messages_chat,
                    {**body, "messages": [*body["messages"], reply]}, conv.cache)
                if inputs is None:
                    return None
                messages, tools, kwargs = inputs
            else:
                reply = answer_message(ctx.answer, conv.chunks)
                if reply is None:
                    return None
                messages = [flatten(m) for m in body["messages"]] + [reply]
                tools, kwargs = body.get("tools"), template_kwargs(
                    body.get("chat_template_kwargs"))
            try:
                r = await self._maybe_thread(
                    sum(len(str(m.get("content") or "")) for m in messages),
                    conv.cache.render, messages, tools, False, kwargs)
            except ValueError:        # the template will not end on an assistant turn
                return None
            return r.tokens
        self.gw.warmer.next_turn(up, ctx.model, ctx.request_id, render, ctx.cache_salt)


@dataclass(slots=True)
class Conversation:
    """A chat (or Messages) request's rendering inputs and its streamed answer, kept to warm
    its next turn."""
    cache: PromptCache
    body: dict
    chunks: list[bytes]
    anthropic: bool = False    # a /v1/messages request (its answer: Anthropic's shape)
    size: int = 0


def answer_message(answer: dict | None, chunks: list[bytes]) -> dict | None:
    """The assistant message a chat answer adds to the conversation, as the client will send
    it back: from a whole answer's first choice, or a stream's content deltas (None: a stream
    with tool calls, whose exact message the client assembles, or nothing usable)."""
    if answer is not None:
        choices = answer.get("choices")
        message = choices[0].get("message") if isinstance(choices, list) and choices and \
            isinstance(choices[0], dict) else None
        if not isinstance(message, dict):
            return None
        reply = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        return reply
    text = []
    for raw in sse.events_in(chunks):
        data = sse.data_of(raw)
        if data is None or data == sse.DONE:
            continue
        obj = sse.json_of(raw)
        if not isinstance(obj, dict):
            return None
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if choice.get("index", 0) != 0 or delta.get("tool_calls"):
                return None
            if isinstance(delta.get("content"), str):
                text.append(delta["content"])
    return {"role": "assistant", "content": "".join(text)} if text else None



def anthropic_answer_message(answer: dict | None, chunks: list[bytes]) -> dict | None:
    """The assistant message a Messages answer adds to the conversation, as the client sends
    it back: the whole answer's `content` blocks, or a stream's blocks rebuilt from its events
    (text and thinking deltas joined, a tool_use's `input` from its partial JSON). None:
    nothing usable."""
    if answer is not None:
        content = answer.get("content")
        if answer.get("type") != "message" or not isinstance(content, list):
            return None
        return {"role": "assistant", "content": content}
    blocks: dict[int, dict] = {}
    parts: dict[int, list[str]] = {}
    for raw in sse.events_in(chunks):
        event = sse.json_of(raw)
        if not isinstance(event, dict):
            continue
        kind, index = event.get("type"), event.get("index")
        if kind == "content_block_start" and isinstance(index, int) and \
                isinstance(event.get("content_block"), dict):
            blocks[index] = dict(event["content_block"])
            parts[index] = []
        elif kind == "content_block_delta" and index in blocks:
            delta = event.get("delta") or {}
            piece = delta.get({"text_delta": "text", "thinking_delta": "thinking",
                               "input_json_delta": "partial_json"}.get(delta.get("type"), ""))
            if isinstance(piece, str):
                parts[index].append(piece)
            elif delta.get("type") == "signature_delta":
                blocks[index]["signature"] = delta.get("signature")
    content = []
    for index in sorted(blocks):
        block, text = blocks[index], "".join(parts[index])
        if block.get("type") == "text":
            block["text"] = block.get("text", "") + text
        elif block.get("type") == "thinking":
            block["thinking"] = block.get("thinking", "") + text
        elif block.get("type") == "tool_use":
            try:
                block["input"] = json.loads(text) if text else block.get("input") or {}
            except ValueError:
                return None
        content.append(block)
    return {"role": "assistant", "content": content} if content else None
