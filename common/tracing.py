"""OpenTelemetry traces over OTLP/HTTP: the `tracing:` config, shared by the gateway and the
bundled engine, and the engine's tracer.

`tracing: {otlp_endpoint: URL, service_name: prefixgate, sample_ratio: 1.0}` (the engine:
`--otlp-traces-endpoint URL`). The engine's spans (`Tracing`) are batched and exported by the
SDK's worker thread, so a request never waits for the collector; a full queue drops spans,
never requests. The gateway records and exports its own spans more cheaply
(proxy/span_export.py). An unreachable collector costs one log line a minute
(`RateLimitedLog`), nothing more.

The SDK is the optional extra `otel` (`pip install 'prefixgate[otel]'`); it is imported only
when tracing is configured, and a config that asks for tracing without it fails at start-up.
An incoming W3C `traceparent` is continued (`Tracing.parent`).
"""
from __future__ import annotations

import importlib.util
import logging
import threading
import time
from urllib.parse import urlsplit

from prefixgate.common.schema import ConfigError, Key, check, positive

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
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.kind_server = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg["service_name"]}),
            sampler=ParentBased(TraceIdRatioBased(cfg["sample_ratio"])))
        exporter = OTLPSpanExporter(endpoint=traces_url(cfg["otlp_endpoint"]),
                                    timeout=cfg["export_timeout_s"])
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter, export_timeout_millis=cfg["export_timeout_s"] * 1000))
        self.tracer = self.provider.get_tracer("prefixgate")
        self._quiet = RateLimitedLog()
        for name in EXPORT_LOGGERS:
            logging.getLogger(name).addFilter(self._quiet)

    def parent(self, headers):
        """The trace context a request's `traceparent` carries (None when it has none)."""
        if "traceparent" not in headers:
            return None
        return self._propagator.extract(headers)

    def start(self, name: str, *, kind, parent=None, start_ns: int | None = None,
              attributes: dict | None = None):
        """A span under `parent` (an extracted context; None: a root span)."""
        return self.tracer.start_span(name, context=parent, kind=kind, start_time=start_ns,
                                      attributes=attributes)

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
