"""`prefixgate` command line: serve, backend, verify-weights, bench, doctor."""
from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.resources
import logging
import signal
import sys

from aiohttp.http_exceptions import HttpProcessingError

from prefixgate.proxy import config as config_mod
from prefixgate.proxy.server import install_uvloop, start_app
from prefixgate.proxy.spec import ConfigError

# subcommands implemented elsewhere: name -> module whose main(argv) -> int runs it
DELEGATED = {
    "backend": ("prefixgate.backend.server", "serve a model with the bundled engine"),
    "verify-weights": ("prefixgate.backend.loader", "check a checkpoint's shards, hashes, keys"),
    "bench": ("prefixgate.proxy.bench.cli", "measure TTFT/TPOT/goodput against a URL"),
    "doctor": ("prefixgate.proxy.doctor.cli", "diagnose TTFT problems of an OpenAI-compatible URL"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return module.main(argv[1:]) or 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    return serve_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description="Cut LLM time-to-first-"
                                     "token: a streaming gateway and a bundled engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the gateway (no --config: standalone demo)")
    serve.add_argument("--config", help="YAML config file (default: conf/standalone.yaml, the "
                                        "bundled engine on the demo model)")
    serve.add_argument("--host", help="listen address (overrides listen.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    serve.add_argument("--log-level", default="info")
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def load_config(args) -> dict:
    if args.config:
        cfg = config_mod.load(args.config)
    else:
        path = importlib.resources.files("prefixgate.conf") / "standalone.yaml"
        with importlib.resources.as_file(path) as p:
            cfg = config_mod.load(p)
    if args.host:
        cfg["listen"]["host"] = args.host
    if args.port is not None:
        cfg["listen"]["port"] = args.port
    return cfg


def serve_command(args) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(not_a_client_error)
    try:
        cfg = load_config(args)
    except ConfigError as e:
        print(f"prefixgate: config error: {e}", file=sys.stderr)
        return 2
    install_uvloop()
    try:
        asyncio.run(serve(cfg, reload_config=lambda: load_config(args)))
    except ConfigError as e:        # plugin settings are checked when the chain is built
        print(f"prefixgate: config error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:
        print(f"prefixgate: {e}", file=sys.stderr)
        return 1
    return 0


async def serve(cfg: dict, reload_config=None) -> None:
    """Run until SIGINT/SIGTERM; SIGHUP re-reads the config through `reload_config()`."""
    from prefixgate.proxy.app import Gateway
    from prefixgate.proxy.bundled import BundledEngines

    engines = None
    if cfg["bundled"] is not None:
        engines = BundledEngines(cfg["bundled"])
        cfg = with_engines(cfg, engines)
    gateway = Gateway(cfg)          # builds (and so validates) the plugin chain first
    try:
        if engines is not None:
            print(f"prefixgate: starting {len(engines.urls)} bundled engine(s) on model "
                  f"{cfg['bundled']['model']!r} ...", flush=True)
            await engines.start()
        runner, url = await start_app(gateway.make_app(), cfg["listen"]["host"],
                                      cfg["listen"]["port"], **gateway.server_kw())
        admin = None
        if cfg["admin_listen"] is not None:
            admin, admin_url = await start_app(gateway.make_admin_app(),
                                               cfg["admin_listen"]["host"],
                                               cfg["admin_listen"]["port"])
            print(f"prefixgate: admin (/metrics, /health) on {admin_url}", flush=True)
        names = ", ".join(f"{u.name}={u.url}" for u in gateway.upstreams)
        print(f"prefixgate: gateway listening on {url} (OpenAI API at {url}/v1) -> {names}",
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if reload_config is not None:
            lock = asyncio.Lock()
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(
                reload(gateway, reload_config, engines, lock)))
        await stop.wait()
        print(f"prefixgate: shutting down: no new connections; in-flight requests get up to "
              f"{cfg['shutdown_timeout_s']}s", flush=True)
        await runner.cleanup()      # stop listening, drain running handlers, then close
        if admin is not None:
            await admin.cleanup()
        print("prefixgate: stopped", flush=True)
    finally:
        if engines is not None:
            await engines.stop()


def not_a_client_error(record: logging.LogRecord) -> bool:
    """Drop aiohttp's traceback for a malformed request (answered 400): a client's mistake
    must not flood the gateway's log."""
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, HttpProcessingError)


def with_engines(cfg: dict, engines) -> dict:
    return {**cfg, "upstreams": cfg["upstreams"] + engines.upstream_configs(cfg["timeouts"])}


async def reload(gateway, reload_config, engines, lock: asyncio.Lock) -> None:
    """SIGHUP: apply the file's current config, or log why not and keep the running one."""
    log = logging.getLogger("prefixgate")
    async with lock:
        try:
            cfg = reload_config()
            if engines is not None:
                cfg = with_engines(cfg, engines)
            await gateway.reload(cfg)
        except ConfigError as e:
            log.error("config reload refused, keeping the running config: %s", e)
        except Exception:
            log.exception("config reload failed, keeping the running config")
        else:
            print("prefixgate: config reloaded", flush=True)

if __name__ == "__main__":
    raise SystemExit(main())
