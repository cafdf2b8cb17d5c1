"""Small client-side helpers shared by tests."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time

import aiohttp

CHAT = {"model": "standin-model", "messages": [{"role": "user", "content": "hello"}]}


async def read_events(resp: aiohttp.ClientResponse) -> list[tuple[float, bytes]]:
    """(arrival time, event bytes) for each SSE event, split on blank lines as it arrives."""
    events, buf = [], b""
    async for chunk in resp.content.iter_any():
        now = time.monotonic()
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            events.append((now, event))
    return events


def event_json(event: bytes) -> dict | str:
    data = event.decode().removeprefix("data: ")
    return data if data == "[DONE]" else json.loads(data)


def assert_openai_error(payload: dict, status: int, resp_status: int) -> None:
    assert resp_status == status, payload
    assert set(payload) == {"error"}, payload
    assert {"message", "type", "code"} <= set(payload["error"]), payload
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


class Serving:
    """`prefixgate serve ARGS` in a child process; its URL (and the whole line, which names the
    bundled engines) read from the "listening on" line. On exit: SIGTERM, and exit status 0."""

    def __init__(self, *args, env: dict | None = None, timeout: float = 20):
        self.args, self.env, self.timeout = args, env, timeout
        self.output: list[str] = []

    async def __aenter__(self):
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prefixgate.proxy.cli", "serve", *self.args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=self.env)
        try:
            while True:
                line = (await asyncio.wait_for(self.proc.stdout.readline(), self.timeout)).decode()
                assert line, "serve exited: " + "".join(self.output)
                self.output.append(line)
                if m := re.search(r"gateway listening on (http://\S+)", line):
                    self.url, self.line = m.group(1), line
                    return self
        except BaseException:
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()
            raise

    async def __aexit__(self, *exc):
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rest = (await asyncio.wait_for(self.proc.communicate(), 30))[0].decode()
        except asyncio.TimeoutError:
            self.proc.kill()
            raise
        assert self.proc.returncode == 0, "".join(self.output) + rest
