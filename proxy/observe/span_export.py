"""The gateway's spans: recorded as tuples on the event loop, exported by a child process.

The OpenTelemetry SDK costs ~13 µs to make a span and ~38 µs to encode one with 14
attributes (measured on this project's 2-core CPU box): several times the gateway's whole
per-request budget, and on the event loop's interpreter. So the loop only decides sampling
(the SDK's ParentBased/TraceIdRatioBased sampler) and appends each finished span as a tuple
to a batch; batches go over a bounded multiprocessing queue to a child process, which encodes
the OTLP `ExportTraceServiceRequest` (`Encoder`) and POSTs it to the collector's /v1/traces
as OTLP/HTTP protobuf. A full queue, a dead child or a collector
that is down drops spans (one log line a minute), never a request.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import random
import signal
import socket
import struct
import urllib.error
import urllib.request
from dataclasses import dataclass

from prefixgate.common.tracing import RateLimitedLog, traces_url

log = logging.getLogger("prefixgate.tracing")

SERVER, CLIENT = 2, 3                    # OTLP Span.SpanKind values
STATUS_ERROR = 2                         # OTLP Status.STATUS_CODE_ERROR
MAX_REUSED = 4096                        # distinct encoded (key, value) attributes kept


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
    """The gateway's tracer: `begin` a request's trace, `record` its finished spans."""
    SERVER, CLIENT = SERVER, CLIENT

    def __init__(self, cfg: dict, batch_size: int = 1024, flush_s: float = 0.25,
                 max_batches: int = 256, worker: int | None = None):
        from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
        from opentelemetry.trace import get_current_span
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.cfg = cfg
        # ParentBased(TraceIdRatioBased(ratio)), decided inline (the sampler objects cost
        # ~5 µs a call): a caller's decision is followed; a new trace is sampled when the low
        # 64 bits of its id fall under the SDK's bound for the ratio
        self._bound = TraceIdRatioBased.get_bound_for_rate(cfg["sample_ratio"])
        self._id_mask = TraceIdRatioBased.TRACE_ID_LIMIT
        self._propagator = TraceContextTextMapPropagator()
        self._span_of = get_current_span
        self.batch_size, self.flush_s = batch_size, flush_s
        self._batch: list[tuple] = []
        self._queue = _MP.Queue(max_batches)
        self._child = _MP.Process(target=export_main,
                                  args=(cfg, self._queue, worker_resource(worker)),
                                  daemon=True, name="prefixgate-otlp-export")
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
            return Trace(caller.trace_id, caller.span_id, random_id(64),
                         caller.trace_flags.sampled, headers.get("tracestate"))
        trace_id = random_id(128)
        return Trace(trace_id, None, random_id(64), trace_id & self._id_mask < self._bound, None)

    @staticmethod
    def new_span_id() -> int:
        return random_id(64)

    def record(self, trace: Trace, name: str, kind: int, span_id: int, parent_id: int | None,
               start_ns: int, end_ns: int, attributes, error: str | None = None) -> None:
        """One finished span of a sampled trace. `attributes`: a dict, or (function, args)
        that makes it — a module-level function, called in the export process, so naming
        attributes costs the event loop nothing."""
        if not trace.sampled:
            return
        self._batch.append((name, kind, trace.trace_id, span_id, parent_id,
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
        """Send what is batched, let the child export it (bounded), and stop it."""
        self._flush()
        if self._child.is_alive():
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                pass
            self._child.join(timeout_s)
            if self._child.is_alive():
                self._child.terminate()
                self._child.join(1.0)
        self._queue.close()
        self._queue.cancel_join_thread()     # a child that is gone takes nothing more


# --- the export process ------------------------------------------------------------------

def export_main(cfg: dict, batches, resource: dict | None = None) -> None:
    """Batches of span tuples in, OTLP/HTTP protobuf exports out, until None arrives.
    `resource`: attributes besides service.name (a worker's: `worker_resource`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the gateway decides when this ends
    encoder = Encoder(cfg["service_name"], resource)
    url, timeout = traces_url(cfg["otlp_endpoint"]), cfg["export_timeout_s"]
    quiet = RateLimitedLog()
    while (batch := batches.get()) is not None:
        while len(batch) < 2048:            # take what else is waiting: fewer, larger posts
            try:
                more = batches.get_nowait()
            except queue.Empty:
                break
            if more is None:
                _post(url, encoder.encode(batch), timeout, quiet)
                return
            batch += more
        _post(url, encoder.encode(batch), timeout, quiet)


class Encoder:
    """Span tuples -> a serialized OTLP ExportTraceServiceRequest, in protobuf's wire format.

    Written out here because opentelemetry-proto's message classes cost ~1 µs per attribute
    (~20 µs a span; the SDK's encoder ~38 µs), more than the whole export budget. The shapes
    are few and fixed: the field numbers below are opentelemetry/proto/trace/v1/trace.proto's,
    and the tests decode every export with opentelemetry-proto itself. Attributes that repeat
    (model, upstream, method, status) are encoded once; timings reuse their key's prefix.
    """

    def __init__(self, service_name: str, resource_attributes: dict | None = None):
        resource = b"".join(_attribute(1, key, value) for key, value in      # Resource.attributes
                            {"service.name": service_name, **(resource_attributes or {})}.items())
        scope = _ld(1, _ld(1, b"prefixgate"))                 # ScopeSpans.scope (name)
        self._resource, self._scope = _ld(1, resource), scope    # ResourceSpans.resource
        self._reused: dict[tuple, bytes] = {}
        self._double_prefix: dict[str, bytes] = {}

    def encode(self, batch: list[tuple]) -> bytes:
        spans = [self._span(*item) for item in batch]
        scope_spans = _ld(2, self._scope + b"".join(spans))      # ResourceSpans.scope_spans
        return _ld(1, self._resource + scope_spans)     # ExportTraceServiceRequest.resource_spans

    def _span(self, name, kind, trace_id, span_id, parent_id, start, end, attrs, error) -> bytes:
        if isinstance(attrs, tuple):
            make, args = attrs
            attrs = make(*args)
        parts = [b"\x0a\x10", trace_id.to_bytes(16, "big"), b"\x12\x08", span_id.to_bytes(8, "big")]
        if parent_id is not None:
            parts += [b"\x22\x08", parent_id.to_bytes(8, "big")]
        parts += [_ld(5, name.encode()), b"\x30", _varint(kind),
                  b"\x39", _FIXED64.pack(start), b"\x41", _FIXED64.pack(end)]
        for key, value in attrs.items():
            if isinstance(value, float):
                prefix = self._double_prefix.get(key)
                if prefix is None:
                    prefix = self._double_prefix[key] = _attribute(9, key, 0.0)[:-8]
                parts += [prefix, _DOUBLE.pack(value)]
            else:
                encoded = self._reused.get((key, value))
                if encoded is None:
                    encoded = _attribute(9, key, value)
                    if len(self._reused) >= MAX_REUSED:      # ids, counts: don't grow forever
                        self._reused.clear()
                    self._reused[(key, value)] = encoded
                parts.append(encoded)
        if error is not None:                   # Status {message = 2, code = 3}
            parts.append(_ld(15, _ld(2, error.encode()) + b"\x18" + _varint(STATUS_ERROR)))
        return _ld(2, b"".join(parts))          # ScopeSpans.spans


def worker_resource(worker: int | None) -> dict:
    """The resource attributes of a worker of `serve --workers N` (called in the worker):
    its `service.instance.id` (host, the supervisor's pid, its index: the same across its
    restarts) and `prefixgate.worker`, its index. None: a gateway alone, neither."""
    if worker is None:
        return {}
    return {"service.instance.id": f"{socket.gethostname()}-{os.getppid()}-{worker}",
            "prefixgate.worker": worker}


def _attribute(field: int, key: str, value) -> bytes:
    """A KeyValue {key = 1, value = 2: AnyValue} as field `field` of its message."""
    if isinstance(value, bool):
        any_value = b"\x10" + (b"\x01" if value else b"\x00")          # bool_value = 2
    elif isinstance(value, int):
        any_value = b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)      # int_value = 3
    elif isinstance(value, float):
        any_value = b"\x21" + _DOUBLE.pack(value)                     # double_value = 4
    else:
        any_value = _ld(1, str(value).encode("utf-8", "surrogatepass"))   # string_value = 1
    return _ld(field, _ld(1, key.encode()) + _ld(2, any_value))


def _ld(field: int, data: bytes) -> bytes:
    """A length-delimited field: tag, length, bytes."""
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_DOUBLE, _FIXED64 = struct.Struct("<d"), struct.Struct("<Q")


def _post(url: str, payload: bytes, timeout: float, quiet: RateLimitedLog) -> None:
    request = urllib.request.Request(url, data=payload, method="POST", headers={
        "Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            answer.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        held = quiet.allow()
        if held is not None:
            log.warning("trace export to %s failed: %s (spans dropped; %d more failures "
                        "held back)", url, getattr(e, "reason", e), held)


def random_id(bits: int) -> int:
    while not (value := random.getrandbits(bits)):     # an all-zero id is invalid (W3C)
        pass
    return value


_MP = multiprocessing.get_context("spawn")      # no fork of a process running an event loop
