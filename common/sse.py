"""Server-sent events, read as the spec says (WHATWG HTML, "event stream interpretation"): the
one reader of every SSE stream prefixgate looks into — the gateway's usage and answer rewriters,
the benchmarks' clients, `doctor`.

A stream is lines ending in `\\r\\n`, `\\n` or `\\r`; a blank line ends an event. A line
`field: value` sets a field (one space after the colon is dropped, and it is optional), a line
starting with `:` is a comment, several `data` lines join with `\\n`.

    splitter = EventSplitter()
    for raw in splitter.feed(chunk):        # each whole event's bytes, its blank line included
        data = data_of(raw)                 # its data (bytes), or None: a comment, no data
    rest = splitter.flush()                 # an unterminated last event's bytes

Byte-exact: the events `feed` returns, joined with `flush()`, are the bytes fed in, so a
rewriter passes what it does not change on untouched.
"""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

# the end of an event: a line's end, then an empty line's
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LINE_END = re.compile(rb"\r\n|\r|\n")
DONE = b"[DONE]"          # OpenAI's last data event


@dataclass(slots=True)
class Event:
    event: str | None         # its `event:` field (None: the default, "message")
    data: bytes | None        # its data lines joined with b"\n" (None: no data line)


class EventSplitter:
    """Cuts a byte stream, split anywhere, into whole events (module doc)."""
    __slots__ = ("_buf",)

    def __init__(self):
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._buf + chunk if self._buf else chunk
        events, start = [], 0
        for m in _EVENT_END.finditer(data):
            if m.end() == len(data) and data.endswith(b"\r"):
                break             # a `\r` last: the `\n` of a `\r\n` may come in the next read
            events.append(data[start:m.end()])
            start = m.end()
        self._buf = data[start:]
        return events

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


def parse(raw: bytes) -> Event:
    """One event's fields (unknown fields, `id` and `retry` are not kept)."""
    name, data = None, None
    for line in _LINE_END.split(raw):
        if not line or line.startswith(b":"):
            continue
        field, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data = value if data is None else data + b"\n" + value
        elif field == b"event":
            name = value.decode("utf-8", "replace")
    return Event(name, data)


def data_of(raw: bytes) -> bytes | None:
    """An event's data (None: it has none)."""
    return parse(raw).data


def json_of(raw: bytes):
    """An event's data parsed as JSON (None: no data, `[DONE]`, or not JSON)."""
    data = data_of(raw)
    if data is None or data == DONE:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def events_in(chunks: Iterable[bytes]) -> list[bytes]:
    """The events in a stream's bytes, the unterminated last one included."""
    splitter = EventSplitter()
    events = [e for chunk in chunks for e in splitter.feed(chunk)]
    rest = splitter.flush()
    return events + [rest] if rest else events


async def read_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Each whole event of a response body read piece by piece (e.g. aiohttp's
    `resp.content.iter_any()`), as it completes; an unterminated last one at the end."""
    splitter = EventSplitter()
    async for chunk in chunks:
        for raw in splitter.feed(chunk):
            yield raw
    rest = splitter.flush()
    if rest:
        yield rest


class EventRewriter:
    """The stream side of an answer rewriter: whole events in, each through `event`, the
    bytes out; an event split across reads is held until it ends. Subclasses define `event`
    (raw event bytes -> the bytes to send instead)."""

    def __init__(self):
        self._splitter = EventSplitter()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self.event(raw) for raw in self._splitter.feed(chunk))

    def flush(self) -> bytes:
        rest = self._splitter.flush()
        return self.event(rest) if rest else b""

    def event(self, raw: bytes) -> bytes:
        raise NotImplementedError
