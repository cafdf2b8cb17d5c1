"""Helpers for the gateway-in-front-of-real-vLLM tests: the gateway's config for the shared
pair, one request sent both through the gateway and straight to the server it chose, and the
parts of an answer that differ between two runs (ids, timestamps) blanked out."""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

from multidict import CIMultiDictProxy

from tests.vllm.conftest import SERVED_NAME

# each run's own: response and item ids, creation times
VOLATILE = re.compile(rb'"(id|item_id|request_id|created|created_at)":("[^"]*"|\d+)')
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"model": SERVED_NAME, "messages": QUESTION, "max_tokens": 8, "temperature": 0}
# an agent's turn for the Messages tests: a tool and the assistant's call of it
READ_FILE = {"name": "read_file", "description": "Read a file of the repository.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                              "required": ["path"]}}
READS_README = {"role": "assistant", "content": [
    {"type": "text", "text": "Let me read it."},
    {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "README.md"}}]}


def stable(raw: bytes) -> bytes:
    """`raw` with every id and timestamp blanked: two runs of one greedy request compare."""
    return VOLATILE.sub(rb'"\1":0', raw)


def upstreams(pair, **fields) -> list[dict]:
    """The gateway's `upstreams:` for the shared servers, named vllm0 and vllm1."""
    return [{"name": f"vllm{i}", "url": s.url, **fields} for i, s in enumerate(pair)]


def server_named(pair, name: str):
    return pair[int(name.removeprefix("vllm"))]


@dataclass
class Answer:
    status: int
    headers: CIMultiDictProxy
    raw: bytes


async def send(client, url: str, path: str, body: dict | None = None, **kw) -> Answer:
    """POST `body` (GET without one) and read the whole answer, as bytes."""
    method = client.post if body is not None else client.get
    async with method(url + path, json=body, **kw) as r:
        return Answer(r.status, r.headers, await r.read())


async def through_and_direct(client, gw, pair, path: str, body: dict,
                             **kw) -> tuple[Answer, Answer]:
    """The answer through the gateway, then the same request's straight from the vLLM server
    the gateway chose."""
    proxied = await send(client, gw.url, path, body, **kw)
    server = server_named(pair, proxied.headers["x-prefixgate-upstream"])
    return proxied, await send(client, server.url, path, body, **kw)


async def wait_for(cond, timeout: float = 20.0, what: str = "condition"):
    """Poll `cond()` until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f}s"
        await asyncio.sleep(0.05)
    return value
