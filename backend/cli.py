"""`prefixgate backend` (also `python -m prefixgate.backend`): the flags, named as vLLM's where
vLLM has one, turned into `ServerArgs`, and the process that serves them; and
`prefixgate verify-weights DIR`.

Every flag is checked before the model loads: a bad one ends the process with exit status 1
and one line, `prefixgate backend: --flag: [key: ]reason`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from prefixgate.backend.checkpoint_files import MANIFEST_NAMES, WeightError, write_manifest
from prefixgate.backend.config import (
    BUILTIN_MODELS,
    FLAGS,
    EngineArgs,
    Flag,
    KVEventsConfig,
    ServerArgs,
    SpeculativeConfig,
    parse_kv_events_config,
    parse_speculative_config,
    resolve_model,
)
from prefixgate.backend.loader import verify_weights
from prefixgate.backend.server import serve_forever
from prefixgate.backend.warmup import WarmupError
from prefixgate.common import tracing
from prefixgate.common.runtime import run_on_uvloop
from prefixgate.common.schema import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """Every flag of backend/config.py's table (FLAGS), in its order."""
    p = argparse.ArgumentParser(prog="prefixgate backend", description="Serve a Llama/Qwen2/"
                                "Mistral checkpoint with the bundled engine.")
    for flag in FLAGS:
        p.add_argument(flag.option, dest=flag.name, **_argparse_keywords(flag))
    return p


def _argparse_keywords(flag: Flag) -> dict:
    """How argparse takes `flag`: a switch stores True (False when negated), any other flag
    its value (typed, unless a string)."""
    keywords = {"default": flag.default,
                "help": argparse.SUPPRESS if flag.hidden else flag.help}
    if flag.type is bool:
        return {**keywords, "action": "store_false" if flag.negated else "store_true"}
    if flag.type is not str:
        keywords["type"] = flag.type
    if flag.choices is not None and flag.parser_checks:
        keywords["choices"] = flag.choices
    extra = {"metavar": flag.metavar, "nargs": flag.nargs}
    return {**keywords, **{k: v for k, v in extra.items() if v is not None}}


# --- flags -> settings (ConfigError names the flag) -----------------------------------------

def _flag_value(flag: str, parse, raw):
    """`parse(raw)`, its ConfigError put under `flag`: `--flag: key: reason`."""
    try:
        return parse(raw)
    except ConfigError as e:
        raise ConfigError(flag, str(e)) from None


def speculative_config(ns: argparse.Namespace) -> SpeculativeConfig | None:
    return _flag_value("--speculative-config", parse_speculative_config, ns.speculative_config)


def kv_events_config(ns: argparse.Namespace) -> KVEventsConfig | None:
    return _flag_value("--kv-events-config", parse_kv_events_config, ns.kv_events_config)


def tracing_config(ns: argparse.Namespace) -> dict | None:
    """The tracing config the flags ask for (None: no tracing)."""
    if not ns.otlp_traces_endpoint:
        return None
    service = ns.otlp_service_name or os.environ.get("OTEL_SERVICE_NAME") or "prefixgate-engine"
    raw = {"otlp_endpoint": ns.otlp_traces_endpoint, "service_name": service}
    try:
        return tracing.validate(raw)
    except ConfigError as e:
        raise ConfigError("--otlp-traces-endpoint", e.reason) from None


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The engine's flags (FLAGS' scopes setting and engine) as EngineArgs; the structured
    ones parsed, the engine answering to the first --served-model-name."""
    values = {flag.name: getattr(ns, flag.name) for flag in FLAGS if flag.engine}
    return EngineArgs(**{
        **values, "served_model_name": ns.served_model_name[0] if ns.served_model_name else None,
        "speculative_config": speculative_config(ns),
        "kv_offloading_size": ns.kv_offloading_size or None,
        "kv_events_config": kv_events_config(ns)})


def server_args(ns: argparse.Namespace) -> ServerArgs:
    if ns.served_model_name and not all(ns.served_model_name):
        raise ConfigError("--served-model-name", "a name must not be empty")
    tracing_cfg = tracing_config(ns)
    return ServerArgs(engine=engine_args(ns), host=ns.host, port=ns.port, listen_fd=ns.listen_fd,
                      served_model_names=ns.served_model_name,
                      default_max_tokens=ns.default_max_tokens,
                      warm_up=not ns.skip_server_warmup, tracing=tracing_cfg)


def parse_args(argv: list[str]) -> ServerArgs:
    """`prefixgate backend`'s flags as ServerArgs (what `server.start_server` takes)."""
    return server_args(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_on_uvloop(serve_forever(server_args(ns)))
    except KeyboardInterrupt:
        pass
    # a bad model dir, flags or weights (before listening), or a warm-up that cannot run
    except (FileNotFoundError, ValueError, OSError, WeightError, WarmupError) as e:
        print(f"prefixgate backend: {e}", file=sys.stderr)
        return 1
    return 0


def verify_weights_main(argv: list[str] | None = None) -> int:
    """`prefixgate verify-weights DIR`: print the report; exit 1 on any problem."""
    parser = argparse.ArgumentParser(
        prog="prefixgate verify-weights",
        description="Check a checkpoint: a Hugging Face dir (shard index vs files, sha256 "
                    "manifest, tensor names and shapes) or a .gguf file (metadata, tensor "
                    "names, shapes and types, every tensor's data read).")
    parser.add_argument("model_dir", metavar="MODEL", help="Hugging Face model directory "
                        "(config.json + safetensors), a .gguf file, or a built-in name")
    parser.add_argument("--write-manifest", action="store_true",
                        help="after the checks pass, record the weight files' hashes in "
                        f"{MANIFEST_NAMES[0]}")
    args = parser.parse_args(argv)
    if args.model_dir in BUILTIN_MODELS:
        try:
            args.model_dir = resolve_model(args.model_dir)
        except ConfigError as e:
            print(f"prefixgate verify-weights: {e.reason}", file=sys.stderr)
            return 1
    if args.write_manifest and os.path.isfile(args.model_dir):
        parser.error("--write-manifest records a directory's weight files; a .gguf file is one "
                     "file: `sha256sum FILE.gguf` is its manifest")
    report = verify_weights(args.model_dir)
    print(report.render())
    if report.ok and args.write_manifest:
        print(f"wrote {write_manifest(args.model_dir)}")
    return 0 if report.ok else 1
