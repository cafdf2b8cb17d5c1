"""Tool test helpers: `prefixgate bench` and `prefixgate doctor` run as child processes (the
servers they measure live on the test's event loop), and a doctor report's findings by title."""
from __future__ import annotations

import asyncio
import json
import sys


async def run_cli(*argv: str) -> tuple[int, str, str]:
    """The real command line, as a child process (the servers live on this test's loop)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixgate.proxy.cli", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def doctor(*argv: str) -> tuple[int, dict | str, str]:
    """The real command, as a child process; (exit code, parsed --json output, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixgate.proxy.cli", "doctor", *argv, "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    try:
        parsed = json.loads(out)
    except ValueError:
        parsed = out.decode()
    return proc.returncode, parsed, err.decode()


def by_title(report: dict) -> dict[str, dict]:
    return {f["title"]: f for f in report["findings"]}
