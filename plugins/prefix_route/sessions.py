"""prefix_route `session:` — a session's requests go to one upstream, chosen with no state.

An agent or a chat client names its session in a header (`x-session-id` as vLLM's router
reads it, Dynamo's `x-dynamo-session-id`, LiteLLM's `x-litellm-session-id`), or in the body
where configured: OpenAI's `user` field, or `metadata.<key>`. The session's upstream is the
candidate with the highest hash of (session id, upstream name): rendezvous hashing, so every
gateway replica picks the same one with nothing shared between them, and when an upstream
drops out of the candidates (unhealthy, full while another has room, removed) only its own
sessions move, each to its next choice, and they come back when it returns.

    mode: hard   the session's upstream takes every request it can take
    mode: soft   ... and lets the policy route the request instead when the upstream is
                 saturated (polled KV usage >= kv_saturation) or overloaded (its load above
                 the lightest candidate's by balance_abs_threshold and balance_rel_threshold
                 times); predicted_ttft treats it as the request's home, kept until another
                 upstream is predicted faster by more than the tie

A request without a session id is routed by the policy alone.
"""
from __future__ import annotations

import xxhash

from prefixgate.common.schema import Key, one_of

DEFAULT_HEADERS = ("x-session-id", "x-dynamo-session-id", "x-litellm-session-id")
MAX_ID_BYTES = 256          # a longer id is hashed as its first 256 bytes


def _header_names(v) -> str | None:
    if not v or not all(isinstance(h, str) and h for h in v):
        return "must be a list of header names"
    return None


SPEC = {
    "headers": Key(list, lambda: list(DEFAULT_HEADERS), _header_names),
    "user_field": Key(bool, False),          # the body's `user` names the session
    "metadata_key": Key((str, type(None)), None),   # ... or body.metadata[<this>]
    "mode": Key(str, "soft", one_of("soft", "hard")),
}


class Sessions:
    """The session id of a request and its upstream among the candidates (module doc)."""

    def __init__(self, cfg: dict):
        self.headers = [h.lower() for h in cfg["headers"]]
        self.user_field = cfg["user_field"]
        self.metadata_key = cfg["metadata_key"]
        self.hard = cfg["mode"] == "hard"
        self._seeds: dict[str, int] = {}      # upstream name -> its hash seed

    def session_id(self, ctx) -> bytes | None:
        """The request's session id (None: it names none)."""
        headers = ctx.headers
        for name in self.headers:
            value = headers.get(name) if headers is not None else None
            if value:
                return value.encode()[:MAX_ID_BYTES]
        body = ctx.body
        if self.user_field and isinstance(body.get("user"), str) and body["user"]:
            return body["user"].encode()[:MAX_ID_BYTES]
        if self.metadata_key is not None:
            metadata = body.get("metadata")
            value = metadata.get(self.metadata_key) if isinstance(metadata, dict) else None
            if isinstance(value, str) and value:
                return value.encode()[:MAX_ID_BYTES]
        return None

    def upstream(self, session: bytes, upstreams):
        """The session's upstream among `upstreams`: the highest rendezvous hash."""
        seeds = self._seeds
        best, best_h = None, -1
        for u in upstreams:
            seed = seeds.get(u.name)
            if seed is None:
                seed = seeds[u.name] = xxhash.xxh64_intdigest(u.name.encode())
            h = xxhash.xxh64_intdigest(session, seed)
            if h > best_h:
                best, best_h = u, h
        return best
