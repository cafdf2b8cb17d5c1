"""`prefixgate backend` as a child process of an engine benchmark, on a free loopback port,
through the one launcher (common/processes.py)."""
from __future__ import annotations

import sys
from pathlib import Path

from prefixgate.common.processes import ServerProcess
from prefixgate.common.runtime import listening_socket, url_of

ENGINE_COMMAND = (sys.executable, "-m", "prefixgate.backend")    # `prefixgate backend`


def engine_process(model: str, *flags: str, cores: str | None = None, env: dict | None = None,
                   log: str | Path | None = None, inherit_output: bool = False) -> ServerProcess:
    """The bundled engine on `model` with `flags`, not started yet (ServerProcess.start)."""
    sock = listening_socket()           # held until the engine serves on it: --listen-fd
    url = url_of("127.0.0.1", sock.getsockname()[1])
    return ServerProcess([*ENGINE_COMMAND, "--model", model, "--host", "127.0.0.1",
                          "--listen-fd", str(sock.fileno()), *flags], url,
                         what=f"the engine at {url}", cores=cores, env=env, log=log,
                         inherit_output=inherit_output, listener=sock)
