"""One thread builds, warms up and steps the engine (backend/async_engine.py): on a CPU, libgomp
gives every thread that starts parallel loops a team of its own, and once there are more team
threads than cores every loop waits for a wake-up. The server builds its engine on the thread
that steps it; an engine stepped on another thread says so, once, in the log; the P/D KV send,
which reads blocks off the engine thread, starts no team."""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import pytest
import torch

from prefixgate.backend.cli import parse_args
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.kv_transfer import _gather
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


def test_the_kv_send_reads_blocks_off_the_engine_thread_without_a_team_of_its_own(two_threads):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(4096, 16, 4, 64, generator=g).bfloat16() for _ in range(2))
    idx = torch.randperm(4096, generator=g)[:2000]
    expected = torch.cat((k.view(torch.uint8)[idx], v.view(torch.uint8)[idx])).reshape(-1)
    with ThreadPoolExecutor(1) as other:
        other.submit(int).result()              # the thread is there before the count
        before = set(os.listdir("/proc/self/task"))
        got = other.submit(_gather, (k, v), idx).result()
        started = set(os.listdir("/proc/self/task")) - before
    assert np.array_equal(got, expected.numpy())
    assert not started          # no OpenMP workers for a second team (torch's indexing: one)
