"""Fixtures every area uses: real servers on loopback ports, started on the test's event loop
(stand-ins and gateways), tiny models, and freeing each module's engines when it is done."""
from __future__ import annotations

import gc
import os
import shutil
from dataclasses import dataclass

import aiohttp.web_app
import pytest
import torch

from prefixgate.common.runtime import start_app
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config import gateway as config_mod
from prefixgate.proxy.testing.standin import Behaviour, StandIn
from tests.helpers import RedisServer, make_tiny_model


@pytest.fixture(autouse=True, scope="module")
def _free_engines_after_each_module():
    """Free the engines a module started (each holds its weights and a 1 GiB KV cache) when
    the module is done, so the suite's memory stays flat: aiohttp keeps the handlers of every
    app it served in an LRU cache of 1,024 (`_cached_build_middleware`, harmless with one app
    per process), and those bound methods keep their servers and engines alive."""
    yield
    cached = getattr(aiohttp.web_app, "_cached_build_middleware", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
    gc.collect()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from a second intra-op thread on a shared machine (a module
    asks for it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama checkpoint (`make_tiny_model` in tests/helpers.py), one per module."""
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@dataclass
class GatewayHandle:
    gateway: Gateway
    url: str
    runner: object

    async def stop(self):
        await self.runner.cleanup()


@pytest.fixture
async def make_standin():
    """`await make_standin(tokens=8, gap=0.0, ...)` → a running StandIn (.url, .requests)."""
    started = []

    async def factory(**behaviour) -> StandIn:
        s = await StandIn(Behaviour(**behaviour)).start()
        started.append(s)
        return s
    yield factory
    for s in started:
        await s.stop()


@pytest.fixture
async def standin(make_standin):
    return await make_standin()


@pytest.fixture
async def make_gateway():
    """`await make_gateway({...config...})` → a running gateway (validated like a YAML file)."""
    started = []

    async def factory(raw: dict) -> GatewayHandle:
        cfg = config_mod.validate(raw)
        gw = Gateway(cfg)
        runner, url = await start_app(gw.make_app(), "127.0.0.1", 0)
        handle = GatewayHandle(gw, url, runner)
        started.append(handle)
        return handle
    yield factory
    for h in started:
        await h.stop()


@pytest.fixture
async def gateway(make_gateway, standin):
    """A gateway with one stand-in upstream named `a`."""
    return await make_gateway({"upstreams": [{"name": "a", "url": standin.url}],
                               "plugins": [{"metrics": {}}]})


@pytest.fixture
def redis_server():
    """A real redis-server on a loopback port, for the test."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs Debian's package)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer().start()
    yield server
    server.stop()
