"""Reading the head of a multipart upload: real aiohttp request streams on loopback."""
from __future__ import annotations

import asyncio
import hashlib
import os

import aiohttp
import pytest
from aiohttp import web

from prefixgate.common.runtime import start_app
from prefixgate.proxy.upstream.h1pool import Pool
from prefixgate.proxy.upstream.multipart import boundary_of, iter_body, read_head

B = b"XyZ-boundary"
CT = "multipart/form-data; boundary=XyZ-boundary"


async def form_bytes(*parts, quote_fields: bool = True) -> tuple[bytes, str]:
    """(body, Content-Type) of an aiohttp.FormData with `parts` as (name, value, kwargs)."""
    form = aiohttp.FormData(quote_fields=quote_fields, default_to_multipart=True)
    for name, value, kw in parts:
        form.add_field(name, value, **kw)
    payload = form()
    return await payload.as_bytes(), payload.content_type


def audio(n: int = 3000, **kw) -> tuple[str, bytes, dict]:
    return ("file", os.urandom(n), {"filename": "speech.mp3", "content_type": "audio/mpeg",
                                    **kw})


@pytest.fixture
async def peek():
    """`await peek(body, content_type, limit=..., pieces=...)` → (status, answer): a server
    whose handler runs read_head on request.content, then reads the rest."""
    async def handler(request):
        boundary = boundary_of(request.headers.get("Content-Type", ""))
        if boundary is None:
            return web.json_response({"error": "no boundary"}, status=400)
        try:
            head, fields = await read_head(request.content, boundary,
                                           limit=int(request.query.get("limit", 65536)))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        rest = await request.content.read()
        return web.json_response({"fields": fields, "head": len(head),
                                  "sha": hashlib.sha256(head + rest).hexdigest()})
    app = web.Application()
    app.router.add_post("/peek", handler)
    runner, url = await start_app(app, "127.0.0.1", 0)
    session = aiohttp.ClientSession()

    async def call(body: bytes, content_type: str = CT, limit: int = 65536,
                   pieces: int | None = None):
        data = body
        if pieces:                   # dribble the body in small writes (chunked encoding)
            async def dribble():
                for i in range(0, len(body), pieces):
                    yield body[i:i + pieces]
                    await asyncio.sleep(0)
            data = dribble()
        async with session.post(f"{url}/peek?limit={limit}", data=data,
                                headers={"Content-Type": content_type}) as resp:
            answer = await resp.json()
            if resp.status == 200:
                assert answer["sha"] == hashlib.sha256(body).hexdigest()  # nothing lost
                assert answer["head"] <= limit
            return resp.status, answer
    yield call
    await session.close()
    await runner.cleanup()


async def test_fields_before_the_file_are_found(peek):
    body, ct = await form_bytes(("model", "whisper-1", {}), ("language", "en", {}),
                                audio(200_000))
    for pieces in (None, 1000):
        status, answer = await peek(body, ct, pieces=pieces)
        assert status == 200 and answer["fields"] == {"model": "whisper-1", "language": "en"}
        assert answer["head"] < len(body)          # the file was not read


async def test_fields_after_the_file_are_not(peek):
    body, ct = await form_bytes(("language", "en", {}), audio(), ("model", "whisper-1", {}))
    status, answer = await peek(body, ct)
    assert status == 200 and answer["fields"] == {"language": "en"}


@pytest.mark.parametrize("quote_fields", [True, False])
async def test_quoted_names_and_a_filename_with_spaces_and_quotes(peek, quote_fields):
    body, ct = await form_bytes(("model", "whisper-1", {}), ('we"ird; na\\me', "v", {}),
                                audio(filename='my "best"; take.mp3'),
                                ("after", "x", {}), quote_fields=quote_fields)
    status, answer = await peek(body, ct)
    assert status == 200
    assert answer["fields"] == {"model": "whisper-1", 'we"ird; na\\me': "v"}


