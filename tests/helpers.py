"""Small client-side helpers shared by tests."""
from __future__ import annotations

import json
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
