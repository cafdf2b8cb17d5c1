"""`prefixgate` command line: serve, backend, verify-weights, bench, doctor, tune."""
from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.resources
import logging
import shlex
import signal
import sys
from functools import partial
from pathlib import Path

import yaml
from aiohttp.http_exceptions import HttpProcessingError

from prefixgate.backend.config import BUILTIN_MODELS, DEFAULT_MODEL, resolve_model
from prefixgate.common.processes import die_with_parent
from prefixgate.common.runtime import install_uvloop, start_app
from prefixgate.common.schema import ConfigError
from prefixgate.proxy.config import gateway as config_mod
from prefixgate.proxy.workers import Supervisor, Worker

# subcommands with a command line of their own (run_delegated): name -> help
DELEGATED = {
    "backend": "serve a model with the bundled engine",
    "verify-weights": "check a checkpoint's shards, hashes, keys",
    "bench": "measure TTFT/TPOT/goodput against a URL",
    "doctor": "diagnose TTFT problems of an OpenAI-compatible URL",
    "tune": "sweep the engine's flags on your prompts against your SLO",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        return run_delegated(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    args.argv = argv
    return serve_command(args)


SERVE_HELP = """\
Run the gateway. Four ways to say what it serves (at most one of the first three):

  prefixgate serve --config gateway.yaml        a YAML config file
  prefixgate serve --upstream URL [--upstream URL ...]
                                                OpenAI-compatible servers you already run
  prefixgate serve MODEL                        the bundled engine on that model: a Hugging
                                                Face directory, a .gguf file, or a built-in
                                                name (smollm2; demo: tiny, random weights)
  prefixgate serve                              the bundled engine on SmolLM2-135M-Instruct
                                                (also `prefixgate serve smollm2`)

--upstream and MODEL build the config in memory; --print-config shows it as YAML, ready
to save and run with --config."""

SERVE_EPILOG = """\
examples:
  prefixgate serve --upstream http://10.0.0.1:8000 --upstream http://10.0.0.2:8000
  prefixgate serve --upstream http://10.0.0.1:8000 --policy chwbl --normalize
  prefixgate serve /models/Qwen2.5-0.5B-Instruct --port 8000
  prefixgate serve ~/models/qwen2.5-0.5b-instruct-q8_0.gguf
  prefixgate serve --upstream http://10.0.0.1:8000 --print-config > gateway.yaml"""

# --policy: the routing plugin it puts in the chain
POLICIES = {
    "round_robin": {"round_robin": {}},
    "least_inflight": {"least_inflight": {}},
    "chwbl": {"prefix_route": {"policy": "chwbl"}},
    "cache_aware": {"prefix_route": {"policy": "cache_aware"}},
    "predicted_ttft": {"prefix_route": {"policy": "predicted_ttft"}},
}
# measured best (docs/routing.md, "Predicted-TTFT routing"): on even fleets it keeps every
# request at its cache home as cache_aware does; on uneven or saturated ones it cuts p95
DEFAULT_POLICY = "predicted_ttft"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description="Cut LLM time-to-first-"
                                     "token: a streaming gateway and a bundled engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the gateway (--config FILE, --upstream URL, "
                                         "MODEL, or nothing: SmolLM2 standalone)",
                           description=SERVE_HELP, epilog=SERVE_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("model_dir", nargs="?", metavar="MODEL",
                       help="serve this model with the bundled engine, the gateway in front "
                            "(conf/standalone.yaml with the model replaced): a Hugging Face "
                            "directory, a .gguf file, smollm2 (the default) or demo (tiny, "
                            "random weights)")
    serve.add_argument("--config", metavar="FILE",
                       help="YAML config file (without it, --upstream or MODEL: "
                            "conf/standalone.yaml, the bundled engine on smollm2)")
    serve.add_argument("--upstream", metavar="URL", action="append",
                       help="an OpenAI-compatible server to route to; repeat the flag for each "
                            "one (names default to host:port)")
    serve.add_argument("--policy", choices=list(POLICIES),
                       help="routing with --upstream or MODEL: round_robin, "
                            "least_inflight, chwbl (prefix_route: consistent hashing with "
                            "bounded loads), cache_aware (prefix_route: the prefix index, "
                            "like SGLang's router) or predicted_ttft (prefix_route: the least "
                            "predicted time to first token, speeds learned online). "
                            f"Default with --upstream: {DEFAULT_POLICY}; with MODEL: none "
                            "added")
    serve.add_argument("--normalize", action="store_true",
                       help="with --upstream or MODEL: put the normalize plugin first "
                            "(moves timestamps and request ids out of the prompt's head; "
                            "MODEL's config has it already)")
    serve.add_argument("--host", help="listen address (overrides listen.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    serve.add_argument("--workers", type=int, metavar="N",
                       help="gateway processes sharing the port (SO_REUSEPORT), under a "
                            "supervisor that starts bundled engines once (overrides "
                            "listen.workers; default 1: one process)")
    serve.add_argument("--access-log", metavar="PATH",
                       help="write the access log, one JSON line per request, to PATH (`-`: "
                            "stdout; overrides access_log.path)")
    serve.add_argument("--otlp-traces-endpoint", metavar="URL",
                       help="export OpenTelemetry spans to this OTLP/HTTP collector, e.g. "
                            "http://localhost:4318 (vLLM's flag; overrides "
                            "tracing.otlp_endpoint; needs the `otel` extra)")
    serve.add_argument("--print-config", action="store_true",
                       help="print the config as YAML (what you would write for --config) "
                            "and exit without starting anything")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(parser=serve)
    for name, help_text in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def run_delegated(name: str, argv: list[str]) -> int:
    """A DELEGATED subcommand's own main(argv); imported only when it runs, so `prefixgate
    serve` loads neither the engine nor the tools."""
    if name == "backend":
        from prefixgate.backend.cli import main as command
    elif name == "verify-weights":
        from prefixgate.backend.cli import verify_weights_main as command
    elif name == "bench":
        from prefixgate.proxy.bench.cli import main as command
    elif name == "tune":
        from prefixgate.proxy.tune.cli import main as command
    else:
        from prefixgate.proxy.doctor.cli import main as command
    return command(argv) or 0


def check_serve_args(args) -> None:
    """The three sources are exclusive; --policy/--normalize only for the built configs.
    Errors go through argparse (usage + one line, exit 2)."""
    error = args.parser.error
    given = [flag for flag, value in (("--config", args.config), ("--upstream", args.upstream),
                                      ("MODEL", args.model_dir)) if value]
    if args.model_dir and "://" in args.model_dir:
        error(f"MODEL {args.model_dir} is a URL: give each upstream its own --upstream")
    if len(given) > 1:
        error(f"{' and '.join(given)} cannot be combined: give a config file, upstream URLs "
              "or a model directory")
    tuning = [flag for flag, value in (("--policy", args.policy),
                                       ("--normalize", args.normalize)) if value]
    if tuning and args.config:
        error(f"{' and '.join(tuning)} cannot be combined with --config: put the plugins in "
              "the YAML file's `plugins:` list")
    if tuning and not given:
        error(f"{' and '.join(tuning)} needs --upstream URL or MODEL (the demo: "
              "`prefixgate serve demo`)")


def with_plugins(plugins: list, policy: str | None, normalize: bool) -> list:
    """`plugins` with normalize first (unless it is there) and the policy before metrics."""
    plugins = list(plugins)
    names = [next(iter(p)) if isinstance(p, dict) else p for p in plugins]
    if normalize and "normalize" not in names:
        plugins.insert(0, {"normalize": {}})
        names.insert(0, "normalize")
    if policy is not None:
        at = names.index("metrics") if "metrics" in names else len(plugins)
        plugins.insert(at, dict(POLICIES[policy]))
    return plugins


def standalone_raw() -> dict:
    path = importlib.resources.files("prefixgate.conf") / "standalone.yaml"
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def read_raw(path: str) -> dict:
    """A config file's own mapping (validated first, so its errors name the file's keys)."""
    config_mod.load(path)
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))


