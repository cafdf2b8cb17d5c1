"""Per-request state that flows through the plugin chain: every field a plugin or the core
reads is named here, so plugins meet through these fields and never look each other up."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class RequestContext:
    request_id: str
    path: str                                  # the endpoint's route, e.g. "/v1/chat/completions"
    body: dict                                 # parsed JSON; plugins may mutate it
    headers: Any                               # the client's request headers (CIMultiDictProxy)
    raw_body: bytes = b""                      # forwarded as-is unless body_changed
    upload_length: int | None = None           # a streamed upload's length as sent upstream
    body_changed: bool = False                 # set by a plugin that mutates `body`
    endpoint: Any = None                       # its proxy.endpoints.Endpoint
    target: str = ""                           # the path sent upstream (route parts filled in)
    pin: str | None = None                     # the upstream it must go to (a stored response)
    chain: Any = None                          # the plugin chain, pinned for the request's life
    key: Any = None                            # the authenticated proxy.auth.ApiKey, if any
    model: str | None = None                   # the body's model (after model_aliases)
    stream: bool = False
    priority: int = 0
    cache_salt: str | None = None              # the salt its prefix is cached under (vLLM's
                                               # cache_salt: proxy/isolation.py), None: none
    # its cache_control breakpoints, in prompt order (common/cache_control.py; read once at
    # parse, where a malformed one is a 400)
    cache_breakpoints: list = field(default_factory=list)
    # monotonic stamps: received, parsed, plugins_done, routed, admitted, upstream_sent,
    # first_byte, done
    t: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0                          # time.time() at arrival (access log, spans)
    upstream: Any = None                       # the chosen proxy.upstream.Upstream
    # prefill/decode disaggregation (proxy/pd.py): the flow it takes, the `pd.protocol` name
    # (vllm, sglang, prefixgate), "fallback" (no prefill leg succeeded: recomputed plain) or
    # None (a plain request); `upstream` is then the decode upstream
    pd: str | None = None
    prefill_upstream: Any = None               # the Upstream of its prefill leg (None: none)
    prefill_s: float = 0.0                     # its prefill legs, written -> answered, summed
    route_info: dict = field(default_factory=dict)   # why it was chosen (scores, matched blocks)
    tokens: list[int] | None = None            # prompt token ids, when a tokenizer is configured
    block_hashes: list[int] | None = None      # prefix hash chain for routing ...
    block_tokens: int | None = None            # ... over blocks of this many tokens
    normalized: bool = False                   # `normalize` rewrote the body to canonical form
    moved: list = field(default_factory=list)  # what normalization moved
    response_headers: dict[str, str] = field(default_factory=dict)  # added by plugins
    status: int | None = None                  # status sent to the client
    chunks: int = 0                            # SSE data events seen (≈ tokens) for TPOT
    attempts: int = 0                          # upstreams tried
    tried: list = field(default_factory=list)  # the upstreams that failed it before a byte
    client_has_bytes: bool = False             # the answer has begun: no other upstream now
    # the TTFT breakdown (proxy/observe/breakdown.py): seconds summed over attempts, and what the
    # upstream's `Server-Timing` said
    connect_s: float = 0.0                     # pool wait + TCP connect
    upstream_s: float = 0.0                    # request written -> the upstream's first byte
    upstream_timing: str | None = None
    # the answer (proxy/observe/usage.py): the last chunks of a stream, where its usage event is
    tail: Any = None
    usage: dict | None = None                  # the upstream's `usage`
    answer: dict | None = None                 # a whole JSON answer, where it was parsed
    response_model: str | None = None          # the model the upstream says answered
    bytes_out: int = 0                         # body bytes relayed to the client
    error: str | None = None                   # why it failed (status >= 400, mid-stream)
    trace: Any = None                          # its proxy.observe.span_export.Trace, when traced
    # the core's own data (a plugin's is in `state`)
    warm: str | None = None                    # "api": a warm API request; "next_turn": the
                                               # gateway's own next-turn warming (proxy/warm.py)
    previous_response: tuple[str, str] | None = None   # (client's id, upstream's) a Responses
                                               # follow-up continues (proxy/response_ids.py)
    rate_grant: Any = None                     # the key's rate-limit grant, charged at the end
                                               # (proxy/rate_limits.py)
    state: dict = field(default_factory=dict)  # a plugin's private data, keyed by its name

    def stamp(self, name: str) -> float:
        now = time.monotonic()
        self.t[name] = now
        return now

    def since(self, start: str, end: str) -> float | None:
        """Seconds between two stamps, or None when either is missing."""
        if start in self.t and end in self.t:
            return self.t[end] - self.t[start]
        return None
