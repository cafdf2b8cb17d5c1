"""A launched server is ready only when its own listener answers: another process that took
its port between the launcher's choice and the child's bind is never taken for it."""
from __future__ import annotations

import os
import sys

import pytest
from aiohttp import web

from prefixgate.common.processes import ServerProcess
from prefixgate.common.procfs import held_by
from prefixgate.common.runtime import free_port, start_app

STANDIN = [sys.executable, "-m", "prefixgate.proxy.testing.standin"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(1.5)"]


@pytest.fixture
async def stranger():
    """A server of this process answering /health 200: what took the child's port."""
    app = web.Application()
    async def health(request):
        return web.json_response({})
    app.router.add_get("/health", health)
    runner, url = await start_app(app, "127.0.0.1", 0)
    yield url
    await runner.cleanup()


async def test_a_stranger_on_the_port_is_not_the_childs_readiness(stranger):
    port = int(stranger.rsplit(":", 1)[1])
    assert held_by(os.getpid(), port) is True
    child = ServerProcess(SLEEPER, stranger, what="the child").start()
    try:
        assert held_by(child.pid, port) is False
        with pytest.raises(RuntimeError, match="the child exited with 0 .another process "
                                               "answered on its port"):
            await child.ready(20)
    finally:
        await child.close()


async def test_a_forwarded_port_can_be_waited_on_without_the_check(stranger):
    # own_port=False: a container runtime's forwarder serves the command's port
    child = ServerProcess(SLEEPER, stranger, own_port=False).start()
    try:
        await child.ready(20)
    finally:
        await child.close()


@pytest.mark.parametrize("wrapped", [False, True], ids=["itself", "forked-by-sh"])
async def test_the_child_or_its_descendant_listening_is_ready(wrapped):
    port = free_port()
    assert held_by(os.getpid(), port) is None              # nobody listens there
    argv = [*STANDIN, "--port", str(port)]
    if wrapped:             # `; true` keeps sh from exec'ing: the server is its child
        argv = ["sh", "-c", " ".join(argv) + "; true"]
    child = ServerProcess(argv, f"http://127.0.0.1:{port}").start()
    try:
        await child.ready(60)
        assert held_by(child.pid, port) is True
    finally:
        await child.close()
