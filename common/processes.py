"""A server in a child process, for the benchmarks and the test harnesses: the one launcher
(every engine, vLLM server, router, stand-in or gateway a tool starts and stops) beside the
one readiness poller (runtime.wait_ready).

    server = ServerProcess([...argv], "http://127.0.0.1:8000", cores="1", log=path)
    server.start()
    server.wait_ready(timeout)        # from plain code; `await server.ready(timeout)` on a loop
    ...
    server.stop()                     # or `await server.close()` on a loop

Each child runs in a session of its own, so `stop` ends whatever it started too (vLLM's engine
core, nginx's workers), and, when started from the main thread, it is sent SIGTERM as soon as
the thread that started it ends (the die-with-parent guard: a test run or benchmark killed by
its timeout leaves no server spinning on a core). `cores` pins it with taskset from its first
instruction on.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

from prefixgate.common.runtime import wait_ready

PR_SET_PDEATHSIG = 1        # linux/prctl.h


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies. Linux sends
    it when the *thread* that started the child ends, so it is asked for only from the main
    thread (a server started from a worker thread, `asyncio.to_thread`, would be killed as
    soon as the pool let that thread go)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    """One server process (module doc): `argv` run with `env` (default: this process's) in
    `cwd`, serving `url`; its output (stdout and stderr) to the file `log` (appended to with
    `append_log`), to this process's own with `inherit_output`, else nowhere. `what` names it
    in errors (default: "`argv[0]` at `url`"). `own_port`: `url`'s port is its own (or a
    descendant's) listener, so a stranger's answer there is not its readiness; False for a
    command that has another process serve it (a container runtime's port forwarder).
    `listener`: a listening socket it inherits (runtime.listening_socket, its fd named in
    `argv`, e.g. the engine's --listen-fd); this process's copy is closed once it started."""

    def __init__(self, argv: list[str], url: str | None = None, *, what: str | None = None,
                 cores: str | None = None, env: dict | None = None,
                 log: str | Path | None = None, append_log: bool = False,
                 inherit_output: bool = False, cwd: str | Path | None = None,
                 own_port: bool = True, listener: socket.socket | None = None):
        self.argv = ["taskset", "-c", cores, *argv] if cores is not None else list(argv)
        self.url, self.env, self.cwd = url, env, cwd
        self.what = what or f"{Path(argv[0]).name} at {url}"
        self.log, self.append_log = Path(log) if log else None, append_log
        self.inherit_output, self.own_port = inherit_output, own_port
        self.listener = listener
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def start(self) -> ServerProcess:
        out = (open(self.log, "ab" if self.append_log else "wb") if self.log
               else None if self.inherit_output else subprocess.DEVNULL)
        try:
            guard = threading.current_thread() is threading.main_thread()
            self.proc = subprocess.Popen(self.argv, stdout=out,
                                         stderr=None if out is None else subprocess.STDOUT,
                                         env=self.env, cwd=self.cwd, start_new_session=True,
                                         pass_fds=self._passed_fds(),
                                         preexec_fn=die_with_parent if guard else None)
        finally:
            if self.log:
                out.close()
            self._close_listener()          # the child's now (or nobody's: it did not start)
        return self

    def _passed_fds(self) -> tuple[int, ...]:
        return () if self.listener is None else (self.listener.fileno(),)

    def _close_listener(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()

    async def ready(self, timeout: float, path: str = "/health",
                    interval: float = 0.1) -> float:
        """Wait until `url + path` answers 200 (runtime.wait_ready: RuntimeError when it
        exits or `timeout` passes); returns when it first answered at all (monotonic)."""
        return await wait_ready(self.url, path, timeout, self.proc, what=self.what,
                                interval=interval, own_port=self.own_port)

    def wait_ready(self, timeout: float, path: str = "/health", interval: float = 0.5) -> float:
        """`ready` from code that runs no event loop (a thread of its own is fine)."""
        return asyncio.run(self.ready(timeout, path, interval))

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to its process group, then SIGKILL to whatever is left of the group after
        `timeout` (a child may outlive its parent). Nothing when it is not running."""
        self._close_listener()              # never started
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)

    async def close(self, timeout: float = 20.0) -> None:
        """`stop` from an event loop (it waits in a thread)."""
        await asyncio.to_thread(self.stop, timeout)