async def test_no_file_part_reads_the_whole_small_form(peek):
    body, ct = await form_bytes(("model", "whisper-1", {}),
                                ("prompt", "line one\r\nline two\r\n--not-a-boundary", {}))
    status, answer = await peek(body, ct)
    assert status == 200 and answer["head"] == len(body)
    assert answer["fields"] == {"model": "whisper-1",
                                "prompt": "line one\r\nline two\r\n--not-a-boundary"}


async def test_the_limit_stops_reading(peek):
    body, ct = await form_bytes(("model", "whisper-1", {}), ("prompt", "p" * 100_000, {}),
                                ("language", "en", {}), audio())
    status, answer = await peek(body, ct, limit=4096, pieces=1500)
    assert status == 200 and answer["head"] == 4096
    assert answer["fields"] == {"model": "whisper-1"}


async def test_empty_form(peek):
    status, answer = await peek(b"--XyZ-boundary--\r\n")
    assert status == 200 and answer["fields"] == {}


async def test_hand_written_forms(peek):
    """A preamble, padding after a boundary, unquoted and RFC 5987 names, filename*."""
    body = (b"a preamble, ignored\r\n--XyZ-boundary  \r\n"
            b"content-disposition: form-data; name=model\r\n\r\nwhisper-1\r\n"
            b"--XyZ-boundary\r\nContent-Disposition: form-data; name*=utf-8''mod%C3%A8le;\r\n"
            b"\r\nv\r\n--XyZ-boundary\r\n"
            b"Content-Disposition: form-data; name=\"file\"; filename*=utf-8''a%20b.wav\r\n\r\n"
            b"RIFF....\r\n--XyZ-boundary--\r\n")
    status, answer = await peek(body, pieces=3)
    assert status == 200 and answer["fields"] == {"model": "whisper-1", "modèle": "v"}


@pytest.mark.parametrize("body,why", [
    (b"", "ends before its first boundary"),
    (b"just some bytes, no boundary in sight", "ends before its first boundary"),
    (b"--XyZ-boundary\r\nContent-Type: text/plain\r\n\r\nx\r\n--XyZ-boundary--\r\n",
     "no Content-Disposition"),
    (b"--XyZ-boundary\r\n\r\nx\r\n--XyZ-boundary--\r\n", "no headers"),
    (b"--XyZ-boundary\r\nContent-Disposition: attachment; name=\"a\"\r\n\r\nx\r\n"
     b"--XyZ-boundary--\r\n", "bad Content-Disposition"),
    (b"--XyZ-boundary\r\nContent-Disposition: form-data; name=\"a\r\n\r\nx\r\n"
     b"--XyZ-boundary--\r\n", "bad Content-Disposition"),
    (b"--XyZ-boundary\r\nContent-Disposition: form-data; filename=\"a\"\r\n\r\nx\r\n",
     "no name"),
    (b"--XyZ-boundary\r\nno colon here\r\n\r\nx\r\n--XyZ-boundary--\r\n", "bad part header"),
    (b"--XyZ-boundaryjunk\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx\r\n",
     "text after a boundary"),
    (b"--XyZ-boundary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisp",
     "ends in field 'model'"),
    (b"--XyZ-boundary\r\nContent-Disposition: form-data; na", "ends in a part's headers"),
])
async def test_malformed_bodies_raise_value_error(peek, body, why):
    status, answer = await peek(body)
    assert status == 400 and "malformed multipart body" in answer["error"]
    assert why in answer["error"], answer


