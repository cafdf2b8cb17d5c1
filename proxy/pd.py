"""Prefill/decode disaggregation: one request as a prefill leg and a decode leg (DESIGN.md §2).

    pd: {protocol: vllm}         # vllm | sglang | prefixgate (the bundled engine: vLLM's flow)
    upstreams:
      - {name: p0, url: "http://10.0.0.1:8000", role: prefill}    # sglang: bootstrap_port: 8998
      - {name: d0, url: "http://10.0.0.2:8000", role: decode}

Chat and completion requests go P/D while a healthy `prefill` upstream serves their model;
other requests (embeddings, ...) and those go plain, to `decode` and `both` upstreams only.
The decode upstream is chosen first, by load alone (route.LeastLoaded: in flight + waiting,
or the backends' polled counts and KV usage when prefix_route polls them; it holds the request's
admission slot for the whole answer); the prefill upstream for each prefill leg, by the
chain's scorers among the `prefill` upstreams (prefix affinity: that is where the prompt is
computed, and where `prefix_route` records it).

vllm, prefixgate — vLLM's KV-connector flow (NixlConnector and alike, as vLLM's toy proxy
  drives it): the prefill leg is the client's body plus `kv_transfer_params` asking for a
  remote decode, with `stream: false`, one token, no `stream_options` and without
  `min_tokens`/`min_completion_tokens`; its JSON answer returns the `kv_transfer_params`
  (engine, block ids, host, port) that the decode leg — the client's own body plus those —
  pulls the KV with. Both legs carry the request's X-Request-Id.
sglang — one (prefill, decode) pair per request, sent at once, both with the client's body plus
  `bootstrap_host` (the prefill's host), `bootstrap_port` (its `bootstrap_port:`) and a random
  `bootstrap_room` that pairs them (as SGLang's mini_lb). The decode's answer is the client's;
  the prefill's is read and dropped. A failed prefill leg cancels the decode leg while it has
  sent the client nothing.

Failures: a prefill leg that fails (no connection, 5xx, timeout; vllm: an answer without
`kv_transfer_params`) is tried on another prefill upstream, up to `retries` times (the one
retry rule, exchange.may_retry); after that, or at once when the prefill refuses the request
(4xx), the request goes plain to its decode upstream, which computes the prompt itself
(`x-prefixgate-pd: fallback`). A decode leg that fails before the client's first byte is
retried on another decode upstream like any request (Gateway.forward), with a fresh prefill
leg: vLLM's transferred blocks are consumed, SGLang's room is spent. Each leg is one
exchange.Attempt.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from urllib.parse import urlsplit

from aiohttp import web

from prefixgate.common.errors import HTTPError
from prefixgate.common.runtime import encode_body
from prefixgate.common.schema import REQUIRED, ConfigError, Key, check, one_of
from prefixgate.proxy import relay, route, token_forward
from prefixgate.proxy.exchange import Attempt, UpstreamFailed, may_retry
from prefixgate.proxy.observe import usage

log = logging.getLogger("prefixgate.pd")

SPEC = {"protocol": Key(str, REQUIRED, one_of("vllm", "sglang", "prefixgate"))}
PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})     # the endpoints that go P/D
FALLBACK = "fallback"          # ctx.pd once its prefill legs failed and it went plain
DECODE_SCORERS = [route.LeastLoaded()]
# vLLM: the prefill leg's request to the KV connector (compute the prompt, keep its blocks
# for a remote decode to pull)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
HELD_BACK = ("stream_options", "min_tokens", "min_completion_tokens")   # decode-leg only


class PrefillFailed(Exception):
    """A prefill leg gave no usable answer; `refused`: its upstream rejected the request
    itself (4xx), which another prefill upstream would do too."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


# --- config ----------------------------------------------------------------------------------

def validate(cfg: dict) -> dict | None:
    """`pd:` checked, and the upstreams' roles against it (`cfg`: the config being validated,
    its upstreams and discovery done)."""
    raw, discovery = cfg["pd"], cfg["discovery"]
    if raw is None:
        roles = [(f"upstreams[{i}].role", u["role"]) for i, u in enumerate(cfg["upstreams"])]
        if discovery is not None:
            roles.append(("discovery.role", discovery["role"]))
        for key, role in roles:
            if role != "both":
                raise ConfigError(key, f"{role!r} needs a `pd:` section (pd: {{protocol: vllm "
                                       f"| sglang | prefixgate}})")
        return None
    pd = check(raw, SPEC, "pd")
    if discovery is None and cfg["bundled"] is None:   # else upstreams come at run time
        check_roles(cfg["upstreams"])
    return pd


def check_roles(upstreams: list[dict]) -> None:
    """A P/D fleet needs a prefill upstream and one that decodes (ConfigError on `pd`)."""
    roles = {u["role"] for u in upstreams}
    if "prefill" not in roles:
        raise ConfigError("pd", "no upstream has role: prefill (the prefill legs' upstreams)")
    if not roles & route.SERVING:
        raise ConfigError("pd", "no upstream has role: decode or both (decode legs and plain "
                                "requests)")


# --- the request path --------------------------------------------------------------------------

