"""What a benchmark archive records besides the samples: the machine, the software, the
target's own view of itself (/v1/models, /metrics), plus the progress bar and the CDF plot."""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import aiohttp

SCHEMA = "prefixgate-bench/1"
PACKAGES = ("prefixgate", "aiohttp", "torch", "triton", "vllm", "sglang", "transformers")


def environment() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "gpus": gpus(),
            "versions": versions, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


async def snapshot(session: aiohttp.ClientSession, base: str, path: str, headers: dict):
    """GET base+path: parsed JSON, text, or None when it is not there."""
    try:
        async with session.get(base + path, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            raw = await r.read()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    text = raw.decode("utf-8", "replace")
    if path.endswith("/models"):
        try:
            return json.loads(text)
        except ValueError:
            return None
    return text


def write(path: str, archive: dict) -> None:
    with open(path, "w") as f:
        json.dump(archive, f, indent=1)
        f.write("\n")


def save_outputs(archive: dict, out: str | None, plot: str | None) -> None:
    """Write `--out` (the JSON archive) and `--plot` (TTFT CDFs) when they were asked for."""
    if out:
        write(out, archive)
        print(f"archive written to {out}")
    if plot:
        plot_cdfs(archive, plot)
        print(f"plot written to {plot}")


def load(path: str) -> dict:
    with open(path) as f:
        archive = json.load(f)
    if archive.get("schema") != SCHEMA or not isinstance(archive.get("cells"), list):
        raise ValueError(f"{path} is not a prefixgate bench archive (schema {SCHEMA})")
    return archive


class Progress:
    """A one-line progress bar on stderr (a line per quarter when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label, self.done, self.errors = max(total, 1), label, 0, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._shown = 0

    def step(self, ok: bool = True) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        frac = self.done / self.total
        if self.tty:
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total}"
                              + (f" errors={self.errors}" if self.errors else ""))
            if self.done >= self.total:
                self.stream.write("\n")
        elif int(frac * 4) > self._shown:
            self._shown = int(frac * 4)
            self.stream.write(f"{self.label} {self.done}/{self.total}"
                              + (f" errors={self.errors}" if self.errors else "") + "\n")
        self.stream.flush()


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


MISSING_MATPLOTLIB = ("--plot needs matplotlib, which is not installed: "
                      "pip install 'prefixgate[plot]' (or pip install matplotlib)")


def plot_cdfs(archive: dict, path: str) -> None:
    """TTFT CDF per cell, log-scaled milliseconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for cell in archive["cells"]:
        xs = sorted(1000.0 * s["ttft"] for s in cell["samples"]
                    if not s["warmup"] and s["ttft"] is not None and s["error"] is None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=cell["label"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    cfg = archive["config"]
    target = cfg.get("url") or f"scenario {cfg.get('scenario', '?')}, {cfg.get('model', '')}"
    ax.set_title(f"TTFT CDF — {target}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
