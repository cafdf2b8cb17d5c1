"""Gateway fixtures: `prefixgate serve` processes started from a config file."""
from __future__ import annotations

import pytest

from tests.gateway.helpers import Serve


@pytest.fixture
async def serve_process():
    """`await serve_process(path, *args)` → a running `prefixgate serve --config path ARGS`
    (path None: `serve ARGS`), killed after."""
    procs = []

    async def start(path, *args, **kw):
        p = await Serve(path, *args, **kw).start()
        procs.append(p)
        return p
    yield start
    for p in procs:
        await p.stop()
