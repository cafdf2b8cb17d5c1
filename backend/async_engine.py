"""The engine from asyncio: `AsyncEngine` drives an `LLMEngine` (backend/engine.py), running
each step in one worker thread so the event loop keeps serving HTTP while the model computes,
and hands every request its outputs through its own queue (`RequestStream`). Before its first
step it runs the warm-up on that thread (`LLMEngine.warm_up`, backend/warmup.py); requests
queued meanwhile wait for it, and `ready` tells when it is done.

That thread (`engine_thread`) should also build the engine: on a CPU, torch's parallel loops
(oneDNN's, ours in cpu_ops) run on OpenMP threads, and libgomp gives every thread that starts
such loops a team of its own. Once more threads are in teams than there are cores, it stops
letting idle team threads spin and puts them to sleep at once, so every parallel loop after
that waits for a wake-up: an engine built on one thread and stepped on another, on two cores,
took 22.5 ms a batch-1 decode step of SmolLM2 against 12.3 built and stepped on one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from prefixgate.backend.engine import LLMEngine, RequestOutput
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.sequence import Sequence
from prefixgate.backend.warmup import WarmupError, WarmupReport
from prefixgate.common.runtime import cancel_and_wait

log = logging.getLogger("prefixgate.engine")


class RequestStream:
    """Async iterator over one request's outputs; `close()` aborts it unless it finished."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self._engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False          # no more outputs will come (done, failed or closed)
        self.completed = False         # the engine reported the request finished

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        if isinstance(out, BaseException):
            self.finished = True
            raise out
        self.finished = self.completed = out.finished
        return out

    def close(self) -> None:
        self._engine._streams.pop(self.request_id, None)
        if not self.finished:
            self.finished = True
            self._engine.engine.abort(self.request_id)
            self._engine._wake.set()


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that builds, warms up and steps an engine (see the module's docstring)."""
    return ThreadPoolExecutor(1, thread_name_prefix="prefixgate-engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, warm_up: bool = True,
                 thread: ThreadPoolExecutor | None = None):
        """`thread`: the engine_thread() that built `engine` (None: a new one)."""
        self.engine = engine
        self.warm_up = warm_up           # False: serve at once (--skip-server-warmup)
        self.warmup_report: WarmupReport | None = None
        self._warmup: asyncio.Task | None = None
        self._streams: dict[str, RequestStream] = {}
        self._executor = thread or engine_thread()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ids = 0
        self.on_step = None            # optional callback(outputs) for metrics

    def start(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._warmup = loop.create_task(self._warm_up())
            self._task = loop.create_task(self._loop())

    @property
    def status(self) -> str:
        """"ok" once the warm-up has run (or is skipped); "warming up"; "warm-up failed"."""
        w = self._warmup
        if w is None or not w.done():
            return "warming up"
        return "ok" if not w.cancelled() and w.exception() is None else "warm-up failed"

    @property
    def ready(self) -> bool:
        return self.status == "ok"

    async def wait_ready(self) -> None:
        """Return once the warm-up has run; WarmupError if it failed."""
        self.start()
        await asyncio.shield(self._warmup)

    async def _warm_up(self) -> None:
        if not self.warm_up:
            return
        try:
            self.warmup_report = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.warm_up)
        except Exception as e:      # a shape the engine is configured for cannot run (OOM ...)
            log.error("warm-up failed", exc_info=True)
            raise WarmupError(f"warm-up failed: {e}") from e

    async def stop(self) -> None:
        if self._warmup is not None:
            self._warmup.cancel()       # (the thread finishes its warm-up; shutdown waits for it)
        await cancel_and_wait(self._task)
        self._task = None
        self._executor.shutdown(wait=True)

    def new_request_id(self) -> str:
        self._ids += 1
        return f"req-{self._ids}-{time.monotonic_ns()}"

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 arrival_time: float | None = None, kv_hold: str | None = None,
                 cache_salt: str | None = None, cache_pins=()) -> RequestStream:
        request_id = request_id or self.new_request_id()
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self.engine.add_request(request_id, prompt_ids, params, arrival_time, kv_hold,
                                cache_salt, cache_pins)
        self._notify()
        return stream

    def generate_prefilled(self, seq: Sequence, fill) -> RequestStream:
        """Stream a sequence that arrives with its prompt's KV (see LLMEngine.add_prefilled)."""
        stream = RequestStream(self, seq.request_id)
        self._streams[seq.request_id] = stream
        self.engine.add_prefilled(seq, fill)
        self._notify()
        return stream

    def release_kv(self, transfer_id: str) -> None:
        self.engine.release_kv(transfer_id)
        self._notify()

    async def call(self, fn, *args):
        """Run `fn(*args)` on the engine thread between two steps (block manager work)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.engine.run_between_steps, fn, *args)

    def call_soon(self, fn, *args) -> None:
        """`call` without waiting: for clean-up that must run even if the caller is cancelled."""
        try:
            self._executor.submit(self.engine.run_between_steps, fn, *args)
        except RuntimeError:        # shut down: the engine and its blocks are gone anyway
            pass

    def _notify(self) -> None:
        self._wake.set()
        self.start()

    async def _loop(self) -> None:
        try:
            await self._warmup      # steps only after it: warm-up and requests never mix
        except WarmupError:
            return                  # nothing is served; wait_ready() raises it to the starter
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # a failed step fails its requests, not the server
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.queue.put_nowait(out)
            if self.on_step is not None:
                self.on_step(outputs)

    def _fail_all(self, error: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream.queue.put_nowait(RuntimeError(f"engine step failed: {error}"))
