"""A real OTLP/HTTP trace receiver on loopback, for tests and `bench overhead --tracing`.

It accepts `POST /v1/traces` (protobuf `ExportTraceServiceRequest`, decoded with
opentelemetry-proto, gzip or not) and keeps every span as a plain dict: name, kind, ids in
hex, parent, attributes, events, times, the sending service's name and its resource's
attributes.
"""
from __future__ import annotations

import asyncio
import gzip
from dataclasses import dataclass, field

from aiohttp import web

from prefixgate.common.runtime import install_uvloop, start_app

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(payload: bytes) -> list[dict]:
    """The spans of one ExportTraceServiceRequest, flattened."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(payload)
    spans = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        service = resource.get("service.name")
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({
                    "name": s.name, "kind": KINDS.get(s.kind, str(s.kind)),
                    "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex() or None,
                    "attributes": _attributes(s.attributes),
                    "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                "attributes": _attributes(e.attributes)} for e in s.events],
                    "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                    "status": s.status.code, "service": service, "resource": resource})
    return spans


@dataclass
class OtlpReceiver:
    spans: list[dict] = field(default_factory=list)
    posts: int = 0
    received_bytes: int = 0
    decode: bool = True        # False: acknowledge each export without decoding it
    url: str = ""
    _runner: object = None
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> OtlpReceiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner, self.url = await start_app(app, host, port)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.received_bytes += len(body)
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            if self.decode:
                self.spans.extend(decode(body))
        except Exception as e:          # a malformed export: say so, as a collector would
            return web.Response(status=400, text=f"bad ExportTraceServiceRequest: {e}")
        self.posts += 1
        self._arrived.set()
        # an empty ExportTraceServiceResponse
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def wait_for(self, predicate, timeout: float = 10.0) -> list[dict]:
        """Wait until `predicate(spans)` holds; returns the spans (TimeoutError otherwise)."""
        async with asyncio.timeout(timeout):
            while not predicate(self.spans):
                self._arrived.clear()
                await self._arrived.wait()
        return self.spans

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]


async def _serve(port: int, decode_spans: bool) -> None:
    receiver = await OtlpReceiver(decode=decode_spans).start(port=port)
    print(f"otlp receiver on {receiver.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        print(f"received {receiver.posts} exports, {receiver.received_bytes} bytes, "
              f"{len(receiver.spans)} spans decoded", flush=True)
        await receiver.stop()


def main(argv=None) -> int:
    """`python -m prefixgate.proxy.testing.otlp --port 4318`: a receiver that keeps spans."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m prefixgate.proxy.testing.otlp")
    p.add_argument("--port", type=int, default=4318)
    p.add_argument("--no-decode", action="store_true",
                   help="acknowledge exports without decoding them (a collector's parsing is "
                   "its own CPU, elsewhere in production; benchmarks on one box use this)")
    args = p.parse_args(argv)
    install_uvloop()
    try:
        asyncio.run(_serve(args.port, not args.no_decode))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
