"""`prefixgate serve --workers N`: N gateway processes on one port, and their supervisor.

One Python process tops out at one core. As nginx's `worker_processes` and uvicorn's
`--workers`, the supervisor starts N worker processes, each a whole gateway (its own plugin
chain, upstream pools and routing state: replicas, as gateways behind a load balancer are),
all listening on the same address with SO_REUSEPORT, so the kernel spreads connections
among them. The supervisor itself serves no request. It

- holds the port first (bound, not listening; a port 0 becomes the free port the workers
  share): a port that anything else holds fails the start at once, with exit status 1;
- starts the bundled engines once, before the workers, and stops them last;
- waits until every worker listens; a worker that fails to start then ends the start-up
  (its own message says why, the exit status is its own): no respawn loop;
- forwards SIGHUP (each worker re-reads the config, as a single process does; the supervisor
  keeps the last good one for workers it starts later), SIGUSR1 (reopen the access log) and
  SIGINT/SIGTERM (each worker stops listening and gives in-flight requests
  `shutdown_timeout_s`; the supervisor exits 0 once they all have). A signal for a worker
  that is still starting waits until it listens;
- restarts a worker that dies, after a back-off: RESTART_FIRST_S, doubled for each death
  within STABLE_AFTER_S of its start, up to RESTART_MAX_S.

A worker is a `spawn`ed process (no fork of a running event loop) running `run_worker(worker,
cfg, ready)`, given by the command line (proxy/cli.py): `worker` (a `Worker`) says which one
it is and where to listen; it sends its URL through `ready` once it listens. Each worker serves
its own metrics on a unix socket under the run's folder, so /metrics answers for all of them
(proxy/worker_metrics.py).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field

from prefixgate.common.runtime import url_of

log = logging.getLogger("prefixgate.workers")

RESTART_FIRST_S = 0.5        # a worker that died after a stable run is restarted this soon
RESTART_MAX_S = 30.0         # the longest back-off between restarts of one worker
STABLE_AFTER_S = 30.0        # a worker that lived this long is healthy again (back-off reset)
STOP_GRACE_S = 10.0          # past shutdown_timeout_s, before a worker that hangs is killed

_MP = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class Worker:
    """What a worker process is told: which one it is, where to listen (the ports the
    supervisor holds), and the run's folder (its siblings' metrics sockets)."""
    index: int
    count: int
    run_dir: str
    port: int
    admin_port: int | None

    def metrics_socket(self, index: int) -> str:
        return os.path.join(self.run_dir, f"worker-{index}.sock")

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]


@dataclass
class _Slot:
    """One worker's place: its current process and what the supervisor knows of it."""
    index: int
    process: multiprocessing.process.BaseProcess | None = None
    reader: object = None            # the end of its `ready` pipe, until it listens
    ready: bool = False
    url: str = ""
    started_at: float = 0.0
    quick_deaths: int = 0            # deaths within STABLE_AFTER_S of a start, in a row
    pending: list[int] = field(default_factory=list)    # signals for when it listens
    restart: asyncio.TimerHandle | None = None


def hold_port(host: str, port: int) -> socket.socket:
    """Bind host:port (0: a free port) with SO_REUSEPORT without listening, so that the
    workers can bind it too and nobody else can. First bound without SO_REUSEPORT, which fails
    while anything holds the port (another `prefixgate serve --workers` too): OSError."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        _options(probe, family)
        try:
            probe.bind(address)
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
        port = probe.getsockname()[1]
    held = socket.socket(family, kind, proto)
    _options(held, family)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind((address[0], port, *address[2:]))
    return held


def _options(sock: socket.socket, family: int) -> None:
    """What asyncio's create_server sets on a listening socket, so the binds agree."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)


