"""A streamed `/v1/completions` read as the engine benchmarks need it: each JSON chunk with the
seconds since the request was sent."""
from __future__ import annotations

import json
import time


async def completion_chunks(session, url: str, body: dict):
    """POST `body` (with `"stream": true`) to `url`/v1/completions; yield (seconds since sending,
    chunk) for every `data: {...}` event. Raises RuntimeError on a status other than 200."""
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                yield time.perf_counter() - t0, json.loads(line[6:])
