"""The two engines of the vLLM comparison (bench/vs_vllm.py) as servers on loopback, each a
process tree on the same cores (one, or a set) from its first instruction, and what such a tree
holds and uses.

Ours: `prefixgate backend` under `taskset -c CORES`, torch on one thread per core
(OMP_NUM_THREADS). vLLM: the CPU build's server (proxy/testing/real_vllm.py, `taskset=True`)
under `taskset -c CORES` too, so the API server, the engine core and all their threads are on
the cores from their start, and vLLM's OpenMP threads are bound one to each
(VLLM_CPU_OMP_THREADS_BIND). Once ready, every thread of each tree is checked to be on those
cores and no other (`check_pinned`); a core that cannot be used, or a thread found elsewhere,
raises PinningError: nothing is silently left unpinned.

While the engines are measured, `CpuMeter` reads each tree's CPU seconds before and after each
part: a tree on N cores cannot use more CPU seconds than N times the wall seconds, so more
(beyond the clock tick's rounding) is a pinning failure that `failures` names.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from prefixgate.backend.bench.engine_process import engine_process
from prefixgate.common.procfs import tree_pids
from prefixgate.proxy.testing.real_vllm import vllm_servers

SERVED_NAME = "smollm2"
READY_TIMEOUT_S = 900            # a loaded 2-core machine starts vLLM in minutes


@dataclass
class Settings:
    """What both engines are started with, alike."""

    model: str
    dtype: str                      # float32 | bfloat16
    cores: tuple[int, ...]          # the CPUs both run on (one thread per core each)
    max_num_batched_tokens: int     # the chunked-prefill step budget
    max_model_len: int
    kvcache_gib: int
    log_dir: Path | None = None
    vllm_compiled: bool = True      # vLLM's default (torch.compile); False: --enforce-eager

    @property
    def taskset(self) -> str:
        """The cores as taskset and VLLM_CPU_OMP_THREADS_BIND take them: `0` or `0,1`."""
        return ",".join(map(str, self.cores))


@dataclass
class Running:
    name: str
    url: str
    pid: int                        # the root of its process tree


@contextlib.contextmanager
def ours(s: Settings):
    """The bundled engine in a process of its own, pinned to `s.cores` from its start, torch
    on as many threads."""
    threads = str(len(s.cores))
    engine = engine_process(
        s.model, "--dtype", s.dtype, "--served-model-name", SERVED_NAME,
        "--kv-cache-memory", f"{s.kvcache_gib}GiB", "--max-model-len", str(s.max_model_len),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--log-level", "warning",
        cores=s.taskset, env={**os.environ, "OMP_NUM_THREADS": threads,
                              "MKL_NUM_THREADS": threads},
        log=s.log_dir / "ours.log" if s.log_dir else None)
    check_cores(s.cores)
    try:
        engine.start().wait_ready(READY_TIMEOUT_S)
        check_pinned(engine.pid, s.cores)
        yield Running("ours", engine.url, engine.pid)
    finally:
        engine.stop()


@contextlib.contextmanager
def vllm(s: Settings):
    """vLLM's CPU server on the same model file (exported to a Hugging Face directory), its
    whole process tree on `s.cores` from its start; compiled (vLLM's default) unless
    `s.vllm_compiled` is False."""
    args = ["--max-model-len", str(s.max_model_len),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    check_cores(s.cores)
    with vllm_servers(1, s.model, dtype=s.dtype, served_model_name=SERVED_NAME, args=args,
                      kv_events=False, kvcache_gib=s.kvcache_gib, log_dir=s.log_dir,
                      cores=[s.taskset], eager=not s.vllm_compiled, taskset=True,
                      timeout=READY_TIMEOUT_S) as (server,):
        check_pinned(server.pid, s.cores)
        yield Running("vllm", server.url, server.pid)


@contextlib.contextmanager
def profiled(pid: int, out: Path | None):
    """py-spy sampling the process tree under `pid` while the block runs (nothing when `out`
    is None): collapsed stacks, one line per stack with its sample count, written to `out`.
    Non-blocking, so the engine is not paused to be sampled."""
    if out is None:
        yield
        return
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--subprocesses",
                            "--nonblocking", "--rate", "50", "--format", "raw", "--output",
                            str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)          # py-spy writes its file as it stops
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.kill()


class PinningError(RuntimeError):
    """A process tree could not be pinned to its core, or is not on it alone: the message says
    which core, and which process or thread, and what it used."""


def cpu_list(text: str) -> tuple[int, ...]:
    """A CPU list as /sys and taskset write it (`0`, `0,1`, `0-1,4`), sorted, each CPU once."""
    cores: set[int] = set()
    for span in text.strip().split(","):
        first, _, last = span.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cores))


def online_cores() -> set[int]:
    """This machine's online CPUs."""
    return set(cpu_list(Path("/sys/devices/system/cpu/online").read_text()))


def check_cores(cores: tuple[int, ...]) -> None:
    """PinningError unless every one of `cores` is one of this machine's online CPUs."""
    online = online_cores()
    missing = [c for c in cores if c not in online]
    if missing:
        raise PinningError(f"cannot pin to core {', '.join(map(str, missing))}: this machine's "
                           f"online cores are {', '.join(map(str, sorted(online)))}")


def _threads(pid: int) -> list[int]:
    """The thread ids of `pid` ([] once it has ended)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "?"


def tree_threads(root: int) -> list[dict]:
    """Per process of the tree: its pid, name, thread count (/proc/PID/status `Threads`) and
    the cores its threads may run on (their union)."""
    out = []
    for pid in tree_pids(root):
        cores: set[int] = set()
        for tid in _threads(pid):
            with contextlib.suppress(ProcessLookupError):       # a thread that just ended
                cores |= os.sched_getaffinity(tid)
        out.append({"pid": pid, "name": _name(pid), "threads": _status_value(pid, "Threads"),
                    "cores": sorted(cores)})
    return out


def check_pinned(root: int, cores: tuple[int, ...]) -> None:
    """PinningError unless every thread of every process under `root` may run on `cores` and
    no other (a thread bound to one of them is on them)."""
    allowed, stray = set(cores), []
    for pid in tree_pids(root):
        for tid in _threads(pid):
            try:
                runs_on = os.sched_getaffinity(tid)
            except ProcessLookupError:                 # ended since listed: runs nowhere
                continue
            if not runs_on <= allowed:
                stray.append(f"{_name(pid)} (pid {pid}) thread {tid} on cores "
                             f"{','.join(map(str, sorted(runs_on)))}")
    if stray:
        raise PinningError(f"not pinned to core {','.join(map(str, cores))}: "
                           + "; ".join(stray[:8])
                           + (f" and {len(stray) - 8} more" if len(stray) > 8 else ""))


CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
SLACK = 1.05                    # CPU seconds per wall second per core a tree may show
SLACK_S = 0.05                  # and beyond that, plus two clock ticks per process


def tree_cpu_seconds(root: int) -> tuple[float, int]:
    """(CPU seconds the tree under `root` has used, its processes). Per process,
    /proc/PID/stat's utime + stime (all its threads, the ended ones too, which
    /proc/PID/task/*/stat no longer lists) + cutime + cstime (its children that ended and were
    waited for, so that a child's seconds stay counted once it is gone)."""
    ticks, pids = 0, tree_pids(root)
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        ticks += sum(int(x) for x in fields[11:15])     # utime stime cutime cstime
    return ticks * CLOCK_TICK_S, len(pids)


def over_cores(cpu_s: float, wall_s: float, cores: int, processes: int) -> bool:
    """Did a tree on `cores` cores use more CPU than they have, beyond the rounding of
    /proc's clock ticks?"""
    return cpu_s > wall_s * cores * SLACK + SLACK_S + 2 * processes * CLOCK_TICK_S


class CpuMeter:
    """Each measured part's CPU seconds (the tree under `root`) and wall seconds."""

    def __init__(self, root: int, cores: int = 1):
        self.root, self.cores = root, cores
        self.parts: dict[str, dict] = {}

    @contextlib.contextmanager
    def part(self, name: str):
        cpu0, procs0 = tree_cpu_seconds(self.root)
        t0 = time.monotonic()
        try:
            yield
        finally:
            wall = time.monotonic() - t0
            cpu1, procs1 = tree_cpu_seconds(self.root)
            self.parts[name] = {"cpu_s": cpu1 - cpu0, "wall_s": wall,
                                "processes": max(procs0, procs1)}

    def failures(self, engine: str) -> list[str]:
        """One line per part that used more CPU than its cores allow (empty: none)."""
        return [f"pinning failure: {engine} used {p['cpu_s']:.2f} CPU-s in {p['wall_s']:.2f} "
                f"wall-s ({name}, {self.cores} core{'s' * (self.cores > 1)})"
                for name, p in self.parts.items()
                if over_cores(p["cpu_s"], p["wall_s"], self.cores, p["processes"])]


def _status_value(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _pss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def tree_memory(root: int) -> dict:
    """MiB held by the process tree: RSS summed (pages shared between its processes counted
    in each), PSS summed (shared pages split: the tree's real share), and the processes'
    peak RSS (VmHWM) summed."""
    pids = tree_pids(root)
    mib = 1024
    return {"processes": len(pids),
            "rss_mib": sum(_status_value(p, "VmRSS") for p in pids) / mib,
            "pss_mib": sum(_pss_kib(p) for p in pids) / mib,
            "peak_rss_mib": sum(_status_value(p, "VmHWM") for p in pids) / mib}