def raw_config(args) -> dict:
    """The config as a user would write it: from --config, --upstream, MODEL or the
    standalone default, with --host/--port applied."""
    if args.config:
        raw = read_raw(args.config)
    elif args.upstream:
        raw = {"listen": {"host": "127.0.0.1", "port": 8080},
               "upstreams": [{"url": url} for url in args.upstream],
               "plugins": with_plugins([{"metrics": {}}], args.policy or DEFAULT_POLICY,
                                       args.normalize)}
    else:
        raw = standalone_raw()
        if args.model_dir:
            model = args.model_dir
            if model not in BUILTIN_MODELS:
                model = str(Path(model).resolve())
            raw["bundled"] = {**raw["bundled"], "model": model}
            raw["plugins"] = with_plugins(raw["plugins"], args.policy, args.normalize)
    overrides = {"host": args.host, "port": args.port, "workers": args.workers}
    if any(value is not None for value in overrides.values()):
        listen = raw["listen"] = dict(raw.get("listen") or {})
        listen.update((key, value) for key, value in overrides.items() if value is not None)
    if args.access_log:
        raw["access_log"] = {**(raw.get("access_log") or {}), "path": args.access_log}
    if args.otlp_traces_endpoint:
        raw["tracing"] = {**(raw.get("tracing") or {}), "otlp_endpoint": args.otlp_traces_endpoint}
    return raw


