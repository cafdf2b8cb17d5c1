"""OpenTelemetry traces over OTLP/HTTP, shared by the gateway and the bundled engine.

`tracing: {otlp_endpoint: URL, service_name: prefixgate, sample_ratio: 1.0}` (the engine:
`--otlp-traces-endpoint URL`). Spans are batched and exported by the SDK's worker thread,
so a request never waits for the collector; a full queue drops spans, never requests. An
unreachable collector costs one log line a minute (`RateLimitedLog`), nothing more.

The SDK is the optional extra `otel` (`pip install 'prefixgate[otel]'`); it is imported only
when tracing is configured, and a config that asks for tracing without it fails at start-up.
Incoming W3C `traceparent`/`tracestate` headers are continued; `inject()` gives the headers
that carry a span's context on to an upstream (so vLLM's own spans join the trace).
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import multiprocessing
import queue
import random
import signal
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from prefixgate.proxy.spec import ConfigError, Key, check, positive

log = logging.getLogger("prefixgate.tracing")

SPEC = {
    "otlp_endpoint": Key(str),                       # http://collector:4318 (/v1/traces added)
    "service_name": Key(str, "prefixgate"),
    "sample_ratio": Key((int, float), 1.0,
                        lambda v: None if 0 <= v <= 1 else "must be in 0..1"),
    "export_timeout_s": Key((int, float), 5.0, positive),   # one export attempt, then dropped
}
# the logger names of the SDK's export path (the batch worker, the OTLP/HTTP exporter)
EXPORT_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export",
                  "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                  "opentelemetry.exporter.otlp.proto.http._common",
                  "opentelemetry.exporter.otlp.proto.http")
LOG_EVERY_S = 60.0


def validate(raw, path: str = "tracing") -> dict | None:
    if raw is None:
        return None
    cfg = check(raw, SPEC, path)
    url = urlsplit(cfg["otlp_endpoint"])
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ConfigError(f"{path}.otlp_endpoint", "must be an http(s) URL of an OTLP/HTTP "
                          f"receiver, e.g. http://collector:4318 (got {cfg['otlp_endpoint']!r})")
    for module in ("opentelemetry.sdk.trace",
                   "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:             # a parent package is missing
            found = False
        if not found:
            raise ConfigError(path, "needs the OpenTelemetry SDK and its OTLP/HTTP exporter: "
                                    "pip install 'prefixgate[otel]'")
    return cfg


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: `/v1/traces` appended to a bare collector address."""
    url = urlsplit(endpoint)
    return endpoint if url.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


class RateLimitedLog(logging.Filter):
    """Lets one export-failure record through per `every_s`, telling how many were held."""

    def __init__(self, every_s: float = LOG_EVERY_S):
        super().__init__()
        self.every_s = every_s
        self.next_at = 0.0
        self.held = 0
        self.lock = threading.Lock()

    def allow(self) -> int | None:
        """None while held back; else how many were held since the last one let through."""
        with self.lock:
            now = time.monotonic()
            if now < self.next_at:
                self.held += 1
                return None
            self.next_at = now + self.every_s
            held, self.held = self.held, 0
        return held

    def filter(self, record: logging.LogRecord) -> bool:
        held = self.allow()
        if held:
            record.msg = f"{record.msg} ({held} more export messages held back)"
        return held is not None


class Tracing:
    """A tracer provider exporting to one OTLP/HTTP endpoint, with W3C propagation."""

    def __init__(self, cfg: dict):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.kind_server, self.kind_client = SpanKind.SERVER, SpanKind.CLIENT
        self._in_context = set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg["service_name"]}),
            sampler=ParentBased(TraceIdRatioBased(cfg["sample_ratio"])))
        exporter = OTLPSpanExporter(endpoint=traces_url(cfg["otlp_endpoint"]),
                                    timeout=cfg["export_timeout_s"])
        self.resource = self.provider.resource
        self.exporter = exporter
        self.processor = BatchSpanProcessor(
            exporter, export_timeout_millis=cfg["export_timeout_s"] * 1000)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("prefixgate")
        self._quiet = RateLimitedLog()
        for name in EXPORT_LOGGERS:
            logging.getLogger(name).addFilter(self._quiet)

    def parent(self, headers):
        """The trace context a request's `traceparent` carries (None when it has none)."""
        if "traceparent" not in headers:
            return None
        return self._propagator.extract(headers)

    def start(self, name: str, *, kind, parent=None, parent_span=None,
              start_ns: int | None = None, attributes: dict | None = None):
        """A span under `parent` (an extracted context) or `parent_span`."""
        if parent_span is not None:
            parent = self._in_context(parent_span)
        return self.tracer.start_span(name, context=parent, kind=kind, start_time=start_ns,
                                      attributes=attributes)

    def inject(self, span) -> list[tuple[str, str]]:
        """`traceparent` (and `tracestate`) headers carrying `span`'s context."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, self._in_context(span))
        return list(carrier.items())

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued (bounded: an unreachable collector cannot hold up shutdown)."""
        done = threading.Thread(target=self.provider.shutdown, daemon=True)
        done.start()
        done.join(timeout_s)
        for name in EXPORT_LOGGERS:
            logging.getLogger(name).removeFilter(self._quiet)


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() stamp as nanoseconds since the epoch (what spans carry)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


