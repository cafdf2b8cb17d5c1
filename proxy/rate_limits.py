"""Per-API-key limits on requests and tokens per minute, per replica or across replicas.

A key's `rate_limit` (or `auth.rate_limit`, the default for keys without their own) sets
`requests_per_minute` and/or `tokens_per_minute`, for the key as a whole or, with
`per_model: true`, for each model it asks for. Tokens are prompt + completion tokens from the
answer's `usage` (a stream's final usage event), else the prompt's estimate (its token ids
where `prerender` made them, else 4 bytes a token); they are counted when the answer ends, so a
request is admitted while the key has budget left and its tokens may take the budget below
zero, which then holds the key's next requests until it refills (as OpenAI does).

Where the counts live (`rate_limits:` at the top level of the config):
- no `store` (default): in this replica, as token buckets refilled continuously; with
  `replicas: N` each replica allows a 1/N share, so N replicas behind a balancer that spreads
  evenly allow the configured limit in all;
- `store: redis://host:6379/0`: in Redis, shared by every replica, as counters per key and
  minute, checked and incremented in one atomic script. A Redis that fails or times out
  (`store_timeout_ms`) lets requests through (`on_store_error: open`, the default) or refuses
  them with 429 (`closed`); never a 5xx. The failure is logged at most once a minute.

Every answer of a limited key carries OpenAI's headers: `x-ratelimit-limit-requests`,
`x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` and the same for `-tokens`
(reset as "1s", "6m0s"); a refusal is a 429 `rate_limit_exceeded` with `Retry-After`.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import redis.asyncio as redis

from prefixgate.common.errors import HTTPError
from prefixgate.common.schema import Key, check, one_of, positive
from prefixgate.proxy.lru import LRU
from prefixgate.proxy.observe import usage

log = logging.getLogger("prefixgate.rate_limits")

RATE = {
    "requests_per_minute": Key((int, float), None, positive),   # neither given: 60 requests
    "tokens_per_minute": Key((int, float), None, positive),
    "burst": Key(int, None, positive),      # requests a local bucket holds; default 10 s' worth
    "per_model": Key(bool, False),          # a budget per model the key asks for
}


def _redis_url(v) -> str | None:
    ok = v.startswith(("redis://", "rediss://", "unix://"))
    return None if ok else "must be a redis://host:port/db URL (or rediss://, unix://)"


SPEC = {
    "store": Key((str, type(None)), None, _redis_url),
    "replicas": Key(int, 1, positive),      # without a store: each replica's share is 1/N
    "on_store_error": Key(str, "open", one_of("open", "closed")),
    "store_timeout_ms": Key((int, float), 100, positive),
    "key_prefix": Key(str, "prefixgate:ratelimit"),
}

WINDOW_S = 60                   # the store's counting window
LOG_EVERY_S = 60.0              # a failing store is logged at most this often
BYTES_PER_TOKEN = 4             # a prompt's estimate without token ids
MAX_BUCKETS = 100_000           # (key, model) budgets kept per replica, least recent out


def validate(raw) -> dict:
    return check(raw, SPEC, "rate_limits")


@dataclass(frozen=True, slots=True)
class Limit:
    """One key's limits, per minute (None: not limited on that count)."""
    requests: float | None
    tokens: float | None
    burst: int | None
    per_model: bool

    @classmethod
    def of(cls, cfg: dict | None) -> Limit | None:
        """The limit a `rate_limit` mapping (checked against RATE) sets."""
        if cfg is None:
            return None
        requests, tokens = cfg["requests_per_minute"], cfg["tokens_per_minute"]
        if requests is None and tokens is None:
            requests = 60.0
        return cls(requests, tokens, cfg["burst"], cfg["per_model"])

    def share(self, replicas: int) -> Limit:
        """This replica's part of the limit when `replicas` count alone."""
        if replicas == 1:
            return self
        return Limit(self.requests and self.requests / replicas,
                     self.tokens and self.tokens / replicas, self.burst, self.per_model)


