"""prefix_route `session:` — a session's requests go to one upstream, chosen with no state.

On by default. A request names its session, or the cache it wants to reuse, in the first of:

- a header: `x-session-id` (vLLM's router), `x-dynamo-session-id` (Dynamo),
  `x-litellm-session-id` (LiteLLM), `x-claude-code-session-id` (Claude Code ≥ 2.1.86: its
  session's UUID), `session-id` and `session_id` (Codex: the conversation id; older Codex
  sent `session_id`);
- the body's `prompt_cache_key` (OpenAI's field on chat, completions and Responses bodies;
  Codex sets it to the conversation id);
- the body's `metadata.user_id` (`metadata_key`; Anthropic's field: Claude Code sends
  `user_<hash>_account_<uuid>_session_<uuid>`, or that as a JSON object with `session_id`:
  the session part is the key, so it equals the header's);
- the body's `user` (OpenAI's field), only with `user_field: true`;
- the prompt's `cache_control` breakpoints (`cache_control: true`): the prefix the client marked
  for reuse, up to its last breakpoint, keyed by its head — tools, system and the first
  message, as the chat request vLLM makes of it — which every later turn of the conversation
  repeats, whereas the whole marked prefix grows by a turn each time.

A request carrying a `cache_salt` (its tenant's, proxy/isolation.py) has its key salted with
it, so two tenants' equal keys are two sessions.

The session's upstream is the candidate with the highest hash of (key, upstream name):
rendezvous hashing, so every gateway replica picks the same one with nothing shared between
them, and when an upstream drops out of the candidates (unhealthy, full while another has
room, removed) only its own sessions move, each to its next choice, and they come back when it
returns.

    mode: soft   the session's upstream takes the request unless it is saturated (polled KV
                 usage >= kv_saturation) or overloaded (its load above the lightest
                 candidate's by balance_abs_threshold and balance_rel_threshold times): then
                 the policy routes it; predicted_ttft treats it as the request's home, kept
                 until another upstream is predicted faster by more than the tie
    mode: hard   the session's upstream takes every request it can take
    mode: off    no session affinity: the policy alone routes every request

A request naming no session is routed by the policy alone. The route header says which key a
request was held by, as its source and a short hash (`session_key=prompt_cache_key:1f0c9a3e`),
never the key itself.
"""
from __future__ import annotations

import json
import re

import xxhash

from prefixgate.common.cache_control import Breakpoint, prefix_of
from prefixgate.common.schema import Key, one_of
from prefixgate.plugins.prefix_keys import prompt_body
from prefixgate.plugins.prefix_route.hash_ring import Rendezvous

DEFAULT_HEADERS = ("x-session-id", "x-dynamo-session-id", "x-litellm-session-id",
                   "x-claude-code-session-id", "session-id", "session_id")
MAX_ID_BYTES = 256          # a longer id is hashed as its first 256 bytes
# Claude Code's metadata.user_id before it became JSON: user_<hash>_account_<uuid>_session_<uuid>
CLAUDE_CODE_USER_ID = re.compile(r"_session_([0-9A-Za-z-]+)$")


def _header_names(v) -> str | None:
    if not v or not all(isinstance(h, str) and h for h in v):
        return "must be a list of header names"
    return None


SPEC = {
    "mode": Key(str, "soft", one_of("soft", "hard", "off")),
    "headers": Key(list, lambda: list(DEFAULT_HEADERS), _header_names),
    "prompt_cache_key": Key(bool, True),     # the body's prompt_cache_key names the session
    "metadata_key": Key((str, type(None)), "user_id"),   # ... or body.metadata[<this>]
    "user_field": Key(bool, False),          # ... or the body's `user`
    "cache_control": Key(bool, True),        # ... or the prefix its breakpoints mark
}


class Sessions:
    """The session key of a request and its upstream among the candidates (module doc)."""

    def __init__(self, cfg: dict):
        self.headers = [h.lower() for h in cfg["headers"]]
        self.prompt_cache_key = cfg["prompt_cache_key"]
        self.metadata_key = cfg["metadata_key"]
        self.metadata_source = f"metadata.{self.metadata_key}"
        self.user_field = cfg["user_field"]
        self.cache_control = cfg["cache_control"]
        self.hard = cfg["mode"] == "hard"
        self._rendezvous = Rendezvous()

    def session_key(self, ctx) -> tuple[str, bytes] | None:
        """(where it was found, the key) of the request's session (None: it names none),
        salted with the request's cache_salt."""
        found = self._named(ctx)
        if found is None and self.cache_control and ctx.cache_breakpoints:
            found = ("cache_control",
                     marked_prefix_key(ctx.path, ctx.body, ctx.cache_breakpoints[-1]))
        if found is not None and ctx.cache_salt:
            return found[0], ctx.cache_salt.encode() + b"\0" + found[1]
        return found

    def _named(self, ctx) -> tuple[str, bytes] | None:
        """The session the request names in a header or a body field."""
        headers = ctx.headers
        if headers is not None:
            for name in self.headers:
                value = headers.get(name)
                if value:
                    return name, value.encode()[:MAX_ID_BYTES]
        body = ctx.body
        if self.prompt_cache_key:
            value = body.get("prompt_cache_key")
            if isinstance(value, str) and value:
                return "prompt_cache_key", value.encode()[:MAX_ID_BYTES]
        if self.metadata_key is not None:
            metadata = body.get("metadata")
            value = metadata.get(self.metadata_key) if isinstance(metadata, dict) else None
            if isinstance(value, str) and value:
                return self.metadata_source, session_part(value).encode()[:MAX_ID_BYTES]
        if self.user_field and isinstance(body.get("user"), str) and body["user"]:
            return "user", body["user"].encode()[:MAX_ID_BYTES]
        return None

    def upstream(self, session: bytes, upstreams):
        """The session's upstream among `upstreams`: the highest rendezvous hash."""
        return self._rendezvous.pick(session, upstreams)


def session_part(user_id: str) -> str:
    """The session in Claude Code's `metadata.user_id` — `user_<hash>_account_<uuid>_session_
    <uuid>`, or a JSON object with `session_id` — else the whole value."""
    if user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except ValueError:
            return user_id
        session = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session if isinstance(session, str) and session else user_id
    m = CLAUDE_CODE_USER_ID.search(user_id)
    return m.group(1) if m and user_id.startswith("user_") else user_id


def marked_prefix_key(path: str, body: dict, last: Breakpoint) -> bytes:
    """The key of the prefix a request's `cache_control` breakpoints mark: a hash of the head
    of the prompt up to its `last` breakpoint — its tools and system and its first message,
    in the chat request vLLM makes of it (a Messages request's billing header dropped), marks
    removed, in canonical JSON. Sampling fields are left out: they do not change what is
    cached."""
    chat = prompt_body(path, prefix_of(body, last))
    messages = chat.get("messages") if isinstance(chat.get("messages"), list) else []
    head = {"tools": chat.get("tools"), "messages": _through_first_turn(messages)}
    text = json.dumps(_unmarked(head), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)
    return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))


def _through_first_turn(messages: list) -> list:
    """The leading system messages and the first message after them."""
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ("system", "developer")):
            return messages[:i + 1]
    return messages


def _unmarked(value):
    """`value` without its `cache_control` marks: the client moves them as the conversation
    grows (to its newest message), and they change nothing the engine caches."""
    if isinstance(value, dict):
        return {k: _unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_unmarked(v) for v in value]
    return value


def short_hash(key: bytes) -> str:
    """What the route header shows of a key: 8 hex digits of its hash, never the key."""
    return f"{xxhash.xxh32_intdigest(key):08x}"
