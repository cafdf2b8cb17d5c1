"""`prefixgate backend` as a child process of an engine benchmark, on a free loopback port,
through the one launcher (common/processes.py)."""
from __future__ import annotations

import sys
from pathlib import Path

from prefixgate.common.processes import ServerProcess
from prefixgate.common.runtime import free_port, url_of

ENGINE_COMMAND = (sys.executable, "-m", "prefixgate.backend")    # `prefixgate backend`


def engine_process(model: str, *flags: str, cores: str | None = None, env: dict | None = None,
                   log: str | Path | None = None, inherit_output: bool = False) -> ServerProcess:
    """The bundled engine on `model` with `flags`, not started yet (ServerProcess.start)."""
    port = free_port()
    url = url_of("127.0.0.1", port)
    return ServerProcess([*ENGINE_COMMAND, "--model", model, "--host", "127.0.0.1",
                          "--port", str(port), *flags], url, what=f"the engine at {url}",
                         cores=cores, env=env, log=log, inherit_output=inherit_output)
