"""`prefixgate serve` with no config: the bundled engine on the demo model behind the gateway."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys

import openai


async def test_serve_with_no_config_answers_chat_requests(tmp_path):
    env = {**os.environ, "PREFIXGATE_CACHE": str(tmp_path)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixgate.proxy.cli", "serve", "--port", "0",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url, output = None, []
    try:
        while url is None:
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            assert line, "serve exited early:\n" + "".join(output)
            output.append(line)
            if m := re.search(r"gateway listening on (http://\S+)", line):
                url = m.group(1)
        engine_port = int(re.search(r"engine0=http://127\.0\.0\.1:(\d+)", line).group(1))
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": "Current time: 2026-03-15 14:22:31. Be brief."},
                    {"role": "user", "content": "Hello!"}]
        reply = await client.chat.completions.with_raw_response.create(
            model="demo", messages=messages, max_tokens=8, temperature=0)
        assert reply.headers["x-prefixgate-upstream"] == "engine0"
        assert reply.headers["x-prefixgate-moved"] == "1"      # normalize is in the chain
        chat = reply.parse()
        assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content
        chunks = [c async for c in await client.chat.completions.create(
            model="demo", messages=messages, max_tokens=8, temperature=0, stream=True)]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == chat.choices[0].message.content
        assert [m.id for m in (await client.models.list()).data] == ["demo"]
        await client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
    assert proc.returncode == 0, "".join(output) + rest
    with socket.socket() as s:                    # the engine went down with the gateway
        assert s.connect_ex(("127.0.0.1", engine_port)) != 0