class Supervisor:
    """Runs `cfg["listen"]["workers"]` processes of `run_worker` (module doc); `engines` (a
    BundledEngines, or None) are started first; `reload_config()` re-reads the config on
    SIGHUP (the engines' upstreams added) for the workers started after it."""

    def __init__(self, cfg: dict, run_worker, reload_config, engines=None):
        self.cfg, self.run_worker, self.reload_config = cfg, run_worker, reload_config
        self.engines = engines
        self.slots = [_Slot(i) for i in range(cfg["listen"]["workers"])]
        self.stopping = False
        self.failed: _Slot | None = None         # a worker that exited before it listened
        self.started = False                     # every worker listened once
        self._changed = asyncio.Event()          # a worker listened or exited, or a signal
        self._held: list[socket.socket] = []
        self._shared: dict = {}                  # what every worker is told but its index

    async def run(self) -> int:
        """Start, serve until SIGINT/SIGTERM, stop; the exit status."""
        self._hold_ports()
        run_dir = tempfile.mkdtemp(prefix="prefixgate-workers-")
        self._shared["run_dir"] = run_dir
        try:
            if self.engines is not None:
                print(f"prefixgate: starting {len(self.engines.urls)} bundled engine(s) on "
                      f"model {self.cfg['bundled']['model']!r} ...", flush=True)
                await self.engines.start()
            self._handle_signals()
            failed = await self._start_workers()
            if failed is not None:
                return failed
            while not self.stopping:
                await self._next_change()
            print(f"prefixgate: shutting down {len(self.slots)} workers: no new connections; "
                  f"in-flight requests get up to {self.cfg['shutdown_timeout_s']}s", flush=True)
            clean = await self._stop_workers()
            print("prefixgate: stopped", flush=True)
            return 0 if clean else 1
        finally:
            await self._clean_up()
            shutil.rmtree(run_dir, ignore_errors=True)

    def _hold_ports(self) -> None:
        listen, admin = self.cfg["listen"], self.cfg["admin_listen"]
        try:
            self._held.append(hold_port(listen["host"], listen["port"]))
            if admin is not None:
                self._held.append(hold_port(admin["host"], admin["port"]))
        except OSError:
            for held in self._held:
                held.close()
            raise
        ports = [s.getsockname()[1] for s in self._held]
        self._shared = {"count": len(self.slots), "port": ports[0],
                        "admin_port": ports[1] if admin is not None else None}

    def _handle_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        loop.add_signal_handler(signal.SIGUSR1, self._forward, signal.SIGUSR1)

    async def _start_workers(self) -> int | None:
        """Start every worker and wait until each listens (then say where): None; or, when
        one exits first, stop the others: the exit status to end with."""
        for slot in self.slots:
            self._spawn(slot)
        while not self.stopping and self.failed is None and not all(
                s.ready for s in self.slots):
            await self._next_change()
        if self.failed is not None:
            code = self.failed.process.exitcode
            print(f"prefixgate: worker {self.failed.index} failed to start "
                  f"({_exit_reason(code)}); stopping", flush=True)
            await self._stop_workers()
            return code if code and code > 0 else 1
        self.started = True
        if not self.stopping:
            self._announce()
        return None

    async def _clean_up(self) -> None:
        """Whatever is left when the supervisor ends, however it ends: no handlers, no
        workers, no engines, no held ports."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
        for slot in self.slots:
            self._cancel_restart(slot)
            if slot.process is not None and slot.process.exitcode is None:
                self._unwatch(slot)
                slot.process.kill()
                slot.process.join()
        if self.engines is not None:
            await self.engines.stop()
        for held in self._held:
            held.close()

    def _announce(self) -> None:
        url = self.slots[0].url
        names = ", ".join(f"{u['name']}={u['url']}" for u in self.cfg["upstreams"])
        print(f"prefixgate: gateway listening on {url} (OpenAI API at {url}/v1) -> {names}; "
              f"{len(self.slots)} workers (pids "
              f"{', '.join(str(s.process.pid) for s in self.slots)})", flush=True)
        admin = self.cfg["admin_listen"]
        if admin is not None:
            print(f"prefixgate: admin (/metrics, /health) on "
                  f"{url_of(admin['host'], self._shared['admin_port'])}", flush=True)

    async def _next_change(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    # --- one worker ------------------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> None:
        slot.restart = None
        if self.stopping:
            return
        reader, writer = _MP.Pipe(duplex=False)
        worker = Worker(index=slot.index, **self._shared)
        slot.process = _MP.Process(target=self.run_worker, args=(worker, self.cfg, writer),
                                   name=f"prefixgate-worker-{slot.index}")
        slot.process.start()
        writer.close()              # the worker holds the only writer: EOF when it is gone
        slot.ready, slot.started_at, slot.reader = False, time.monotonic(), reader
        loop = asyncio.get_running_loop()
        loop.add_reader(reader.fileno(), self._listening, slot)
        loop.add_reader(slot.process.sentinel, self._exited, slot)

    def _unwatch(self, slot: _Slot) -> None:
        """Stop watching the slot's process (it exited, or the supervisor ends)."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(slot.process.sentinel)
        if slot.reader is not None:
            loop.remove_reader(slot.reader.fileno())
            slot.reader.close()
            slot.reader = None

    def _listening(self, slot: _Slot) -> None:
        """The worker's message on `ready`: its URL, once it listens."""
        try:
            slot.url = slot.reader.recv()
        except (EOFError, OSError):
            return                  # it exited first: _exited tells
        finally:
            asyncio.get_running_loop().remove_reader(slot.reader.fileno())
            slot.reader.close()
            slot.reader = None
        slot.ready = True
        if self.started:
            log.info("worker %d (pid %d) is back", slot.index, slot.process.pid)
        for sig in slot.pending:
            self._signal(slot, sig)
        slot.pending.clear()
        self._changed.set()

    def _exited(self, slot: _Slot) -> None:
        self._unwatch(slot)
        slot.process.join()
        code, was_ready = slot.process.exitcode, slot.ready
        slot.ready = False
        self._changed.set()
        if self.stopping:
            return
        if not self.started:
            self.failed = self.failed or slot
            return
        lived = time.monotonic() - slot.started_at
        slot.quick_deaths = slot.quick_deaths + 1 if lived < STABLE_AFTER_S else 0
        delay = min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** max(0, slot.quick_deaths - 1))
        log.error("worker %d (pid %d) %s after %.1fs (%s); restarting it in %.1fs",
                  slot.index, slot.process.pid, "exited" if was_ready else "failed to start",
                  lived, _exit_reason(code), delay)
        slot.pending.clear()     # a new process reads the config and opens the log afresh
        slot.restart = asyncio.get_running_loop().call_later(delay, self._spawn, slot)

    @staticmethod
    def _cancel_restart(slot: _Slot) -> None:
        if slot.restart is not None:
            slot.restart.cancel()
            slot.restart = None

    def _signal(self, slot: _Slot, sig: int) -> None:
        try:
            os.kill(slot.process.pid, sig)
        except ProcessLookupError:
            pass                    # it just exited: _exited tells

    # --- signals ---------------------------------------------------------------------------
    def _forward(self, sig: int) -> None:
        for slot in self.slots:
            if slot.process is None or slot.process.exitcode is not None:
                continue
            if slot.ready:
                self._signal(slot, sig)
            elif sig not in slot.pending:
                slot.pending.append(sig)

    def _reload(self) -> None:
        """SIGHUP: each worker re-reads the config and says what it made of it; a good one is
        also kept here, for the workers started later."""
        try:
            self.cfg = self.reload_config()
        except Exception as e:          # the workers log why
            log.debug("the config as re-read does not validate: %s", e)
        self._forward(signal.SIGHUP)

    def _stop(self) -> None:
        self.stopping = True
        self._changed.set()

    async def _stop_workers(self) -> bool:
        """SIGTERM to every worker, SIGKILL to those still running after shutdown_timeout_s
        and STOP_GRACE_S; whether all of them exited with status 0."""
        self.stopping = True
        for slot in self.slots:
            self._cancel_restart(slot)
            if slot.process is not None and slot.process.exitcode is None:
                self._signal(slot, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg["shutdown_timeout_s"] + STOP_GRACE_S
        running = [s.process for s in self.slots if s.process is not None]
        while any(p.is_alive() for p in running) and time.monotonic() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        for process in running:
            if process.is_alive():
                log.error("worker %s (pid %d) did not stop in time: killed", process.name,
                          process.pid)
                process.kill()
            process.join()
        return all(p.exitcode == 0 for p in running)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"
