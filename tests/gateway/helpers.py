"""Gateway test helpers: `prefixgate serve --config FILE` in a child process whose output a
test can wait on and signal, and that process's memory and open files."""
from __future__ import annotations

import asyncio
import os
import re
import sys
import time


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Serve:
    """`prefixgate serve --config FILE ARGS` (or `serve ARGS` without a file) in a child
    process, its URL (and the whole line that says it) read from stdout."""

    def __init__(self, path=None, *args, timeout: float = 20):
        self.argv = [*(["--config", str(path)] if path is not None else []), *args]
        self.timeout = timeout
        self.proc = None
        self.url = self.line = ""
        self.output: list[str] = []

    async def start(self):
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prefixgate.proxy.cli", "serve", *self.argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        while not self.url:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), self.timeout)).decode()
            assert line, "serve exited: " + "".join(self.output)
            self.output.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            self.url, self.line = (m.group(1), line) if m else ("", "")
        asyncio.get_running_loop().create_task(self._drain())
        return self

    async def _drain(self):
        async for line in self.proc.stdout:
            self.output.append(line.decode())

    async def wait_output(self, text, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.output):
                return True
            await asyncio.sleep(0.05)
        return False

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    async def stop(self):
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