def protocol_for(gw, ctx) -> str | None:
    """The P/D protocol this request goes by, or None: it goes plain."""
    cfg = gw.config.get("pd")
    if cfg is None or ctx.path not in PATHS:
        return None
    model = ctx.model
    if not any(u.role == "prefill" and u.healthy and (model is None or u.serves(model))
               for u in gw.upstreams):
        return None
    return cfg["protocol"]


def active(ctx) -> bool:
    """Does this request go P/D (and has not fallen back to plain)?"""
    return ctx.pd is not None and ctx.pd != FALLBACK


async def exchange(gw, request: web.Request, ctx, data: bytes) -> web.StreamResponse:
    """One P/D attempt on the decode upstream `ctx.upstream`: prefill legs until one succeeds
    (another prefill upstream after each failure, as `may_retry` allows), then the decode
    leg, whose answer is relayed to the client; with no prefill leg left, the original body
    `data` goes plain to the decode upstream. UpstreamFailed: the decode failed before a
    byte."""
    decode, tried = ctx.upstream, []
    while True:
        try:
            prefill = route.decide(gw.upstreams, ctx.chain, ctx, tried, roles=route.PREFILL)
        except HTTPError:
            break                  # no healthy prefill upstream left
        ctx.prefill_upstream = prefill
        ctx.response_headers.update({"x-prefixgate-pd": ctx.pd,
                                     "x-prefixgate-prefill-upstream": prefill.name})
        try:
            if ctx.pd == "sglang":
                return await _sglang_pair(gw, request, ctx, prefill, decode)
            params = await _vllm_prefill(gw, ctx, prefill)
        except PrefillFailed as e:
            log.warning("request %s: prefill leg on %s failed: %s", ctx.request_id,
                        prefill.name, e)
            tried.append(prefill)
            if e.refused or not may_retry(gw, ctx, tried, route.PREFILL):
                break
            continue
        return await relay.answer(gw, request, ctx, decode,
                                  encode_body({**ctx.body, "kv_transfer_params": params}))
    ctx.pd, ctx.prefill_upstream = FALLBACK, None
    ctx.response_headers.pop("x-prefixgate-prefill-upstream", None)
    ctx.response_headers["x-prefixgate-pd"] = FALLBACK
    return await relay.answer(gw, request, ctx, decode, data,
                              token_forward.applies(ctx, decode))


async def _vllm_prefill(gw, ctx, up) -> dict:
    """The vLLM prefill leg: the `kv_transfer_params` its answer returns for the decode."""
    body = {k: v for k, v in ctx.body.items() if k not in HELD_BACK}
    body.update(kv_transfer_params=dict(REMOTE_DECODE), stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    with Attempt(gw, ctx, up) as attempt:         # the decode waits for it: in line
        answer = usage.from_body(await _prefill_leg(attempt, encode_body(body)))
        params = answer.get("kv_transfer_params") if answer is not None else None
        if not isinstance(params, dict) or not params:
            attempt.broken("prefill answer without kv_transfer_params")
            raise PrefillFailed("its answer has no kv_transfer_params (is vLLM started with a "
                                "--kv-transfer-config?)")
    return params


async def _sglang_pair(gw, request, ctx, prefill, decode) -> web.StreamResponse:
    """The SGLang pair, both legs at once; the decode's answer relayed to the client."""
    host = urlsplit(prefill.url).hostname or ""
    data = encode_body({**ctx.body, "bootstrap_host": f"[{host}]" if ":" in host else host,
                        "bootstrap_port": prefill.cfg["bootstrap_port"],
                        "bootstrap_room": random.getrandbits(63)})
    prefill_leg = asyncio.ensure_future(_sglang_prefill(gw, ctx, prefill, data))
    decode_leg = asyncio.ensure_future(relay.answer(gw, request, ctx, decode, data))
    try:
        await asyncio.wait((prefill_leg, decode_leg), return_when=asyncio.FIRST_COMPLETED)
        if (prefill_leg.done() and prefill_leg.exception() is not None
                and not ctx.client_has_bytes):
            raise prefill_leg.exception()           # (the finally cancels the decode)
        return await decode_leg
    finally:
        for leg in (decode_leg, prefill_leg):       # a dead pair's partner, or the client left
            if not leg.done():
                leg.cancel()
        await asyncio.gather(decode_leg, prefill_leg, return_exceptions=True)


async def _sglang_prefill(gw, ctx, up, data: bytes) -> None:
    """SGLang's prefill leg: its answer is dropped, and the decode does not wait for it."""
    with Attempt(gw, ctx, up, in_line=False) as attempt:
        await _prefill_leg(attempt, data)


async def _prefill_leg(attempt: Attempt, data: bytes) -> bytes:
    """A prefill leg's whole answer (read within the upstream's `first_byte` timeout: a
    prefill answers once its first token is out); PrefillFailed when there is none to use."""
    ctx = attempt.ctx
    started = time.monotonic()
    try:
        answer = await attempt.send("POST", data, read="all")
    except (UpstreamFailed, HTTPError) as e:
        raise PrefillFailed(str(e)) from None
    finally:
        ctx.prefill_s += time.monotonic() - started
    status = attempt.resp.status
    if status >= 500:
        raise PrefillFailed(f"HTTP {status}")
    if status >= 300:
        said = usage.error_message(usage.from_body(answer))
        raise PrefillFailed(f"HTTP {status}" + (f": {said}" if said else ""), refused=True)
    return answer
