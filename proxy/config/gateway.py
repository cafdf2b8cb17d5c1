"""YAML config: safe-loaded, validated at start-up; every error names its key path.

The building blocks (`Key`, `check`, `ConfigError`) are in common/schema.py; each module owns
its keys' spec (upstreams: proxy/upstream/upstreams.py, health, auth, discovery, each plugin;
the bundled engines' settings: backend/config.py, as the engines check their flags). This
module holds the top level and puts them together.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from prefixgate.backend.config import (
    DEFAULT_MODEL,
    LOAD_FORMATS,
    check_kv_offloading,
    engine_configs,
    parse_kv_events_config,
    parse_speculative_config,
)
from prefixgate.common import tracing
from prefixgate.common.schema import (
    REQUIRED,
    ConfigError,
    Key,
    at_least,
    check,
    non_negative,
    one_of,
    positive,
)
from prefixgate.proxy import auth, isolation, pd, rate_limits, response_ids
from prefixgate.proxy.observe import access_log
from prefixgate.proxy.upstream import discovery, health
from prefixgate.proxy.upstream.upstreams import TIMEOUTS, check_upstreams

MODEL = {
    "tokenizer": Key(str, None),     # dir with tokenizer.json, a .gguf, or smollm2 / demo
}
MODEL_SINGLE = {
    "name": Key(str, None),          # the served model's name (none: every model)
    **MODEL,
}
ANY_MODEL = "*"                      # `models:` entry for requests whose model has none


TOP = {
    "listen": Key(dict, dict, nested={
        "host": Key(str, "127.0.0.1"),
        "port": Key(int, 8080, lambda p: None if 0 <= p < 65536 else "must be 0..65535"),
        # gateway processes on that port (SO_REUSEPORT), run by a supervisor (proxy/workers.py)
        "workers": Key(int, 1, at_least(1, " (gateway processes)")),
    }),
    "upstreams": Key(list, list),
    "discovery": Key(dict, None),          # DNS discovery of more upstreams (proxy/discovery.py)
    "bundled": Key(dict, None, nested={
        "model": Key(str, DEFAULT_MODEL),      # a model dir, a .gguf, or smollm2 / demo
        "instances": Key(int, 1, positive),    # engine processes (more than one needs a router)
        # P/D: this many `--role prefill` and `--role decode` engines instead of `instances`
        # mixed ones; the gateway then drives them as `pd: {protocol: prefixgate}`
        "prefill": Key(int, 0, non_negative),
        "decode": Key(int, 0, non_negative),
        "host": Key(str, "127.0.0.1"),
        "args": Key(list, list),               # extra `prefixgate backend` flags
        # vLLM's speculative_config (prompt lookup): passed as --speculative-config
        "speculative_config": Key(dict, None),
        # vLLM's kv_events_config: passed as --kv-events-config, each engine on its own ports
        # (backend/config.py engine_configs; a port 0: a free port per engine)
        "kv_events_config": Key(dict, None),
        # --load-format: mmap (page in on use, share the page cache) or eager (read before ready)
        "load_format": Key(str, "mmap", one_of(*LOAD_FORMATS)),
        # the second KV tier (backend/kv_tier.py): --kv-offloading-size GiB,
        # --kv-offloading-path DIR; checked with the engine's own check (_bundled)
        "kv_offloading_size": Key((int, float), None),
        "kv_offloading_path": Key(str, None),
        "startup_timeout_s": Key((int, float), 600.0, positive),
    }),
    "model": Key(dict, dict, nested=MODEL_SINGLE),   # the single-model form of `models:`
    "models": Key(dict, dict),          # {served model name: {tokenizer: DIR}}
    "model_aliases": Key(dict, dict),   # {public name: served name}, rewritten before routing
    "passthrough": Key(list, list),     # native POST paths proxied as they are (/generate ...)
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
    # hardening (proxy/health.py, proxy/auth.py, proxy/rate_limits.py): validated in full by
    # their own specs
    "health": Key(dict, dict),
    "auth": Key(dict, None),
    "rate_limits": Key(dict, dict),    # where the keys' limits are counted: {store: redis://...}
    "responses": Key(dict, dict),      # {id_secret: ...}: response ids any replica can follow
    "admin_listen": Key(dict, None, nested={
        "host": Key(str, "127.0.0.1"),
        "port": Key(int, REQUIRED, lambda p: None if 0 <= p < 65536 else "must be 0..65535"),
    }),
    "shutdown_timeout_s": Key((int, float), 30.0, positive),   # SIGTERM: in-flight deadline
    "access_log": Key(dict, None),     # {path: FILE | "-", format: json | text} (access_log.py)
    "tracing": Key(dict, None),        # {otlp_endpoint: URL, ...} (tracing.py)
    # prefill/decode disaggregation: {protocol: vllm | sglang | prefixgate}, with upstreams of
    # `role: prefill` and `decode` (pd.py); without it every upstream must be `role: both`
    "pd": Key(dict, None),
    # each tenant's prefix cache its own: {cache: per_key | shared, ...} (proxy/isolation.py);
    # default per_key when auth.api_keys are set
    "isolation": Key(dict, None),
}


def validate(raw: Any) -> dict:
    """Validate a whole config mapping (plugins are checked when they are built)."""
    cfg = check(raw, TOP)
    cfg["upstreams"] = check_upstreams(cfg["upstreams"], cfg["timeouts"])
    cfg["health"] = check(cfg["health"], health.SPEC, "health")
    cfg["auth"] = auth.validate(cfg["auth"])
    cfg["rate_limits"] = rate_limits.validate(cfg["rate_limits"])
    cfg["responses"] = response_ids.validate(cfg["responses"])
    cfg["access_log"] = access_log.validate(cfg["access_log"])
    cfg["tracing"] = tracing.validate(cfg["tracing"])
    if cfg["discovery"] is not None:
        cfg["discovery"] = discovery.validate(cfg["discovery"], cfg["timeouts"])
    if not cfg["upstreams"] and cfg["bundled"] is None and cfg["discovery"] is None:
        raise ConfigError("upstreams", "required (a list of {name, url}), `discovery:` "
                                       "or `bundled:`")
    cfg["bundled"] = _bundled(cfg)
    cfg["pd"] = pd.validate(cfg)
    cfg["isolation"] = isolation.validate(cfg)
    for i, item in enumerate(cfg["plugins"]):
        if not (isinstance(item, dict) and len(item) == 1) and not isinstance(item, str):
            raise ConfigError(f"plugins[{i}]", "must be a plugin name or a one-key mapping "
                                               "{name: {settings}}")
    cfg["models"] = _models(cfg)
    cfg["model_aliases"] = _aliases(cfg["model_aliases"])
    cfg["passthrough"] = _passthrough(cfg["passthrough"])
    return cfg


def _bundled(cfg: dict) -> dict | None:
    """`bundled:` with its engines' roles: `prefill: N, decode: M` (both or neither), else
    `instances` engines doing both; P/D engines bring `pd: {protocol: prefixgate}`."""
    b = cfg["bundled"]
    if b is None:
        return None
    try:
        parse_speculative_config(b["speculative_config"])
    except ConfigError as e:
        raise e.under("bundled.speculative_config") from None
    check_kv_offloading(b["kv_offloading_size"], b["kv_offloading_path"],
                        name=lambda key: f"bundled.{key}")
    if bool(b["prefill"]) != bool(b["decode"]):
        raise ConfigError("bundled", "prefill and decode go together (e.g. prefill: 1, "
                                     "decode: 1): a P/D pair needs both")
    _check_kv_events(b["kv_events_config"], b["prefill"] + b["decode"] or b["instances"])
    if b["prefill"]:
        if cfg["pd"] is None:
            cfg["pd"] = {"protocol": "prefixgate"}
        return {**b, "instances": b["prefill"] + b["decode"],
                "roles": ["prefill"] * b["prefill"] + ["decode"] * b["decode"]}
    return {**b, "roles": ["both"] * b["instances"]}


def _check_kv_events(raw: dict | None, num_engines: int) -> None:
    """`bundled.kv_events_config` as the engines will take it, each with its own ports."""
    try:
        config = parse_kv_events_config(raw)
        if config is not None:
            engine_configs(config, num_engines)
    except ConfigError as e:
        raise e.under("bundled.kv_events_config") from None


def _models(cfg: dict) -> dict[str, dict]:
    """`models:` checked, with the single `model:` form folded in (under its name, or under
    ANY_MODEL when it names none)."""
    models = {}
    for name, item in cfg["models"].items():
        if not isinstance(name, str) or not name:
            raise ConfigError("models", f"model names must be non-empty strings, got {name!r}")
        models[name] = check(item, MODEL, f"models.{name}")
    single = cfg["model"]
    if single["tokenizer"] is not None:
        name = single["name"] or ANY_MODEL
        if name in models:
            raise ConfigError("model", f"model {name!r} is also under `models:`; keep one")
        models[name] = {"tokenizer": single["tokenizer"]}
    return models


def model_settings(cfg: dict, model: str | None) -> dict | None:
    """The `models:` entry a request for `model` uses (its own, else the ANY_MODEL one; a
    request naming no model uses the only entry there is), or None."""
    models = cfg["models"]
    if model in models:
        return models[model]
    if ANY_MODEL in models:
        return models[ANY_MODEL]
    if model is None and len(models) == 1:
        return next(iter(models.values()))
    return None


def _aliases(raw: dict) -> dict[str, str]:
    for public, served in raw.items():
        if not (isinstance(public, str) and isinstance(served, str) and public and served):
            raise ConfigError(f"model_aliases.{public}", "must map a public model name to "
                                                          "a served one (both strings)")
    return dict(raw)


def _passthrough(raw: list) -> list[str]:
    for i, path in enumerate(raw):
        if not isinstance(path, str) or not path.startswith("/") or "{" in path:
            raise ConfigError(f"passthrough[{i}]", f"must be a path starting with / "
                                                   f"(got {path!r})")
    return list(raw)


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
