"""Standalone mode: launch the bundled engine as child processes and proxy to them.

With `bundled.kv_events_config` every engine gets `--kv-events-config` with ports of its own
(backend/config.py `engine_configs`: engine i moves each port it binds by i times the
number it binds, so 5557/5558 become 5559/5560 for engine 1; a port 0 becomes a free port
chosen here), and `kv_events_endpoints` / `kv_events_replay_endpoints` say where a subscriber
on the gateway's host reaches each engine's sockets.
"""
from __future__ import annotations

import asyncio
import json
import sys

from prefixgate.backend.config import engine_configs, parse_kv_events_config, subscriber_endpoint
from prefixgate.common.processes import ServerProcess
from prefixgate.common.runtime import distinct_free_ports, listening_socket
from prefixgate.proxy import pd
from prefixgate.proxy.upstream.upstreams import check_upstreams


class BundledEngines:
    """Child `prefixgate backend` processes, each becoming one upstream of the gateway."""

    def __init__(self, cfg: dict, tracing: dict | None = None):
        self.cfg = cfg                      # the validated `bundled:` mapping
        self.roles = cfg.get("roles") or ["both"] * cfg["instances"]     # --role per engine
        self.tracing = tracing              # the gateway's `tracing:`: the engines trace too
        self.procs: list[ServerProcess] = []
        # ports are chosen up front so the gateway (and its plugins) can be built first, and
        # held (listening) until each engine serves on its own: --listen-fd
        self.listeners = [listening_socket(cfg["host"]) for _ in self.roles]
        self.ports = [sock.getsockname()[1] for sock in self.listeners]
        self.urls = [f"http://{cfg['host']}:{port}" for port in self.ports]
        self.kv_events = self._kv_events_configs()          # per engine; None: no KV events
        # where a subscriber on the gateway's host reaches each engine's sockets (None: not
        # published)
        self.kv_events_endpoints = [self._reachable(c, "endpoint") for c in self.kv_events]
        self.kv_events_replay_endpoints = [self._reachable(c, "replay_endpoint")
                                           for c in self.kv_events]

    def _kv_events_configs(self) -> list:
        # checked with the rest of the config already
        config = parse_kv_events_config(self.cfg.get("kv_events_config"))
        if config is None:
            return [None] * len(self.roles)
        return engine_configs(config, len(self.roles),
                              free_port=distinct_free_ports(self.cfg["host"]))

    def _reachable(self, config, key: str) -> str | None:
        endpoint = getattr(config, key) if config is not None and config.publishes else None
        return subscriber_endpoint(endpoint, self.cfg["host"]) if endpoint else None

    def upstream_configs(self, timeouts: dict) -> list[dict]:
        """The engines as `upstreams:` entries, with every default filled in."""
        return check_upstreams(self.upstream_entries(), timeouts)

    def upstream_entries(self) -> list[dict]:
        """The engines as `upstreams:` entries as a user would write them (and, when they
        publish KV events with a replay socket, where to subscribe): plain data, which the
        worker processes of `serve --workers N` are handed."""
        raw = [{"name": f"{role}{i}" if role != "both" else f"engine{i}", "url": url,
                "role": role} for i, (url, role) in enumerate(zip(self.urls, self.roles))]
        for entry, config, pub, replay in zip(raw, self.kv_events, self.kv_events_endpoints,
                                              self.kv_events_replay_endpoints):
            if pub and replay and pub.startswith("tcp://"):
                # where prefix_route's `index: kv_events` subscribes
                entry["kv_events"] = {"endpoint": pub, "replay_endpoint": replay,
                                      "topic": config.topic}
        return raw

    async def start(self) -> None:
        """Launch the engines and wait until each one's /health says 200, which is after its
        warm-up (wait_ready takes the 503 meanwhile, like a refused connection, as "not yet")."""
        for i, (sock, url, role) in enumerate(zip(self.listeners, self.urls, self.roles)):
            cmd = [sys.executable, "-m", "prefixgate.backend", "--model", self.cfg["model"],
                   "--host", self.cfg["host"], "--listen-fd", str(sock.fileno()),
                   "--role", role, *self.engine_args(i)]
            self.procs.append(ServerProcess(cmd, url, what=f"bundled engine at {url}",
                                            inherit_output=True, listener=sock).start())
        await asyncio.gather(*(proc.ready(self.cfg["startup_timeout_s"], interval=0.25)
                               for proc in self.procs))

    def engine_args(self, index: int = 0) -> list[str]:
        """Engine `index`'s flags: `bundled.args`, `bundled.speculative_config`, `load_format`,
        `kv_offloading_*` and its own `kv_events_config` as their flags, and the gateway's
        collector for the engines' own spans (their `llm_request` spans join the gateway's
        traces), each unless the args name it."""
        args = [str(a) for a in self.cfg["args"]]
        # the benchmarks' fleets of mixed speeds: flags of engine `index` alone (not in YAML)
        instance_args = self.cfg.get("instance_args") or []
        if index < len(instance_args):
            args += [str(a) for a in instance_args[index]]
        load_format = self.cfg.get("load_format", "mmap")
        if load_format != "mmap" and "--load-format" not in args:     # mmap: the engine's default
            args += ["--load-format", load_format]
        if self.cfg.get("speculative_config") and "--speculative-config" not in args:
            args += ["--speculative-config", json.dumps(self.cfg["speculative_config"])]
        for key, flag in (("kv_offloading_size", "--kv-offloading-size"),
                          ("kv_offloading_path", "--kv-offloading-path")):
            if self.cfg.get(key) and flag not in args:
                args += [flag, str(self.cfg[key])]
        if self.kv_events[index] is not None and "--kv-events-config" not in args:
            args += ["--kv-events-config", self.kv_events[index].to_json()]
        if self.tracing is not None and "--otlp-traces-endpoint" not in args:
            args += ["--otlp-traces-endpoint", self.tracing["otlp_endpoint"],
                     "--otlp-service-name", f"{self.tracing['service_name']}-engine"]
        return args

    async def stop(self) -> None:
        for sock in self.listeners[len(self.procs):]:        # engines never started
            sock.close()
        await asyncio.gather(*(proc.close(timeout=10) for proc in self.procs))


def with_engines(cfg: dict, entries: list[dict]) -> dict:
    """`cfg` with the bundled engines (`BundledEngines.upstream_entries()`) among its upstreams."""
    upstreams = cfg["upstreams"] + check_upstreams(entries, cfg["timeouts"])
    if cfg["pd"] is not None:
        pd.check_roles(upstreams)
    return {**cfg, "upstreams": upstreams}
