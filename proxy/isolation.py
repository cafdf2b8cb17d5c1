"""`isolation:` — each tenant's prefix cache its own, through vLLM's `cache_salt`.

A prefix cache shared by tenants leaks: a cached prefix answers sooner, so one tenant can
time probes to learn whether another sent a given document. vLLM (and the bundled engine)
fold a request's `cache_salt` into its first block's hash, so requests share cached blocks
only when their salts are equal. With `cache: per_key` the gateway sets one salt per tenant
on every prompt-bearing request it sends (chat, completions, Messages, Responses,
embeddings):

    isolation:
      cache: per_key          # or shared; the default is per_key when auth.api_keys are set
      secret: null            # the salts' key (>= 16 characters); null: the keys' digests
      client_salt: false      # true: a client's cache_salt splits its tenant's cache further
      unsalted_upstreams: []  # upstreams that do not take cache_salt: never sent one

A tenant is an API key, or every key of one `cache_group` (auth.api_keys[].cache_group). Its
salt is HMAC-SHA256(secret, tenant) in base64url (43 characters, as vLLM advises): the same on
every replica with the same config, and not computable without the secret — which, when not
set, is derived from every configured key's digest, so a tenant knowing its own key cannot
compute another's salt (a key added or rotated then changes every salt: the caches start
cold once; set `secret` to keep them). A client's own `cache_salt` is replaced unless
`client_salt: true`, and then folded under its tenant's salt, so it divides the tenant's
cache (per end user, say) and never reaches another tenant's. Without keys, or with
`shared`, the gateway sets nothing and a client's `cache_salt` goes on as it came.

The request's salt is `ctx.cache_salt`: prefix_route salts its keys with it, so routing
matches what the engine holds. An upstream named in `unsalted_upstreams`, and every upstream
of `pd: {protocol: sglang}`, gets the body without it (its cache is then shared).
"""
from __future__ import annotations

import base64
import hashlib
import hmac

from prefixgate.common.errors import HTTPError
from prefixgate.common.schema import ConfigError, Key, check, one_of

PER_KEY, SHARED = "per_key", "shared"
# the endpoints whose requests vLLM caches a prompt for, and so take `cache_salt`
SALTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages",
                          "/v1/responses", "/v1/embeddings"})
FIELD = "cache_salt"

SPEC = {
    "cache": Key(str, None, one_of(PER_KEY, SHARED)),
    "secret": Key((str, type(None)), None,
                  lambda v: None if len(v) >= 16 else "must be at least 16 characters"),
    "client_salt": Key(bool, False),
    "unsalted_upstreams": Key(list, list),
}


def validate(cfg: dict) -> dict:
    """`isolation:` checked against the rest of the config (its keys, its upstreams), with
    its default mode filled in."""
    iso = check(cfg.get("isolation"), SPEC, "isolation")
    has_keys = cfg.get("auth") is not None
    if iso["cache"] is None:
        iso["cache"] = PER_KEY if has_keys else SHARED      # secure by default (module doc)
    elif iso["cache"] == PER_KEY and not has_keys:
        raise ConfigError("isolation.cache", "per_key needs auth.api_keys (each key a "
                                             "tenant); without keys use shared")
    for i, name in enumerate(iso["unsalted_upstreams"]):
        if not isinstance(name, str) or not name:
            raise ConfigError(f"isolation.unsalted_upstreams[{i}]",
                              f"must be an upstream name, got {name!r}")
        known = {u["name"] for u in cfg["upstreams"]}
        if cfg.get("discovery") is None and cfg.get("bundled") is None and name not in known:
            raise ConfigError(f"isolation.unsalted_upstreams[{i}]",
                              f"no upstream named {name!r} (upstreams: {sorted(known)})")
    return iso


def for_config(config: dict, keys: list) -> Isolation:
    pd = config.get("pd")
    return Isolation(config["isolation"], keys, pd["protocol"] if pd else None)


def _b64(mac: bytes) -> str:
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


class Isolation:
    """The salt of each tenant and what each upstream is sent (module doc)."""

    def __init__(self, cfg: dict, keys: list, pd_protocol: str | None = None):
        self.per_key = cfg["cache"] == PER_KEY and bool(keys)
        self.client_salt = cfg["client_salt"]
        self.unsalted = frozenset(cfg["unsalted_upstreams"])
        self.all_unsalted = pd_protocol == "sglang"      # SGLang takes no cache_salt
        secret = cfg["secret"]
        self._secret = (secret.encode() if secret is not None else hashlib.sha256(
            b"prefixgate cache_salt\0" + b"".join(sorted(k.digest for k in keys))).digest())
        self._salts = {k.digest: self._mac(_tenant(k)) for k in keys} if self.per_key else {}

    def _mac(self, data: bytes) -> str:
        return _b64(hmac.new(self._secret, data, hashlib.sha256).digest())

    def salt_of(self, key) -> str | None:
        """The salt of the tenant `key` (an auth.ApiKey) belongs to (None: not per_key)."""
        return self._salts.get(key.digest) if key is not None else None

    def apply(self, ctx) -> None:
        """Set the request's salt (`ctx.cache_salt`, and its body's) by its tenant."""
        if ctx.path not in SALTED_PATHS:
            return
        body, client = ctx.body, ctx.body.get(FIELD)
        tenant = self.salt_of(ctx.key) if self.per_key else None
        if tenant is None:           # nothing to isolate: the client's salt as it came
            ctx.cache_salt = client if isinstance(client, str) and client else None
            return
        salt = tenant
        if self.client_salt and client is not None:
            if not isinstance(client, str) or not client:
                raise HTTPError(400, "cache_salt must be a non-empty string",
                                code="invalid_request")
            salt = self._mac(b"client\0" + tenant.encode() + b"\0" + client.encode())
        body[FIELD] = ctx.cache_salt = salt
        ctx.body_changed = True

    def takes_salt(self, up) -> bool:
        return not (self.all_unsalted or up.name in self.unsalted)

    def fit(self, ctx, up) -> None:
        """The body as `up` takes it: with the request's salt, or without where `up` does
        not take `cache_salt` (put back for the next upstream of a retry that does)."""
        if ctx.cache_salt is None or ctx.path not in SALTED_PATHS:
            return
        has = FIELD in ctx.body
        if self.takes_salt(up):
            if not has:
                ctx.body[FIELD] = ctx.cache_salt
                ctx.body_changed = True
        elif has:
            del ctx.body[FIELD]
            ctx.body_changed = True


def _tenant(key) -> bytes:
    """What names a key's tenant: its cache group, else the key itself (by its digest)."""
    if key.cache_group is not None:
        return b"group\0" + key.cache_group.encode()
    return b"key\0" + key.digest
