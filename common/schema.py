"""The config schema's building blocks: a leaf that imports nothing of prefixgate.

Validation is table-driven: a spec maps each allowed key to a `Key` (type, default, check),
and `check()` returns a plain dict with defaults filled in. Every module that owns config
keys (the top level in proxy/config.py, upstreams, health, auth, each plugin) validates its
mapping with the same helper, so every message reads `plugins[2].prefix_route.load_factor: ...`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

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


def json_flag(raw, known, error) -> dict | None:
    """A JSON-object flag's value (JSON text, or a dict from YAML) with only `known` keys; None
    when not given. `error(key, reason)` makes the exception (key "" for the value as a whole)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise error("", f"not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise error("", "must be a JSON object")
    for key in raw:
        if key not in known:
            raise error(str(key), f"unknown key (known: {', '.join(known)})")
    return raw


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
