"""Standalone mode: launch the bundled engine as child processes and proxy to them."""
from __future__ import annotations

import asyncio
import socket
import sys
import time

import aiohttp

from prefixgate.proxy.config import check_upstreams


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BundledEngines:
    """Child `prefixgate backend` processes, each becoming one upstream of the gateway."""

    def __init__(self, cfg: dict):
        self.cfg = cfg                      # the validated `bundled:` mapping
        self.procs: list[asyncio.subprocess.Process] = []
        # ports are chosen up front so the gateway (and its plugins) can be built first
        self.ports = [free_port(cfg["host"]) for _ in range(cfg["instances"])]
        self.urls = [f"http://{cfg['host']}:{port}" for port in self.ports]

    def upstream_configs(self, timeouts: dict) -> list[dict]:
        """The engines as `upstreams:` entries, with every default filled in."""
        raw = [{"name": f"engine{i}", "url": url} for i, url in enumerate(self.urls)]
        return check_upstreams(raw, timeouts)

    async def start(self) -> None:
        for port in self.ports:
            cmd = [sys.executable, "-m", "prefixgate.backend.server", "--model", self.cfg["model"],
                   "--host", self.cfg["host"], "--port", str(port), *map(str, self.cfg["args"])]
            self.procs.append(await asyncio.create_subprocess_exec(*cmd))
        await asyncio.gather(*(self._wait_ready(p, u) for p, u in zip(self.procs, self.urls)))

    async def _wait_ready(self, proc, url: str) -> None:
        deadline = time.monotonic() + self.cfg["startup_timeout_s"]
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if proc.returncode is not None:
                    raise RuntimeError(f"bundled engine at {url} exited with {proc.returncode}")
                try:
                    async with session.get(url + "/health",
                                           timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.25)
        raise RuntimeError(f"bundled engine at {url} not ready after "
                           f"{self.cfg['startup_timeout_s']}s")

    async def stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