def load_config(args) -> dict:
    return config_mod.validate(raw_config(args))


def missing_model(args) -> str | None:
    """Why MODEL (smollm2 when the standalone default serves) cannot be served (None: it can).
    Checked before anything starts, so a missing file or package is one clear line."""
    model = args.model_dir or (None if args.config or args.upstream else DEFAULT_MODEL)
    if model is None or model == "demo":
        return None
    if model.endswith((".yaml", ".yml")) and Path(model).is_file():
        return f"MODEL {model} is a YAML file; did you mean --config {model}?"
    try:
        resolve_model(model)
    except ConfigError as e:
        return f"MODEL {e.reason}"
    return None


def print_config(args, raw: dict) -> None:
    """The config as YAML, with the command it came from as a comment."""
    argv = [a for a in args.argv if a != "--print-config"]
    print(f"# prefixgate {shlex.join(argv)}, as a file for `prefixgate serve --config FILE`")
    print(yaml.safe_dump(raw, sort_keys=False), end="")


def setup_logging(level: str, who: str = "") -> None:
    logging.basicConfig(level=level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s{who}: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(not_a_client_error)


def serve_command(args) -> int:
    setup_logging(args.log_level)
    check_serve_args(args)
    if (problem := missing_model(args)) is not None:
        print(f"prefixgate: {problem}", file=sys.stderr)
        return 2
    try:
        raw = raw_config(args)
        cfg = config_mod.validate(copy.deepcopy(raw))     # the raw mapping stays as written
    except ConfigError as e:
        print(f"prefixgate: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print_config(args, raw)
        return 0
    install_uvloop()
    if cfg["listen"]["workers"] > 1:
        return run_gateway(supervise(cfg, args))
    return run_gateway(serve(cfg, reload_config=lambda: load_config(args)))


def run_gateway(main) -> int:
    """Run `main` (serve, a worker's serve, or supervise) to its end: the exit status, an
    error as one line."""
    try:
        code = asyncio.run(main)
    except ConfigError as e:        # plugin settings are checked when the chain is built
        print(f"prefixgate: config error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:
        print(f"prefixgate: {e}", file=sys.stderr)
        return 1
    return code or 0


async def supervise(cfg: dict, args) -> int:
    """`--workers N`: N processes of `run_worker` under a supervisor (proxy/workers.py), the
    bundled engines started once, by it."""
    from prefixgate.proxy.app import Gateway
    from prefixgate.proxy.bundled import BundledEngines, with_engines

    engines = None
    if cfg["bundled"] is not None:
        engines = BundledEngines(cfg["bundled"], cfg["tracing"])
    entries = engines.upstream_entries() if engines is not None else []
    cfg = with_engines(cfg, entries)
    Gateway(cfg)        # builds (and so validates) the plugin chain before anything starts
    supervisor = Supervisor(cfg, partial(run_worker, args.argv, entries),
                            lambda: with_engines(load_config(args), entries), engines)
    return await supervisor.run()


def run_worker(argv: list[str], engine_entries: list[dict], worker: Worker, cfg: dict,
               ready) -> None:
    """One process of `serve --workers N` (the supervisor spawns it): `serve` on the
    supervisor's ports; SIGHUP re-reads the config as a single process does, the bundled
    engines' upstreams (`engine_entries`) added."""
    from prefixgate.proxy.bundled import with_engines

    for sig in (signal.SIGHUP, signal.SIGUSR1):     # until serve() handles them (the
        signal.signal(sig, signal.SIG_IGN)          # supervisor holds its own back meanwhile)
    die_with_parent()
    args = build_parser().parse_args(argv)
    args.argv = argv
    setup_logging(args.log_level, f" [worker {worker.index}]")
    install_uvloop()
    sys.exit(run_gateway(serve(cfg, lambda: with_engines(load_config(args), engine_entries),
                               worker, ready)))


async def serve(cfg: dict, reload_config=None, worker: Worker | None = None,
                ready=None) -> None:
    """Run until SIGINT/SIGTERM; SIGHUP re-reads the config through `reload_config()`.
    As a `worker` of `serve --workers N`: on the supervisor's ports beside the other workers,
    its URL sent through `ready` (a pipe's end) once it listens; the supervisor runs the
    bundled engines."""
    from prefixgate.proxy.app import Gateway
    from prefixgate.proxy.bundled import BundledEngines, with_engines

    engines = None
    if cfg["bundled"] is not None and worker is None:
        engines = BundledEngines(cfg["bundled"], cfg["tracing"])
        cfg = with_engines(cfg, engines.upstream_entries())
    me = "prefixgate: " if worker is None else f"prefixgate: worker {worker.index}: "
    gateway = Gateway(cfg, worker)      # builds (and so validates) the plugin chain first
    try:
        if engines is not None:
            print(f"{me}starting {len(engines.urls)} bundled engine(s) on model "
                  f"{cfg['bundled']['model']!r} ...", flush=True)
            await engines.start()
        shared = worker is not None         # SO_REUSEPORT, on the ports the supervisor holds
        listen, admin_listen = cfg["listen"], cfg["admin_listen"]
        runner, url = await start_app(gateway.make_app(), listen["host"],
                                      worker.port if shared else listen["port"],
                                      reuse_port=shared, **gateway.server_kw())
        admin = None
        if admin_listen is not None:
            admin, admin_url = await start_app(
                gateway.make_admin_app(), admin_listen["host"],
                worker.admin_port if shared else admin_listen["port"], reuse_port=shared)
            if not shared:
                print(f"{me}admin (/metrics, /health) on {admin_url}", flush=True)
        if shared:
            ready.send(url)
            ready.close()
        else:
            names = ", ".join(f"{u.name}={u.url}" for u in gateway.upstreams)
            print(f"{me}gateway listening on {url} (OpenAI API at {url}/v1) -> {names}",
                  flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if gateway.observer is not None:       # logrotate: reopen the access log
            loop.add_signal_handler(signal.SIGUSR1, gateway.observer.reopen)
        if reload_config is not None:
            lock = asyncio.Lock()
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(
                reload(gateway, reload_config, engines, lock, me)))
        await stop.wait()
        print(f"{me}shutting down: no new connections; in-flight requests get up to "
              f"{cfg['shutdown_timeout_s']}s", flush=True)
        await runner.cleanup()      # stop listening, drain running handlers, then close
        if admin is not None:
            await admin.cleanup()
        print(f"{me}stopped", flush=True)
    finally:
        if engines is not None:
            await engines.stop()


def not_a_client_error(record: logging.LogRecord) -> bool:
    """Drop aiohttp's traceback for a malformed request (answered 400): a client's mistake
    must not flood the gateway's log."""
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, HttpProcessingError)


async def reload(gateway, reload_config, engines, lock: asyncio.Lock,
                 me: str = "prefixgate: ") -> None:
    """SIGHUP: apply the file's current config, or log why not and keep the running one."""
    from prefixgate.proxy.bundled import with_engines

    log = logging.getLogger("prefixgate")
    async with lock:
        try:
            cfg = reload_config()
            if engines is not None:
                cfg = with_engines(cfg, engines.upstream_entries())
            await gateway.reload(cfg)
        except ConfigError as e:
            log.error("config reload refused, keeping the running config: %s", e)
        except Exception:
            log.exception("config reload failed, keeping the running config")
        else:
            print(f"{me}config reloaded", flush=True)

if __name__ == "__main__":
    raise SystemExit(main())
