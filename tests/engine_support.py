"""Engine test support: serve a model with the real server on a loopback port, from a
background thread with its own event loop (as a separate process would), so one server can be
shared by a module's tests while each test runs on its own loop with a real HTTP client.
Also: transformers' own greedy generation as the reference, and a /metrics reader."""
from __future__ import annotations

import asyncio
import gc
import json
import re
import threading

import aiohttp
import torch

from prefixgate.backend.cli import parse_args
from prefixgate.backend.server import start_server


class ServerThread:
    def __init__(self, argv: list[str]):
        self.argv = argv
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        # the engine (weights, a 1 GiB KV cache) sits in reference cycles with its event
        # loop: free it now, not at the next full collection, or a test run's memory grows
        # by an engine per module
        self.server = self._loop = None
        gc.collect()

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            server = await start_server(parse_args(self.argv), host="127.0.0.1", port=0)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self.server = server
        self.url = server.url
        self._ready.set()
        await self._stop.wait()
        await server.close()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation, EOS ignored (the engine requests set ignore_eos)."""
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                            do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The engine's /metrics as {name: value} (unlabelled series only)."""
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*) ([-+\d.eE]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def complete_ids(session, url, prompt: list[int], max_tokens: int, stream=False, **extra) -> dict:
    """POST /v1/completions with token ids, greedy; returns {"token_ids", "usage", "finish_reason"}."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **extra}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            data = await r.json()
            return {"token_ids": data["choices"][0]["token_ids"], "usage": data["usage"],
                    "finish_reason": data["choices"][0]["finish_reason"]}
        ids, usage, reason = [], None, None
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                ids += c.get("token_ids", [])
                reason = c["finish_reason"] or reason
            usage = chunk.get("usage") or usage
        return {"token_ids": ids, "usage": usage, "finish_reason": reason}
