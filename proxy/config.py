"""YAML config: safe-loaded, validated at start-up; every error names its key path.

Validation is table-driven: a `Spec` maps each allowed key to a type and a default, and
`check()` returns a plain dict with defaults filled in. Plugins validate their own mapping
with the same helper, so every message reads `plugins[2].prefix_route.load_factor: ...`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

REQUIRED = object()


class ConfigError(Exception):
    """A bad config value. `str()` is one line: `<key path>: <reason>`."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its key path nested under `prefix`."""
        joined = prefix if not self.path else (
            f"{prefix}{self.path}" if self.path.startswith("[") else f"{prefix}.{self.path}")
        return ConfigError(joined, self.reason)


@dataclass
class Key:
    """One allowed key: its type(s), default (REQUIRED if none), and an optional check."""
    types: type | tuple[type, ...]
    default: Any = REQUIRED
    check: Callable[[Any], str | None] | None = None   # returns a reason when the value is bad
    nested: "dict[str, Key] | None" = field(default=None)  # for mappings validated in turn


def positive(v) -> str | None:
    return None if v > 0 else "must be > 0"


def non_negative(v) -> str | None:
    return None if v >= 0 else "must be >= 0"


def one_of(*choices: str) -> Callable[[Any], str | None]:
    def _check(v):
        return None if v in choices else f"must be one of {', '.join(choices)} (got {v!r})"
    return _check


