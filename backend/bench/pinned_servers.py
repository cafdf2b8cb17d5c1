"""The two engines of the vLLM comparison (bench/vs_vllm.py) as servers on loopback, each a
process tree pinned to the same core, and what such a tree holds in memory.

Ours: `prefixgate backend` under `taskset`, torch on one thread (OMP_NUM_THREADS). vLLM: the
CPU build's server (proxy/testing/real_vllm.py) with its OpenMP thread bound to the core; its
API-server process and engine-core child would float over every core otherwise, so once it is
ready every thread of its tree is pinned too: both engines then do all their work (HTTP,
tokenizing, scheduling, the model) on that one core.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from prefixgate.backend.bench.engine_process import engine_process
from prefixgate.proxy.testing.real_vllm import vllm_servers

SERVED_NAME = "smollm2"
READY_TIMEOUT_S = 900            # a loaded 2-core machine starts vLLM in minutes


@dataclass
class Settings:
    """What both engines are started with, alike."""

    model: str
    dtype: str                      # float32 | bfloat16
    core: int                       # the one CPU both run on
    max_num_batched_tokens: int     # the chunked-prefill step budget
    max_model_len: int
    kvcache_gib: int
    log_dir: Path | None = None


@dataclass
class Running:
    name: str
    url: str
    pid: int                        # the root of its process tree


@contextlib.contextmanager
def ours(s: Settings):
    """The bundled engine in a process of its own, pinned to `s.core` from its start."""
    engine = engine_process(
        s.model, "--dtype", s.dtype, "--served-model-name", SERVED_NAME,
        "--kv-cache-memory", f"{s.kvcache_gib}GiB", "--max-model-len", str(s.max_model_len),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--log-level", "warning",
        cores=str(s.core), env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        log=s.log_dir / "ours.log" if s.log_dir else None)
    try:
        engine.start().wait_ready(READY_TIMEOUT_S)
        yield Running("ours", engine.url, engine.pid)
    finally:
        engine.stop()


@contextlib.contextmanager
def vllm(s: Settings):
    """vLLM's CPU server on the same model file (exported to a Hugging Face directory), its
    whole process tree pinned to `s.core`."""
    args = ["--max-model-len", str(s.max_model_len),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    with vllm_servers(1, s.model, dtype=s.dtype, served_model_name=SERVED_NAME, args=args,
                      kv_events=False, kvcache_gib=s.kvcache_gib, log_dir=s.log_dir,
                      cores=[str(s.core)], timeout=READY_TIMEOUT_S) as (server,):
        pin_tree(server.pid, s.core)
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


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant of it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # the command name, in parentheses, may hold spaces: the fields after it count
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pin_tree(root: int, core: int) -> None:
    """Every thread of every process under `root` to `core` (affinity is per thread)."""
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), {core})


def _status_kib(pid: int, key: str) -> int:
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
            "rss_mib": sum(_status_kib(p, "VmRSS") for p in pids) / mib,
            "pss_mib": sum(_pss_kib(p) for p in pids) / mib,
            "peak_rss_mib": sum(_status_kib(p, "VmHWM") for p in pids) / mib}
