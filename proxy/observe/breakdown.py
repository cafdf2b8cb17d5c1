"""A request's time to first byte taken apart, from its stamps and the upstream's own report.

    ttft_ms = gateway_ms + queue_ms + connect_ms + upstream_ttft_ms

- queue_ms: waiting for capacity (admission), from the routing decision to the slot;
- connect_ms: the attempts' wait for a pooled connection and, for a new one, its TCP
  connect (0 on a reused keep-alive connection);
- upstream_ttft_ms: the attempts' time from the request written to the upstream's first
  byte (streams: the first SSE chunk; whole answers: the response head);
- gateway_ms: the rest — the gateway's own work (parsing, plugins, routing, relaying).

An upstream that sends `Server-Timing` (the bundled engine) splits its part further:
engine_queue_ms (`queue`), prefill_ms (`prefill`) and first_decode_ms (`decode`). The gateway
forwards the upstream's entries and appends its own: `gw`, `gw-queue`, `connect`, `upstream`
(`gw-queue`, not `queue`, so the two queues stay apart in one header).
"""
from __future__ import annotations

import time

from prefixgate.common import server_timing

# the gateway's segments, in the order they happen (also the metrics' `stage` labels)
STAGES = ("gateway", "queue", "connect", "upstream_ttft")
# the upstream's Server-Timing entries -> breakdown keys
UPSTREAM_ENTRIES = {"queue": "engine_queue_ms", "prefill": "prefill_ms",
                    "decode": "first_decode_ms"}
FIELD_NAMES = ("ttft_ms", "gateway_ms", "queue_ms", "connect_ms", "upstream_ttft_ms",
               *UPSTREAM_ENTRIES.values())


def segments(ctx, first_byte: float | None = None) -> dict[str, float] | None:
    """{stage: seconds} up to the first byte (`first_byte`: monotonic; default the stamp),
    or None when no byte was relayed."""
    end = first_byte if first_byte is not None else ctx.t.get("first_byte")
    if end is None:
        return None
    queue = ctx.since("routed", "admitted") or 0.0
    ttft = end - ctx.t["received"]
    spent = queue + ctx.connect_s + ctx.upstream_s
    return {"gateway": max(ttft - spent, 0.0), "queue": queue, "connect": ctx.connect_s,
            "upstream_ttft": ctx.upstream_s, "ttft": ttft}


def header(ctx) -> str:
    """The Server-Timing value the client gets: the upstream's entries, then the gateway's."""
    s = segments(ctx, time.monotonic())
    return server_timing.join(
        ctx.upstream_timing,
        server_timing.entry("gw", s["gateway"] * 1e3),
        server_timing.entry("gw-queue", s["queue"] * 1e3),
        server_timing.entry("connect", s["connect"] * 1e3),
        server_timing.entry("upstream", s["upstream_ttft"] * 1e3))


def fields(ctx) -> dict[str, float | None]:
    """The breakdown in ms as the access log and spans name it (None where unknown)."""
    out: dict[str, float | None] = dict.fromkeys(FIELD_NAMES)
    s = segments(ctx)
    if s is not None:
        out.update(ttft_ms=_ms(s["ttft"]), gateway_ms=_ms(s["gateway"]),
                   queue_ms=_ms(s["queue"]), connect_ms=_ms(s["connect"]),
                   upstream_ttft_ms=_ms(s["upstream_ttft"]))
    if ctx.upstream_timing:
        for name, ms in server_timing.parse(ctx.upstream_timing).items():
            key = UPSTREAM_ENTRIES.get(name)
            if key is not None:
                out[key] = ms
    return out


def account_attempt(ctx, started: float, resp, connect_failed: bool) -> None:
    """An attempt's time, split at its request's writing into connect and upstream time
    (`resp`: its h1pool.Response; an attempt that failed without one: all connect when no
    connection opened, else all upstream — the request was most likely written)."""
    now = time.monotonic()
    if resp is not None:
        ctx.connect_s += resp.sent_at - started
        ctx.upstream_s += now - resp.sent_at
    elif connect_failed:
        ctx.connect_s += now - started
    else:
        ctx.upstream_s += now - started


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
