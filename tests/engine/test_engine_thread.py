"""One thread builds, warms up and steps the engine (backend/async_engine.py): on a CPU, libgomp
gives every thread that starts parallel loops a team of its own, and once there are more team
threads than cores every loop waits for a wake-up. The server builds its engine on the thread
that steps it; an engine stepped on another thread says so, once, in the log."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import torch

from prefixgate.backend.cli import parse_args
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.server import start_server

WARNING = "the engine steps on a thread other than the one that built it"


async def test_the_server_builds_its_engine_on_the_thread_that_steps_it(caplog):
    server = await start_server(parse_args(["--model", "demo"]), host="127.0.0.1", port=0)
    try:
        stepping = await server.engine.call(threading.get_ident)
        assert stepping == server.engine.engine.built_on != threading.get_ident()
        with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
            async with aiohttp.ClientSession() as s:
                body = {"model": "demo", "prompt": [5, 6, 7], "max_tokens": 4}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["usage"]["completion_tokens"] == 4
        assert WARNING not in caplog.text
    finally:
        await server.close()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_an_engine_stepped_on_another_thread_says_so_once(caplog, two_threads):
    engine = LLMEngine(EngineArgs(model="demo", device="cpu"))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0))
    with caplog.at_level(logging.WARNING, logger="prefixgate.engine"):
        engine.step()                                   # the building thread: nothing said
        assert WARNING not in caplog.text
        with ThreadPoolExecutor(1) as other:
            for _ in range(3):
                other.submit(engine.step).result()
    assert caplog.text.count(WARNING) == 1
    engine.close()
