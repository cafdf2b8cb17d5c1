"""The config schema's building blocks: a leaf that imports nothing of prefixgate.

Validation is table-driven: a spec maps each allowed key to a `Key` (type, default, check),
and `check()` returns a plain dict with defaults filled in. Every module that owns config
keys (the gateway's top level in proxy/config/gateway.py, upstreams, health, auth, each
plugin, and the engine's JSON flags in backend/config.py) validates its mapping with the same
helper, so every message reads `plugins[2].prefix_route.load_factor: ...`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REQUIRED = object()


class ConfigError(ValueError):
    """A bad config value (a ValueError: a bad flag is one). `str()` is one line:
    `<key path>: <reason>`."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason

    @property
    def key(self) -> str:
        """The offending key itself: the last part of `path` ("" for the value as a whole)."""
        return self.path.rpartition(".")[2]

    def under(self, prefix: str) -> ConfigError:
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
    nested: dict[str, Key] | None = field(default=None)  # for mappings validated in turn


def positive(v) -> str | None:
    return None if v > 0 else "must be > 0"


def non_negative(v) -> str | None:
    return None if v >= 0 else "must be >= 0"


def one_of(*choices: str) -> Callable[[Any], str | None]:
    def _check(v):
        return None if v in choices else f"must be one of {', '.join(choices)} (got {v!r})"
    return _check


def at_least(least: int, note: str = "") -> Callable[[Any], str | None]:
    def _check(v):
        return None if v >= least else f"must be >= {least}, got {v}{note}"
    return _check


def type_name(types) -> str:
    """`types` in words, as messages say it: "an integer", "a string or null"."""
    types = types if isinstance(types, tuple) else (types,)
    if float in types:                      # an int is a number too
        types = tuple(t for t in types if t is not int)
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def is_type(value, types) -> bool:
    """isinstance(value, types), except that a bool is of no type but bool and an int is a
    float too."""
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        return False          # YAML `true` is not a number
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def check(mapping: Any, spec: dict[str, Key], path: str = "", show=repr) -> dict:
    """Validate `mapping` against `spec`; return a new dict with defaults filled in.
    `show(value)` writes a bad value into its message."""
    where = path or "config"
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(path, f"must be a mapping, got {type_name(type(mapping))}")
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
            if not is_type(value, rule.types):
                raise ConfigError(kpath, f"must be {type_name(rule.types)}, got {show(value)}")
        if rule.nested is not None and isinstance(value, dict):
            value = check(value, rule.nested, kpath, show)
        if rule.check is not None and value is not None and key in mapping:
            reason = rule.check(value)
            if reason:
                raise ConfigError(kpath, reason)
        out[key] = value
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def json_value(value) -> str:
    """A value as JSON, cut to 80 characters: how messages about JSON input show it."""
    return json.dumps(value)[:80]


def json_flag(raw, spec: dict[str, Key]) -> dict | None:
    """A JSON-object flag's value (JSON text, or a dict from YAML) checked against `spec`, with
    defaults filled in; None when not given. ConfigError names the key ("" for the value as a
    whole)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError("", f"not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError("", "must be a JSON object")
    for key in raw:
        if key not in spec:
            raise ConfigError(str(key), f"unknown key (known: {', '.join(spec)})")
    return check(raw, spec, show=json_value)
