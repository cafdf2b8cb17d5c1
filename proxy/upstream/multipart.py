"""Peek at the head of a multipart/form-data upload: the simple fields before the file.

An OpenAI audio upload (`POST /v1/audio/transcriptions`) is a form whose `model` field the
gateway routes on, and whose `file` part may be tens of MB. `read_head` reads only as far
as the first file part (or `limit` bytes), and returns what it read with the simple fields
it saw, so the caller can forward `head` and then the rest of the stream, byte for byte,
without holding the file. The format: RFC 7578 (form-data) over RFC 2046 (multipart).
"""
from __future__ import annotations

import re
from collections.abc import AsyncIterator
from urllib.parse import unquote

CRLF = b"\r\n"
# `; key=value` or `; key="quoted \" value"`, as in Content-Type and Content-Disposition
_PARAM = re.compile(r';\s*([^\s;=]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s;"]*))\s*')
_ESCAPED = re.compile(r"\\(.)")


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a `multipart/form-data` Content-Type; None if it is not one, or has
    no usable boundary (RFC 2046: 1 to 70 characters, none after a trailing space)."""
    parsed = _parse_header(content_type)
    if parsed is None or parsed[0] != "multipart/form-data":
        return None
    boundary = parsed[1].get("boundary", "")
    if not 1 <= len(boundary) <= 70 or boundary.endswith(" ") or not boundary.isascii():
        return None
    return boundary.encode("ascii")


async def read_head(stream, boundary: bytes, *, limit: int = 64 * 1024,
                    spans: dict[str, tuple[int, int]] | None = None
                    ) -> tuple[bytes, dict[str, str]]:
    """Read `stream` (an aiohttp StreamReader) up to the first file part's headers, the end
    of the form, or `limit` bytes, whichever comes first.

    Returns (every byte read, {name: value} of the simple fields complete before then; a
    name given twice keeps its last value). Raises ValueError when the body is not a
    well-formed multipart body (or ends before its closing boundary). `spans`, when given,
    gets each returned field's value as (start, end) offsets into the head (to rewrite one).
    """
    head = _Head(stream, limit)
    fields: dict[str, str] = {}
    dash_boundary = b"--" + boundary
    delimiter = CRLF + dash_boundary

    # the first boundary starts the body, or ends a (rare, ignored) preamble
    if not await head.fill(len(dash_boundary)):
        return head.stopped(fields, "before its first boundary")
    if head.buf.startswith(dash_boundary):
        pos = len(dash_boundary)
    else:
        found = await head.find(delimiter, 0)
        if found < 0:
            return head.stopped(fields, "before its first boundary")
        pos = found + len(delimiter)

    while True:
        # after a boundary: "--" closes the form; else optional padding, CRLF, the part
        if not await head.fill(pos + 2):
            return head.stopped(fields, "after a boundary")
        if head.buf[pos:pos + 2] == b"--":
            return bytes(head.buf), fields
        eol = await head.find(CRLF, pos)
        if eol < 0:
            return head.stopped(fields, "after a boundary")
        if head.buf[pos:eol].strip(b" \t"):
            raise ValueError("malformed multipart body: text after a boundary")
        pos = eol + 2

        # the part's headers, up to an empty line (RFC 7578: Content-Disposition at least)
        if not await head.fill(pos + 2):
            return head.stopped(fields, "in a part's headers")
        if head.buf[pos:pos + 2] == CRLF:
            raise ValueError("malformed multipart body: a part has no headers")
        end = await head.find(CRLF + CRLF, pos)
        if end < 0:
            return head.stopped(fields, "in a part's headers")
        name, is_file = _disposition(bytes(head.buf[pos:end]))
        if is_file:
            return bytes(head.buf), fields
        content = end + 4

        # a simple field: its value runs to the next delimiter
        found = await head.find(delimiter, content)
        if found < 0:
            return head.stopped(fields, f"in field {name!r}")
        fields[name] = head.buf[content:found].decode("utf-8", "replace")
        if spans is not None:
            spans[name] = (content, found)
        pos = found + len(delimiter)


async def iter_body(head: bytes, stream) -> AsyncIterator[bytes]:
    """`head`, then the rest of `stream` as it arrives: the whole body, as the client sent it."""
    if head:
        yield head
    async for chunk in stream.iter_any():
        yield chunk


class _Head:
    """The bytes read so far, and reads of more (never past `limit` in all)."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit = stream, limit
        self.buf = bytearray()
        self.eof = False

    async def more(self) -> bool:
        if self.eof or len(self.buf) >= self.limit:
            return False
        data = await self.stream.read(self.limit - len(self.buf))
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def fill(self, n: int) -> bool:
        """At least `n` bytes read? (reading more as needed)"""
        while len(self.buf) < n:
            if not await self.more():
                return False
        return True

    async def find(self, needle: bytes, start: int) -> int:
        """Index of `needle` at or after `start`, reading more as needed; -1 if not within
        the limit or the body. Each byte is searched once, however small the reads."""
        scan = start
        while (found := self.buf.find(needle, scan)) < 0:
            scan = max(start, len(self.buf) - len(needle) + 1)
            if not await self.more():
                return -1
        return found

    def stopped(self, fields: dict[str, str], where: str) -> tuple[bytes, dict[str, str]]:
        """Out of bytes: the limit is a normal stop; the body's end there is malformed."""
        if self.eof:
            raise ValueError(f"malformed multipart body: it ends {where}")
        return bytes(self.buf), fields


def _disposition(block: bytes) -> tuple[str, bool]:
    """(field name, whether it is a file) from a part's header block (RFC 7578 4.2)."""
    disposition = None
    for line in block.decode("utf-8", "replace").split("\r\n"):
        key, colon, value = line.partition(":")
        if not colon or not key.strip():
            raise ValueError(f"malformed multipart body: bad part header {line[:80]!r}")
        if key.strip().lower() == "content-disposition":
            disposition = value
    if disposition is None:
        raise ValueError("malformed multipart body: a part has no Content-Disposition")
    parsed = _parse_header(disposition)
    if parsed is None or parsed[0] != "form-data":
        raise ValueError(f"malformed multipart body: bad Content-Disposition "
                         f"{disposition.strip()[:80]!r}")
    params = parsed[1]
    name = params.get("name")
    if name is None and "name*" in params:          # RFC 5987 form, as aiohttp may send it
        charset, _, rest = params["name*"].partition("'")
        try:
            name = unquote(rest.partition("'")[2], encoding=charset or "utf-8",
                           errors="replace")
        except LookupError:
            raise ValueError(f"malformed multipart body: unknown charset {charset!r}") from None
    if name is None:
        raise ValueError("malformed multipart body: a part has no name")
    return name, "filename" in params or "filename*" in params


def _parse_header(value: str) -> tuple[str, dict[str, str]] | None:
    """`type; key=value; key="quoted"` → (type in lower case, {key in lower case: value});
    None if it does not parse."""
    main, semi, _ = value.partition(";")
    params: dict[str, str] = {}
    pos = len(main)
    while value[pos:].strip(" \t;"):           # (a stray trailing ";" is forgiven)
        m = _PARAM.match(value, pos)
        if m is None:
            return None
        key, quoted, plain = m.groups()
        params[key.lower()] = _ESCAPED.sub(r"\1", quoted) if quoted is not None else plain
        pos = m.end()
    return main.strip().lower(), params
