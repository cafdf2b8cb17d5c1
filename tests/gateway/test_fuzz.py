"""Fuzz: thousands of malformed requests against `prefixgate serve` in its own process.

Every answer must be a 4xx (or a clean close, or a 2xx where the request was merely odd but
valid); the gateway itself never answers 5xx, stays up, keeps serving, and its memory stays
flat. The upstream is a well-behaved stand-in, so any 5xx would be the gateway's own.
"""
from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import aiohttp
import yaml

from tests.gateway.helpers import open_fds, rss_bytes
from tests.helpers import CHAT

SEED = 20261129
MAX_BODY = 256 * 1024


def bad_bodies(rng: random.Random):
    """(path, body bytes, content-type) triples: broken JSON, wrong types, huge, deep, bad UTF-8."""
    valid = json.dumps(CHAT).encode()
    wrong_types = [
        {"messages": None}, {"messages": "hi"}, {"messages": [1, 2]}, {"messages": []},
        {"messages": [{"content": "no role"}]}, {"messages": [{"role": 5}]},
        {**CHAT, "stream": "true"}, {**CHAT, "stream": 1}, {**CHAT, "max_tokens": "7"},
        {**CHAT, "max_tokens": 1.5}, {**CHAT, "max_tokens": True}, {**CHAT, "n": [1]},
        {**CHAT, "model": 42}, {**CHAT, "model": {"id": "m"}}, {**CHAT, "temperature": "hot"},
        {**CHAT, "top_p": None, "seed": "x"},
    ]
    while True:
        kind = rng.randrange(9)
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        if kind == 0:                                  # truncated valid JSON
            yield path, valid[:rng.randrange(len(valid))], "application/json"
        elif kind == 1:                                # random bytes
            yield path, rng.randbytes(rng.randrange(1, 300)), "application/json"
        elif kind == 2:                                # wrong types
            body = dict(rng.choice(wrong_types))
            if path.endswith("/completions") and "messages" in body and "chat" not in path:
                body = {"prompt": rng.choice([None, 5, {"a": 1}, True])}
            yield "/v1/chat/completions" if "messages" in body else path, \
                json.dumps(body).encode(), "application/json"
        elif kind == 3:                                # deep nesting, as arrays or objects
            depth = rng.choice([65, 200, 5000, 100000])
            doc = (b'{"messages": ' + b"[" * depth + b"]" * depth + b"}") if rng.random() < .5 \
                else (b'{"a":' * depth + b"1" + b"}" * depth)
            yield path, doc, "application/json"
        elif kind == 4:                                # invalid UTF-8 inside strings
            yield path, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3\x28"}]}', \
                "application/json"
        elif kind == 5:                                # over max_body_bytes
            yield path, b'{"prompt": "' + b"x" * (MAX_BODY + rng.randrange(1, 5000)) + b'"}', \
                "application/json"
        elif kind == 6:                                # not an object / empty / odd literals
            yield path, rng.choice([b"", b"null", b"[]", b'"s"', b"1e999999", b"NaN", b"{}",
                                    b'{"messages": NaN}', b"\x00" * 64]), "application/json"
        elif kind == 7:                                # lone surrogates, NUL escapes, dup keys
            yield "/v1/chat/completions", (
                b'{"messages": [{"role": "user", "content": "\\ud800\\u0000"}], '
                b'"messages": 3}'), "text/plain"
        else:                                          # odd but valid: may legitimately pass
            big = "y" * rng.randrange(10, MAX_BODY // 2)
            yield "/v1/chat/completions", json.dumps(
                {"messages": [{"role": "user", "content": big}], "unknown": {"x": [1, {}]},
                 "stream": rng.random() < .5}).encode(), "application/json"


RAW_REQUESTS = [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/9.9\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Content-Length: 3\r\n\r\n{}",                                  # conflicting lengths
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 5\r\n\r\n0\r\n\r\n",                           # smuggling attempt
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n{}\r\n0\r\n\r\n",                                        # bad chunk size
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    b"POST /v1/" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",   # huge request line
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" +
    b"".join(b"X-%d: v\r\n" % i for i in range(300)) + b"\r\n",     # too many headers
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Bin: \xff\xfe\x00\r\n"
    b"Content-Length: 2\r\n\r\n{}",                                  # bytes in a header
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nBad Header: v\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-prefixgate-priority: 1\r\n"
    b"x-prefixgate-priority: 9\r\nContent-Length: %d\r\n\r\n" % len(json.dumps(CHAT))
    + json.dumps(CHAT).encode(),                                     # duplicated priority
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-prefixgate-priority: 1e9\r\n"
    b"Content-Length: %d\r\n\r\n" % len(json.dumps(CHAT)) + json.dumps(CHAT).encode(),
    b"\r\n\r\n\r\n",
    b"POST\r\n\r\n",
    b"DELETE /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n",
]


async def raw_status(host, port, data: bytes) -> int | None:
    """The status the gateway answers to raw bytes, or None for a clean close."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 10)
    except ConnectionResetError:
        return None
    finally:
        writer.close()
    return int(head.split()[1]) if head.startswith(b"HTTP/1.") else None


async def slowloris(host, port, head: bool, seconds_per_byte=0.3) -> int | None:
    """A request head, or a body promised whole, trickled a byte at a time."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if head:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        else:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(20):
            writer.write(b"X" if head else b" ")
            try:
                await writer.drain()
            except ConnectionResetError:
                return None
            await asyncio.sleep(seconds_per_byte)
            if reader.at_eof() or len(reader._buffer):      # answered already
                break
        head = await asyncio.wait_for(reader.readline(), 10)
    except (ConnectionResetError, BrokenPipeError):
        return None
    finally:
        writer.close()
    return int(head.split()[1]) if head.startswith(b"HTTP/1.") else None


async def fuzz_round(client, url, gen, n, statuses: Counter, concurrency=16):
    queue = [next(gen) for _ in range(n)]

    async def worker():
        while queue:
            path, body, ctype = queue.pop()
            try:
                async with client.post(url + path, data=body,
                                       headers={"Content-Type": ctype}) as r:
                    await r.read()
                    statuses[r.status] += 1
            except aiohttp.ClientError:
                statuses["closed"] += 1
    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def test_fuzz_thousands_of_malformed_requests(tmp_path, standin, serve_process):
    standin.behaviour.record = False
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"port": 0}, "upstreams": [{"url": standin.url}],
        "plugins": ["admission", "metrics"],
        "limits": {"max_body_bytes": MAX_BODY, "body_timeout_s": 1.0, "idle_timeout_s": 1.5}}))
    gw = await serve_process(path)
    host, port = gw.url.removeprefix("http://").split(":")
    port = int(port)
    rng = random.Random(SEED)
    gen = bad_bodies(rng)
    statuses: Counter = Counter()
    connector = aiohttp.TCPConnector(limit=16)
    async with aiohttp.ClientSession(connector=connector) as client:
        await fuzz_round(client, gw.url, gen, 400, statuses)          # warm-up
        rss0, fds0 = rss_bytes(gw.proc.pid), open_fds(gw.proc.pid)
        await fuzz_round(client, gw.url, gen, 1600, statuses)
        raw = await asyncio.gather(*(raw_status(host, port, RAW_REQUESTS[i % len(RAW_REQUESTS)])
                                     for i in range(320)))
        slow = asyncio.gather(*(slowloris(host, port, head=i % 2 == 0) for i in range(32)))
        await asyncio.sleep(0.2)
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200           # served while two dozen slowloris bodies trickle
        slow = await slow
        async with client.get(gw.url + "/health") as r:
            assert r.status == 200
        rss1 = rss_bytes(gw.proc.pid)
    for s in raw + slow:
        statuses[s if s is not None else "closed"] += 1

    total = sum(statuses.values())
    print(f"\nfuzz: {total} requests, statuses {dict(statuses)}, "
          f"gateway RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, fds {fds0}")
    assert total >= 2000
    assert not [s for s in statuses if isinstance(s, int) and s >= 500], statuses
    assert all(s == "closed" or 200 <= s < 300 or 400 <= s < 500 for s in statuses)
    assert statuses[400] > 1000 and statuses[413] > 50 and statuses[408] == 16
    assert slow[0::2] == [None] * 16 and slow[1::2] == [408] * 16   # heads closed, bodies 408
    assert gw.proc.returncode is None
    assert not any("Traceback" in line for line in gw.output)     # no log flood either
    assert rss1 - rss0 < max(16 * 2**20, rss0 * 0.15), (rss0, rss1)
    await asyncio.sleep(0.5)
    assert open_fds(gw.proc.pid) <= fds0 + 4
