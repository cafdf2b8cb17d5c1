"""One streamed request as `prefixgate doctor` sees it: every read off the socket, with its
time, raw size and the SSE events it completed, plus the response headers. Unlike the bench
client it asks for compression like a browser or the OpenAI SDK does and never decompresses
on the fly, so a compressing proxy shows up as what it is."""
from __future__ import annotations

import asyncio
import json
import time
import zlib
from dataclasses import dataclass, field

import aiohttp

from prefixgate.common.sse import DONE, EventSplitter, data_of
from prefixgate.proxy.bench.client import error_message, has_content, header_timing

ACCEPT_ENCODING = "gzip, deflate, br"     # what httpx (the OpenAI SDK) and browsers send


@dataclass
class StreamReads:
    """What one streamed response was made of, read by read (module doc)."""

    status: int | None = None
    headers: dict = field(default_factory=dict)
    error: str | None = None
    ttft: float | None = None             # seconds to the first content event
    end: float | None = None              # seconds to the end of the stream
    reads: list = field(default_factory=list)   # (seconds, raw bytes, content events completed)
    server_timing: dict[str, float] | None = None  # the Server-Timing header, {name: ms}

    @property
    def content_times(self) -> list[float]:
        return [t for t, _, n in self.reads for _ in range(n)]

    @property
    def content_reads(self) -> int:
        return sum(1 for _, _, n in self.reads if n)

    @property
    def encoding(self) -> str:
        return self.headers.get("content-encoding", "").strip().lower()


class _Decoder:
    """Undo gzip/deflate incrementally so events can still be counted; None for others."""

    def __init__(self, encoding: str):
        self.z = None
        if encoding in ("gzip", "x-gzip"):
            self.z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self.z = zlib.decompressobj()
        self.ok = encoding in ("", "identity") or self.z is not None

    def feed(self, data: bytes) -> bytes:
        return self.z.decompress(data) if self.z is not None else data


async def trace_stream(session: aiohttp.ClientSession, url: str, body: dict,
                       headers: dict) -> StreamReads:
    tr = StreamReads()
    t0 = time.monotonic()
    try:
        async with session.post(url, json={**body, "stream": True}, headers={
                **headers, "Accept-Encoding": ACCEPT_ENCODING}) as resp:
            tr.status = resp.status
            tr.headers = {k.lower(): v for k, v in resp.headers.items()}
            tr.server_timing = header_timing(resp.headers)
            if resp.status != 200:
                tr.error = f"HTTP {resp.status}: {error_message(await resp.read())}"
                return tr
            decoder, splitter = _Decoder(tr.encoding), EventSplitter()
            async for chunk in resp.content.iter_any():
                now = time.monotonic() - t0
                n = 0
                if decoder.ok:
                    n = sum(_is_content(data_of(raw), tr)
                            for raw in splitter.feed(decoder.feed(chunk)))
                if n and tr.ttft is None:
                    tr.ttft = now
                tr.reads.append((now, len(chunk), n))
            tr.end = time.monotonic() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, zlib.error) as e:
        tr.error = f"{type(e).__name__}: {e}"
    return tr


def _is_content(data: bytes | None, tr: StreamReads) -> int:
    """1 for an event (its data, common/sse.py; None: none) that carries content, else 0."""
    if data is None or data.strip() == DONE:
        return 0
    try:
        obj = json.loads(data)
    except ValueError:
        return 0
    if isinstance(obj, dict) and "error" in obj:
        tr.error = f"error event: {error_message(data)}"
        return 0
    return int(isinstance(obj, dict) and has_content(obj))