# --- the gateway's spans: recorded as tuples on the event loop, exported by a child process

@dataclass(slots=True)
class Trace:
    """One request's place in a trace: the W3C context it continues and its SERVER span."""
    trace_id: int
    parent_id: int | None          # the caller's span (from `traceparent`), None at a root
    span_id: int                   # the gateway's SERVER span
    sampled: bool
    tracestate: str | None

    def traceparent(self, span_id: int) -> str:
        """The `traceparent` an upstream gets for a CLIENT span of this trace."""
        return f"00-{self.trace_id:032x}-{span_id:016x}-{'01' if self.sampled else '00'}"


class SpanExport:
    """The gateway's tracer, lean enough for the data path.

    The SDK costs ~13 µs to make a span and ~38 µs to encode one with 14 attributes (measured
    on this project's CPU box) — several times the gateway's budget. So the event loop only
    decides sampling (the SDK's ParentBased/TraceIdRatioBased sampler) and records each
    finished span as a tuple; batches go over a multiprocessing queue to a child process,
    which rebuilds them as SDK spans and exports them with the SDK's BatchSpanProcessor and
    OTLP/HTTP exporter (`Tracing`). A full queue or a dead child drops spans, never requests.
    """
    SERVER, CLIENT = 2, 3              # OTLP span kinds (SpanKind.SERVER / CLIENT)

    def __init__(self, cfg: dict, batch_size: int = 256, flush_s: float = 0.1,
                 max_batches: int = 256):
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import get_current_span
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.cfg = cfg
        self._sampler = ParentBased(TraceIdRatioBased(cfg["sample_ratio"]))
        self._propagator = TraceContextTextMapPropagator()
        self._span_of = get_current_span
        self.batch_size, self.flush_s = batch_size, flush_s
        self._batch: list[tuple] = []
        self._queue = _MP.Queue(max_batches)
        self._child = _MP.Process(target=export_main, args=(cfg, self._queue), daemon=True,
                                  name="prefixgate-otlp-export")
        self._timer = None
        self._quiet = RateLimitedLog()
        self.dropped = 0

    def start(self) -> None:
        self._child.start()

    def begin(self, headers) -> Trace:
        """Continue the caller's trace (its `traceparent`), or start one; sampling decided."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        caller = self._span_of(parent).get_span_context() if parent is not None else None
        if caller is not None and caller.is_valid:
            trace_id, parent_id = caller.trace_id, caller.span_id
            state = headers.get("tracestate")
        else:
            trace_id, parent_id, state, parent = _random_id(128), None, None, None
        sampled = self._sampler.should_sample(parent, trace_id, "").decision.is_sampled()
        return Trace(trace_id, parent_id, _random_id(64), sampled, state)

    @staticmethod
    def new_span_id() -> int:
        return _random_id(64)

    def record(self, trace: Trace, name: str, kind: int, span_id: int, parent_id: int | None,
               start_ns: int, end_ns: int, attributes: dict, error: str | None = None) -> None:
        """One finished span of a sampled trace."""
        if not trace.sampled:
            return
        self._batch.append((name, kind, trace.trace_id, span_id, parent_id,
                            parent_id is not None and parent_id == trace.parent_id,
                            start_ns, end_ns, attributes, error))
        if len(self._batch) >= self.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += len(batch)
            if self._quiet.allow() is not None:
                log.warning("trace export is behind or its process is gone: %d spans dropped "
                            "so far", self.dropped)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is batched, let the child flush it (bounded), and stop it."""
        self._flush()
        if not self._child.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._child.join(timeout_s)
        if self._child.is_alive():
            self._child.terminate()
            self._child.join(1.0)
        self._queue.close()
        self._queue.join_thread()


def export_main(cfg: dict, batches) -> None:
    """The export process: SDK spans from the gateway's tuples, exported by the SDK."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the gateway decides when this ends
    tracing = Tracing(cfg)
    scope = InstrumentationScope("prefixgate")
    sampled = TraceFlags(TraceFlags.SAMPLED)
    kinds = {SpanExport.SERVER: SpanKind.SERVER, SpanExport.CLIENT: SpanKind.CLIENT}
    ok, failed = Status(StatusCode.UNSET), {}
    while (batch := batches.get()) is not None:
        spans = []
        for name, kind, trace_id, span_id, parent_id, remote, start, end, attrs, error in batch:
            parent = (SpanContext(trace_id, parent_id, is_remote=remote, trace_flags=sampled)
                      if parent_id is not None else None)
            status = ok if error is None else failed.get(error) or failed.setdefault(
                error, Status(StatusCode.ERROR, error))
            spans.append(ReadableSpan(
                name, SpanContext(trace_id, span_id, is_remote=False, trace_flags=sampled),
                parent, tracing.resource, attrs, kind=kinds[kind], status=status,
                start_time=start, end_time=end, instrumentation_scope=scope))
        # this process is the batching worker: one export per batch, in order; while it
        # waits on a slow collector, batches queue up in the gateway (bounded) or drop
        tracing.exporter.export(spans)
    tracing.close()


def _random_id(bits: int) -> int:
    while not (value := random.getrandbits(bits)):     # an all-zero id is invalid (W3C)
        pass
    return value


_MP = multiprocessing.get_context("spawn")      # no fork of a process running an event loop
