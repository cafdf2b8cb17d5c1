"""API keys: who may call, with what priority, limits (counted in rate_limits.py) and
upstream credentials.

Keys are stored only as SHA-256 digests (a config may give `sha256:<hex>` so the plain key
never sits in a file). A presented key is hashed and compared against every stored digest
with `hmac.compare_digest`, so neither the match nor its position leaks through timing.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from prefixgate.common.errors import HTTPError
from prefixgate.common.schema import ConfigError, Key, check
from prefixgate.proxy.rate_limits import RATE, Limit

KEY = {
    "key": Key(str),                                # plain, or "sha256:<64 hex digits>"
    "name": Key(str, None),                         # shown in logs instead of the key
    "priority": Key(int, None),                     # admission priority for this key
    "rate_limit": Key(dict, None, nested=RATE),
    "upstream_headers": Key(dict, dict),            # sent upstream for this key (credentials)
    # the tenant whose prefix cache this key shares (isolation: per_key, proxy/isolation.py);
    # none: the key is a tenant of its own
    "cache_group": Key(str, None, lambda v: None if v else "must be a non-empty name"),
}

SPEC = {
    "api_keys": Key(list),
    "forward_auth": Key(bool, False),               # pass the client's Authorization upstream
    "rate_limit": Key(dict, None, nested=RATE),     # default for keys without their own
}


@dataclass
class ApiKey:
    digest: bytes
    name: str
    priority: int | None
    upstream_headers: dict[str, str]
    limit: Limit | None = None
    cache_group: str | None = None

    @property
    def replaced(self) -> frozenset[str]:
        """Client headers dropped because this key sends its own."""
        return frozenset(k.lower() for k in self.upstream_headers)


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse_keys(cfg: dict) -> list[ApiKey]:
    """Validate `auth.api_keys` entries (a string or a mapping) into ApiKey records."""
    keys = []
    for i, item in enumerate(cfg["api_keys"]):
        path = f"auth.api_keys[{i}]"
        entry = check({"key": item} if isinstance(item, str) else item, KEY, path)
        raw = entry["key"]
        if raw.startswith("sha256:"):
            hexpart = raw[len("sha256:"):]
            try:
                digest = bytes.fromhex(hexpart)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ConfigError(f"{path}.key", "sha256: must be followed by 64 hex digits")
        elif len(raw) < 8:
            raise ConfigError(f"{path}.key", "too short (at least 8 characters)")
        else:
            digest = digest_of(raw)
        keys.append(ApiKey(digest, entry["name"] or f"key{i}", entry["priority"],
                           {str(k): str(v) for k, v in entry["upstream_headers"].items()},
                           Limit.of(entry["rate_limit"] or cfg["rate_limit"]),
                           entry["cache_group"]))
    if not keys:
        raise ConfigError("auth.api_keys", "must list at least one key")
    return keys


def validate(raw) -> dict | None:
    if raw is None:
        return None
    cfg = check(raw, SPEC, "auth")
    parse_keys(cfg)
    return cfg


class Auth:
    """Checks `Authorization: Bearer <key>` — or Anthropic's `x-api-key: <key>` — on /v1/
    requests; None config = open gateway."""

    def __init__(self, cfg: dict | None):
        self.cfg = cfg
        self.keys = parse_keys(cfg) if cfg else []
        self.forward = cfg["forward_auth"] if cfg else True

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, headers) -> ApiKey | None:
        if not self.keys:
            return None
        presented = digest_of(_presented_key(headers))
        found = None
        for k in self.keys:         # no early exit: same work whichever key matches
            if hmac.compare_digest(presented, k.digest):
                found = k
        if found is None:
            raise _unauthorized("invalid API key")
        return found




def _presented_key(headers) -> str:
    """The one API key a request presents: `Authorization: Bearer <key>` or `x-api-key`."""
    bearer, plain = headers.getall("Authorization", []), headers.getall("x-api-key", [])
    if len(bearer) + len(plain) != 1:
        raise _unauthorized("missing API key (send Authorization: Bearer <key> or x-api-key: "
                            "<key>)" if not bearer and not plain else
                            "more than one API key header (Authorization or x-api-key)")
    if plain:
        token = plain[0].strip()
        if not token:
            raise _unauthorized("empty x-api-key header")
        return token
    scheme, _, token = bearer[0].partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized("malformed Authorization header (expected Bearer <key>)")
    return token


def _unauthorized(message: str) -> HTTPError:
    return HTTPError(401, message, code="invalid_api_key",
                     headers={"WWW-Authenticate": 'Bearer realm="prefixgate"'})