@pytest.mark.parametrize("content_type,boundary", [
    ("multipart/form-data; boundary=XyZ-boundary", b"XyZ-boundary"),
    ('Multipart/Form-Data; charset=utf-8; boundary="quoted boundary"', b"quoted boundary"),
    ("multipart/form-data;boundary=----WebKitFormBoundary7MA4YWxkTrZu0gW;",
     b"----WebKitFormBoundary7MA4YWxkTrZu0gW"),
    ("multipart/form-data", None),
    ("multipart/form-data; boundary=", None),
    ("multipart/form-data; boundary=" + "x" * 71, None),
    ("multipart/mixed; boundary=abc", None),
    ("application/json", None),
    ('multipart/form-data; boundary="unterminated', None),
])
def test_boundary_of(content_type, boundary):
    assert boundary_of(content_type) == boundary


async def test_every_split_of_the_body_gives_the_same_answer():
    """A StreamReader fed one byte at a time, and at every split point: the search for
    boundaries must not depend on where reads end."""
    from aiohttp.base_protocol import BaseProtocol
    body, ct = await form_bytes(("model", "whisper-1", {}), ('a "q"', "v\r\n", {}), audio(50))
    boundary = boundary_of(ct)
    loop = asyncio.get_running_loop()
    splits = [[body[i:i + 1] for i in range(len(body))]]
    splits += [[body[:i], body[i:]] for i in range(1, len(body), 7)]
    for pieces in splits:
        protocol = BaseProtocol(loop)
        protocol.transport = asyncio.Transport()     # "connected"; never written to here
        stream = aiohttp.StreamReader(protocol, 1 << 16, loop=loop)

        async def feed(pieces=pieces, stream=stream):
            for piece in pieces:
                stream.feed_data(piece)
                await asyncio.sleep(0)
            stream.feed_eof()
        feeding = asyncio.ensure_future(feed())
        head, fields = await read_head(stream, boundary)
        assert fields == {"model": "whisper-1", 'a "q"': "v\r\n"}
        assert body.startswith(head) and b"filename=" in head
        await feeding


@pytest.mark.parametrize("client_chunked", [False, True], ids=["content-length", "chunked"])
async def test_proxied_upload_arrives_intact(client_chunked):
    """The whole path: a gateway-like handler peeks at the model, then streams head + rest
    through the pool to an upstream that parses the form itself."""
    async def upstream(request):
        form = await request.post()
        upload = form["file"]
        return web.json_response({"model": form["model"], "filename": upload.filename,
                                  "sha": hashlib.sha256(upload.file.read()).hexdigest()})
    up_app = web.Application(client_max_size=64 << 20)
    up_app.router.add_post("/v1/audio/transcriptions", upstream)
    up_runner, up_url = await start_app(up_app, "127.0.0.1", 0)
    pool = Pool(up_url, limit=4, connect_timeout=2)

    async def gateway(request):
        content_type = request.headers["Content-Type"]
        head, fields = await read_head(request.content, boundary_of(content_type))
        assert fields == {"model": "whisper-1", "response_format": "json"}
        resp = await pool.request("POST", request.path, [("Content-Type", content_type)],
                                  iter_body(head, request.content),
                                  length=request.content_length)
        return web.Response(status=resp.status, body=await resp.read_all(),
                            content_type="application/json")
    gw_app = web.Application()
    gw_app.router.add_post("/v1/audio/transcriptions", gateway)
    gw_runner, gw_url = await start_app(gw_app, "127.0.0.1", 0)

    name, data, kw = audio(6 * 1024 * 1024 + 3, filename="take-1.mp3")
    body, ct = await form_bytes(("model", "whisper-1", {}), ("response_format", "json", {}),
                                (name, data, kw))

    async def pieces():                    # no length known: the client sends it chunked
        for i in range(0, len(body), 100_000):
            yield body[i:i + 100_000]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw_url}/v1/audio/transcriptions",
                                data=pieces() if client_chunked else body,
                                headers={"Content-Type": ct}) as resp:
            assert resp.status == 200, await resp.text()
            assert await resp.json() == {"model": "whisper-1", "filename": "take-1.mp3",
                                         "sha": hashlib.sha256(data).hexdigest()}
    pool.close()
    await gw_runner.cleanup()
    await up_runner.cleanup()
