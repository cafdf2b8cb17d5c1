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
    DEFAULT_MAX_TOKENS,
    DEFAULT_MODEL,
    LOAD_FORMATS,
    ROLES,
    EngineArgs,
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
    p = argparse.ArgumentParser(prog="prefixgate backend", description="Serve a Llama/Qwen2/"
                                "Mistral checkpoint with the bundled engine.")
    defaults = EngineArgs()
    _model_flags(p, defaults)
    _kv_cache_flags(p, defaults)
    _scheduling_flags(p, defaults)
    _serving_flags(p)
    _pd_flags(p, defaults)
    _feature_flags(p)
    p.add_argument("--log-level", default="info")
    return p


def _model_flags(p: argparse.ArgumentParser, defaults: EngineArgs) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a Hugging Face model dir, a .gguf file, or a built-in name: "
                   f"{DEFAULT_MODEL} (the default), demo (tiny, random weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="take the tokenizer and chat template from here instead: a directory "
                   "with tokenizer.json, a .gguf file, or a built-in name (default: --model's)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names the model answers to; the first is the one responses carry "
                   "(default: a built-in model's name, the dir's name, or the .gguf file's stem)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on "
                   "CPU, bf16/fp16 on CUDA)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--load-format", default=defaults.load_format, choices=LOAD_FORMATS,
                   help="mmap (default): weights memory-mapped from the safetensors files, paged "
                   "in on first use and shared through the page cache; eager: read whole into "
                   "memory before serving (no page faults on first requests)")


def _kv_cache_flags(p: argparse.ArgumentParser, defaults: EngineArgs) -> None:
    p.add_argument("--block-size", type=int, default=defaults.block_size,
                   help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size in bytes, e.g. 2GiB (default: 1GiB on CPU, 85%% of free "
                   "memory on CUDA)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto | fp8 (e4m3) | float16 | bfloat16 | float32")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's)")
    # a fault injector, not a feature: the quality gate's tests plant it to check that the gate
    # catches a KV cache less precise than FP8 (`prefixgate bench --scenario quality`)
    p.add_argument("--debug-kv-mantissa-bits", type=int, default=None, choices=range(0, 23),
                   metavar="N", help=argparse.SUPPRESS)


def _scheduling_flags(p: argparse.ArgumentParser, defaults: EngineArgs) -> None:
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 512 on CPU, 2048 on CUDA)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="tokens guaranteed each step to the oldest prefill, so short "
                   "prompts cannot starve it (default: budget/4)")
    p.add_argument("--step-overhead-tokens", type=int, default=None,
                   help="a step's fixed cost in tokens of compute: steps stop growing once "
                   "more prefill would delay first tokens more than it saves (default: 32 on "
                   "CPU; 0 on CUDA: fill every step)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="take prompts whole (baseline)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def _serving_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens when a request sets none")
    p.add_argument("--skip-server-warmup", action="store_true",
                   help="serve at once: no warm-up run before /health says 200 (the first "
                   "requests then pay for page faults, allocator growth and kernel compilation)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send one `llm_request` span per request to this OTLP/HTTP collector, "
                   "e.g. http://localhost:4318 (needs the `otel` extra)")
    p.add_argument("--otlp-service-name", default=None,
                   help="the spans' service.name (default: $OTEL_SERVICE_NAME or "
                   "prefixgate-engine)")


def _pd_flags(p: argparse.ArgumentParser, defaults: EngineArgs) -> None:
    p.add_argument("--role", default=defaults.role, choices=ROLES,
                   help="prefill: answer leg 1 of a P/D pair and hold the prompt's KV for a "
                   "decode engine; decode: pull it and decode (kv_transfer_params, as vLLM's KV "
                   "connectors); both (default)")
    p.add_argument("--kv-transfer-host", default=None,
                   help="where the KV transfer server listens (prefill, both; default: --host)")
    p.add_argument("--kv-transfer-port", type=int, default=defaults.kv_transfer_port,
                   help="its port (default 0: a free one; answers carry the real one)")
    p.add_argument("--kv-transfer-timeout", type=float, default=defaults.kv_transfer_timeout,
                   help="seconds a prefill engine holds a prompt's KV for its pull, and a pull "
                   "may take (default %(default)s)")


def _feature_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='prompt-lookup speculative decoding, as vLLM\'s: \'{"method": "ngram", '
                   '"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": '
                   '2}\' (also disable_by_batch_size, min_acceptance_rate)')
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                   help="a second KV tier of this many GiB (as vLLM's flag): blocks evicted from "
                   "the KV cache are kept there and loaded back on a prefix hit instead of "
                   "recomputed; pinned host memory on CUDA, a memory-mapped file on CPU "
                   "(default 0: off)")
    p.add_argument("--kv-offloading-path", default=None, metavar="DIR",
                   help="on CPU, the directory of the second tier's file, e.g. on a fast local "
                   "disk (default: the temp dir; the file is unlinked at once, so it never "
                   "outlives the engine)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV cache events over ZMQ in vLLM\'s format, as vLLM\'s flag: '
                   '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
                   '"tcp://*:5557", "topic": "kv-events", "replay_endpoint": "tcp://*:5558"}\' '
                   '(also buffer_steps, hwm, max_queue_size; a port 0 binds a free one)')


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
    return EngineArgs(
        model=ns.model, tokenizer=ns.tokenizer, dtype=ns.dtype, device=ns.device,
        load_format=ns.load_format, block_size=ns.block_size, num_kv_blocks=ns.num_kv_blocks,
        kv_cache_memory=ns.kv_cache_memory, kv_cache_dtype=ns.kv_cache_dtype,
        max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        step_overhead_tokens=ns.step_overhead_tokens,
        enable_chunked_prefill=not ns.no_chunked_prefill,
        enable_prefix_caching=not ns.no_prefix_caching,
        attention_backend=ns.attention_backend, enforce_eager=ns.enforce_eager,
        served_model_name=ns.served_model_name[0] if ns.served_model_name else None,
        role=ns.role, kv_transfer_host=ns.kv_transfer_host, kv_transfer_port=ns.kv_transfer_port,
        kv_transfer_timeout=ns.kv_transfer_timeout, speculative_config=speculative_config(ns),
        kv_offloading_size=ns.kv_offloading_size or None,
        kv_offloading_path=ns.kv_offloading_path, kv_events_config=kv_events_config(ns),
        debug_kv_mantissa_bits=ns.debug_kv_mantissa_bits)


def server_args(ns: argparse.Namespace) -> ServerArgs:
    if ns.served_model_name and not all(ns.served_model_name):
        raise ConfigError("--served-model-name", "a name must not be empty")
    tracing_cfg = tracing_config(ns)
    return ServerArgs(engine=engine_args(ns), host=ns.host, port=ns.port,
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
