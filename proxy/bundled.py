"""Standalone mode: launch the bundled engine as child processes and proxy to them."""
from __future__ import annotations

import asyncio
import json
import socket
import sys

from prefixgate.proxy.server import wait_ready
from prefixgate.proxy.upstream import check_upstreams


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BundledEngines:
    """Child `prefixgate backend` processes, each becoming one upstream of the gateway."""

    def __init__(self, cfg: dict, tracing: dict | None = None):
        self.cfg = cfg                      # the validated `bundled:` mapping
        self.roles = cfg.get("roles") or ["both"] * cfg["instances"]     # --role per engine
        self.tracing = tracing              # the gateway's `tracing:`: the engines trace too
        self.procs: list[asyncio.subprocess.Process] = []
        # ports are chosen up front so the gateway (and its plugins) can be built first
        self.ports = [free_port(cfg["host"]) for _ in self.roles]
        self.urls = [f"http://{cfg['host']}:{port}" for port in self.ports]

    def upstream_configs(self, timeouts: dict) -> list[dict]:
        """The engines as `upstreams:` entries, with every default filled in."""
        raw = [{"name": f"{role}{i}" if role != "both" else f"engine{i}", "url": url,
                "role": role} for i, (url, role) in enumerate(zip(self.urls, self.roles))]
        return check_upstreams(raw, timeouts)

    async def start(self) -> None:
        """Launch the engines and wait until each one's /health says 200, which is after its
        warm-up (wait_ready takes the 503 meanwhile, like a refused connection, as "not yet")."""
        for port, role in zip(self.ports, self.roles):
            cmd = [sys.executable, "-m", "prefixgate.backend.server", "--model", self.cfg["model"],
                   "--host", self.cfg["host"], "--port", str(port), "--role", role,
                   *self.engine_args()]
            self.procs.append(await asyncio.create_subprocess_exec(*cmd))
        await asyncio.gather(*(
            wait_ready(url, "/health", self.cfg["startup_timeout_s"], proc,
                       what=f"bundled engine at {url}", interval=0.25)
            for proc, url in zip(self.procs, self.urls)))

    def engine_args(self) -> list[str]:
        """`bundled.args`, `bundled.speculative_config`, `load_format` and `kv_offloading_*` as
        their flags, and the gateway's collector for the engines' own spans (their `llm_request`
        spans join the gateway's traces), each unless the args name it."""
        args = [str(a) for a in self.cfg["args"]]
        load_format = self.cfg.get("load_format", "mmap")
        if load_format != "mmap" and "--load-format" not in args:     # mmap: the engine's default
            args += ["--load-format", load_format]
        if self.cfg.get("speculative_config") and "--speculative-config" not in args:
            args += ["--speculative-config", json.dumps(self.cfg["speculative_config"])]
        for key, flag in (("kv_offloading_size", "--kv-offloading-size"),
                          ("kv_offloading_path", "--kv-offloading-path")):
            if self.cfg.get(key) and flag not in args:
                args += [flag, str(self.cfg[key])]
        if self.tracing is not None and "--otlp-traces-endpoint" not in args:
            args += ["--otlp-traces-endpoint", self.tracing["otlp_endpoint"],
                     "--otlp-service-name", f"{self.tracing['service_name']}-engine"]
        return args

    async def stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
