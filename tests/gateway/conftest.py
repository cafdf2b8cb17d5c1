"""Gateway fixtures: `prefixgate serve` processes started from a config file."""
from __future__ import annotations

import pytest

from tests.gateway.helpers import Serve


@pytest.fixture
async def serve_process():
    """`await serve_process(path)` → a running `prefixgate serve --config path`, killed after."""
    procs = []

    async def start(path):
        p = await Serve(path).start()
        procs.append(p)
        return p
    yield start
    for p in procs:
        await p.stop()