@dataclass(slots=True)
class Bucket:
    """A token bucket: `rate` per second up to `size`; `level` may go below 0 (a debt)."""
    rate: float
    size: float
    level: float
    at: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> float:
        self.level = min(self.size, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level

    def wait(self) -> float:
        """Seconds until the bucket holds one unit."""
        return max(0.0, (1.0 - self.level) / self.rate)

    def full_in(self) -> float:
        return max(0.0, (self.size - self.level) / self.rate)


@dataclass(slots=True)
class Grant:
    """An admitted request's count: where its tokens are charged when it ends."""
    name: str                 # the counters' name: the key's digest (and, per model, the model)
    limit: Limit
    window: int = 0           # the store's window it was admitted in


class RateLimits:
    """The gateway's limiter (module doc): `cfg` is `rate_limits:`, `keys` the API keys;
    `old`, the limiter before a reload, hands over its counts and its store connection."""

    def __init__(self, cfg: dict, keys: list, old: RateLimits | None = None):
        self.cfg = cfg
        self.replicas = cfg["replicas"]
        self.closed = cfg["on_store_error"] == "closed"
        # streams keep their usage event where some key's tokens are counted
        self.counts_tokens = any(k.limit is not None and k.limit.tokens for k in keys)
        self.buckets: LRU[tuple, tuple[Bucket | None, Bucket | None]] = LRU(MAX_BUCKETS)
        self.store = None
        if old is not None:
            self.buckets = old.buckets               # entries are keyed by their Limit too
            if old.cfg == cfg:
                self.store, old.store = old.store, None
        if self.store is None and cfg["store"] is not None:
            self.store = RedisCounter(cfg)
        self._pending: set[asyncio.Task] = set()

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self.store is not None:
            await self.store.close()

    # --- admission -----------------------------------------------------------------------
    async def admit(self, ctx) -> None:
        """Count the request against its key's limit, or raise a 429; the rate-limit headers
        go on its answer either way."""
        key = ctx.key
        limit = key.limit if key is not None else None
        if limit is None:
            return
        # the key's digest, not its name: replicas agree, and two keys never share a budget
        name = key.digest.hex()[:16]
        grant = Grant(f"{name}:{ctx.model}" if limit.per_model else name, limit)
        if self.store is not None:
            allowed, headers = await self._admit_shared(grant)
        else:
            allowed, headers = self._admit_local(grant)
        retry_after = headers.pop("retry-after", None)
        ctx.response_headers.update(headers)
        if not allowed:
            what = f"API key {key.name!r}" + (f" and model {ctx.model!r}" if limit.per_model
                                              else "")
            raise HTTPError(429, f"rate limit exceeded for {what}", code="rate_limit_exceeded",
                            headers={"Retry-After": retry_after or "1"})
        ctx.rate_grant = grant

    def _admit_local(self, grant: Grant) -> tuple[bool, dict]:
        limit = grant.limit.share(self.replicas)
        slot = (grant.name, grant.limit)
        buckets = self.buckets.get(slot)
        if buckets is None:
            buckets = self.buckets[slot] = _buckets(limit)
        requests, tokens = buckets
        now = time.monotonic()
        waits = [b.wait() for b in buckets if b is not None and b.refill(now) < 1.0]
        if not waits and requests is not None:
            requests.level -= 1.0
        headers = {}
        for kind, b, per_minute in (("requests", requests, limit.requests),
                                    ("tokens", tokens, limit.tokens)):
            if b is not None:
                headers.update(_headers(kind, per_minute, max(b.level, 0.0), b.full_in()))
        if waits:
            headers["retry-after"] = str(max(1, math.ceil(max(waits))))
        return not waits, headers

    async def _admit_shared(self, grant: Grant) -> tuple[bool, dict]:
        limit = grant.limit
        try:
            allowed, used_requests, used_tokens, window, reset = await self.store.admit(
                grant.name, limit)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as e:   # never a 5xx
            self.store.failed(e, self.closed)
            if self.closed:
                return False, {"retry-after": "1"}
            return True, {}
        grant.window = window
        headers = {}
        for kind, per_minute, used in (("requests", limit.requests, used_requests),
                                       ("tokens", limit.tokens, used_tokens)):
            if per_minute is not None:
                headers.update(_headers(kind, per_minute, max(per_minute - used, 0), reset))
        if not allowed:
            headers["retry-after"] = str(max(1, math.ceil(reset)))
        return allowed, headers

    # --- charging --------------------------------------------------------------------------
    def charge(self, ctx) -> None:
        """The request has ended: its tokens count against its key's budget."""
        grant = ctx.rate_grant
        if grant is None or grant.limit.tokens is None or ctx.status != 200:
            return
        n = spent_tokens(ctx)
        if self.store is None:
            slot = (grant.name, grant.limit)
            buckets = self.buckets.get(slot)
            if buckets is not None and buckets[1] is not None:
                b = buckets[1]
                b.refill(time.monotonic())
                b.level = max(b.level - n, -b.size)    # a debt of at most one minute's budget
            return
        task = asyncio.get_running_loop().create_task(self._charge_shared(grant, n))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _charge_shared(self, grant: Grant, n: int) -> None:
        try:
            await self.store.charge(grant.name, grant.window, n)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as e:
            self.store.failed(e, self.closed)


def _buckets(limit: Limit) -> tuple[Bucket | None, Bucket | None]:
    requests = tokens = None
    if limit.requests is not None:
        per_s = limit.requests / 60.0
        size = limit.burst or max(1, math.ceil(per_s * 10))
        requests = Bucket(per_s, size, size)
    if limit.tokens is not None:
        tokens = Bucket(limit.tokens / 60.0, limit.tokens, limit.tokens)
    return requests, tokens


def spent_tokens(ctx) -> int:
    """Prompt + completion tokens of the answer's usage, else the prompt's estimate."""
    answer = ctx.usage
    if answer is None and ctx.tail:
        answer = (usage.from_stream(ctx.tail) or {}).get("usage")
    prompt, _, completion = usage.tokens(answer)
    if prompt is not None:
        return prompt + (completion or 0)
    if ctx.tokens is not None:
        return len(ctx.tokens)
    return max(1, len(ctx.raw_body) // BYTES_PER_TOKEN)


def _headers(kind: str, limit: float, remaining: float, reset_s: float) -> dict[str, str]:
    return {f"x-ratelimit-limit-{kind}": str(int(limit)),
            f"x-ratelimit-remaining-{kind}": str(int(remaining)),
            f"x-ratelimit-reset-{kind}": duration(reset_s)}


def duration(seconds: float) -> str:
    """OpenAI's reset format: "0s", "17s", "6m0s", "1h2m3s" (whole seconds, rounded up)."""
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    return f"{m}m{s}s" if m else f"{s}s"


# KEYS: the window's request and token counters. ARGV: requests and tokens per minute (-1:
# none), the counters' time to live. Admits (and counts) a request while both are under
# their limit; returns {admitted, requests counted, tokens counted}.
ADMIT = """
local req = tonumber(redis.call('GET', KEYS[1]) or '0')
local tok = tonumber(redis.call('GET', KEYS[2]) or '0')
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
if (rpm >= 0 and req >= rpm) or (tpm >= 0 and tok >= tpm) then
  return {0, req, tok}
end
req = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, req, tok}
"""


class RedisCounter:
    """The counters in Redis: one request and one token counter per name and minute."""

    def __init__(self, cfg: dict):
        timeout = cfg["store_timeout_ms"] / 1e3
        self.client = redis.from_url(cfg["store"], socket_timeout=timeout,
                                     socket_connect_timeout=timeout)
        self.script = self.client.register_script(ADMIT)
        self.prefix = cfg["key_prefix"]
        self._logged = -math.inf

    async def close(self) -> None:
        await self.client.aclose()

    def _keys(self, name: str, window: int) -> tuple[str, str]:
        base = f"{self.prefix}:{name}:{window}"
        return base + ":requests", base + ":tokens"

    async def admit(self, name: str, limit: Limit) -> tuple[bool, int, int, int, float]:
        """(admitted, requests, tokens counted in this minute, the minute, seconds left)."""
        now = time.time()
        window = int(now // WINDOW_S)
        allowed, requests, tokens = await self.script(
            keys=self._keys(name, window),
            args=[-1 if limit.requests is None else int(limit.requests),
                  -1 if limit.tokens is None else int(limit.tokens), 2 * WINDOW_S])
        return bool(allowed), int(requests), int(tokens), window, (window + 1) * WINDOW_S - now

    async def charge(self, name: str, window: int, n: int) -> None:
        key = self._keys(name, window)[1]
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.incrby(key, n).expire(key, 2 * WINDOW_S).execute()

    def failed(self, error: Exception, closed: bool) -> None:
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.warning("rate limit store unavailable (%s: %s); limited keys' requests are "
                        "%s until it answers", type(error).__name__, error,
                        "refused (on_store_error: closed)" if closed else "let through")