def _type_name(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    if float in types:                      # an int is a number too
        types = tuple(t for t in types if t is not int)
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _is_type(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        return False          # YAML `true` is not a number
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def check(mapping: Any, spec: dict[str, Key], path: str = "") -> dict:
    """Validate `mapping` against `spec`; return a new dict with defaults filled in."""
    where = path or "config"
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(path, f"must be a mapping, got {_type_name(type(mapping))}")
    out = {}
    for key in mapping:
        if key not in spec:
            raise ConfigError(_join(path, str(key)),
                              f"unknown key (allowed in {where}: {', '.join(sorted(spec))})")
    for key, rule in spec.items():
        kpath = _join(path, key)
        if key not in mapping:
            if rule.default is REQUIRED:
                raise ConfigError(kpath, "required")
            value = rule.default() if callable(rule.default) else rule.default
        else:
            value = mapping[key]
            if not _is_type(value, rule.types):
                raise ConfigError(kpath, f"must be {_type_name(rule.types)}, got {value!r}")
        if rule.nested is not None and isinstance(value, dict):
            value = check(value, rule.nested, kpath)
        if rule.check is not None and value is not None and key in mapping:
            reason = rule.check(value)
            if reason:
                raise ConfigError(kpath, reason)
        out[key] = value
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


TIMEOUTS = {
    "connect": Key((int, float), 5.0, positive),
    "first_byte": Key((int, float), 120.0, positive),   # long prompts queue; vLLM can take a while
    "idle": Key((int, float), 60.0, positive),          # longest gap between two streamed chunks
}

UPSTREAM = {
    "name": Key(str, None),
    "url": Key(str),
    "max_inflight": Key(int, 256, positive),      # gateway-side cap, also the load denominator
    "max_connections": Key(int, 256, positive),   # keep-alive pool size
    "weight": Key((int, float), 1.0, positive),
    "timeouts": Key(dict, dict, nested=TIMEOUTS),
    "headers": Key(dict, dict),                   # extra headers sent upstream (e.g. auth)
    # "tokens": chats that `prerender` tokenized go to /v1/completions as token ids
    # (backends that accept them: the bundled engine, vLLM); the answer comes back as chat
    "forward": Key(str, "json", one_of("json", "tokens")),
}

TOP = {
    "listen": Key(dict, dict, nested={
        "host": Key(str, "127.0.0.1"),
        "port": Key(int, 8080, lambda p: None if 0 <= p < 65536 else "must be 0..65535"),
    }),
    "upstreams": Key(list, list),
    "discovery": Key(dict, None),          # DNS discovery of more upstreams (proxy/discovery.py)
    "bundled": Key(dict, None, nested={
        "model": Key(str, "demo"),             # a model dir, or "demo" for the built-in model
        "instances": Key(int, 1, positive),    # engine processes (more than one needs a router)
        "host": Key(str, "127.0.0.1"),
        "args": Key(list, list),               # extra `prefixgate backend` flags
        "startup_timeout_s": Key((int, float), 600.0, positive),
    }),
    "model": Key(dict, dict, nested={
        "name": Key(str, None),          # served model name, when the gateway must know it
        "tokenizer": Key(str, None),     # dir with tokenizer.json (+ chat template)
    }),
    "plugins": Key(list, list),
    "timeouts": Key(dict, dict, nested=TIMEOUTS),
    "retries": Key(int, 1, non_negative),     # other upstreams tried before the first byte
    "limits": Key(dict, dict, nested={
        "max_body_bytes": Key(int, 16 * 1024 * 1024, positive),
        "max_header_bytes": Key(int, 8190, positive),     # one header field; larger → 431
        "max_line_bytes": Key(int, 8190, positive),       # request line; longer → 431
        "max_headers": Key(int, 128, positive),           # header count; more → 431
        "body_timeout_s": Key((int, float), 30.0, positive),   # slow (slowloris) body → 408
        "idle_timeout_s": Key((int, float), 75.0, positive),   # no complete request head → close
        "max_json_depth": Key(int, 64, positive),         # deeper request JSON → 400
        "validate_fields": Key(bool, True),               # 400 for wrong types of core fields
    }),
    # hardening (proxy/health.py, proxy/auth.py): validated in full by their own specs
    "health": Key(dict, dict),
    "auth": Key(dict, None),
    "admin_listen": Key(dict, None, nested={
        "host": Key(str, "127.0.0.1"),
        "port": Key(int, REQUIRED, lambda p: None if 0 <= p < 65536 else "must be 0..65535"),
    }),
    "shutdown_timeout_s": Key((int, float), 30.0, positive),   # SIGTERM: in-flight deadline
}


def _check_url(url: str) -> str | None:
    if not (url.startswith("http://") or url.startswith("https://")):
        return "must start with http:// or https://"
    return None


def check_upstreams(raw: list, defaults: dict) -> list[dict]:
    ups, names = [], set()
    for i, item in enumerate(raw):
        path = f"upstreams[{i}]"
        up = check(item, UPSTREAM, path)
        reason = _check_url(up["url"])
        if reason:
            raise ConfigError(f"{path}.url", reason)
        up["url"] = up["url"].rstrip("/")
        up["name"] = up["name"] or up["url"].split("://", 1)[1]
        if up["name"] in names:
            raise ConfigError(f"{path}.name", f"duplicate upstream name {up['name']!r}")
        names.add(up["name"])
        up["timeouts"] = {**defaults, **{k: v for k, v in (item.get("timeouts") or {}).items()}}
        ups.append(up)
    return ups


def validate(raw: Any) -> dict:
    """Validate a whole config mapping (plugins are checked when they are built)."""
    cfg = check(raw, TOP)
    cfg["upstreams"] = check_upstreams(cfg["upstreams"], cfg["timeouts"])
    from prefixgate.proxy import auth
    from prefixgate.proxy import health  # their modules own their key specs
    cfg["health"] = check(cfg["health"], health.SPEC, "health")
    cfg["auth"] = auth.validate(cfg["auth"])
    if cfg["discovery"] is not None:
        from prefixgate.proxy import discovery
        cfg["discovery"] = discovery.validate(cfg["discovery"], cfg["timeouts"])
    if not cfg["upstreams"] and cfg["bundled"] is None and cfg["discovery"] is None:
        raise ConfigError("upstreams", "required (a list of {name, url}), `discovery:` "
                                       "or `bundled:`")
    for i, item in enumerate(cfg["plugins"]):
        if not (isinstance(item, dict) and len(item) == 1) and not isinstance(item, str):
            raise ConfigError(f"plugins[{i}]", "must be a plugin name or a one-key mapping "
                                               "{name: {settings}}")
    return cfg


def load(path: str | Path) -> dict:
    """Read, safe-load and validate a YAML config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("", f"cannot read config {path}: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("", f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    return validate(raw)
