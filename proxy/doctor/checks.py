"""The judgement half of `prefixgate doctor`: measurements in, findings with fixes out.

Thresholds are named here so the verdicts can be read and argued with.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prefixgate.proxy.doctor import scrape as pm
from prefixgate.proxy.doctor.trace import StreamReads

MIN_EVENTS = 4              # content events needed to judge the arrival pattern
BURST_READS = 2             # ... all of them in this few reads means someone buffered
MIN_STREAM_S = 0.05         # ... over a stream at least this long (else too fast to tell)
BURST_RETRIES = 2           # a burst is re-checked this often: a client short of CPU reads in
#                             bursts too, a buffering hop buffers every stream
OUTSIDE_S = 0.05            # client TTFT above server TTFT by more than this ...
OUTSIDE_FRAC = 0.25         # ... and by more than this fraction: time lost in between
HIT_RATIO_OK = 0.5          # prefix-cache hit ratio of an identical second request
TIMING_MIN_S = 0.03         # first TTFT below this: prefill too short to judge by timing
TIMING_FASTER = 0.6         # second TTFT at most this fraction of the first: cache works
TIMING_SAME = 0.85          # second TTFT at least this fraction of the first: cache off
KV_HIGH = 0.9               # KV cache usage that leaves no room for bursts
SHAREABLE_LOW = 0.5         # two requests sharing less than this of the prompt
DOMINANT_SHARE = 0.5        # a TTFT segment this share of the client's TTFT or more ...
DOMINANT_MIN_S = 0.02       # ... and at least this long names the verdict (else: too short)

FIX_BUFFERING = ("turn response buffering off on every hop of the streaming route: nginx "
                 "`proxy_buffering off;` (or have the backend send `X-Accel-Buffering: no`), "
                 "no gzip/brotli for text/event-stream, streaming mode on API gateways and CDNs "
                 "(prefixgate's gateway never buffers)")
FIX_CACHE = ("turn prefix caching on: vLLM `--enable-prefix-caching` (on by default in V1), "
             "SGLang: drop `--disable-radix-cache`, prefixgate backend: drop "
             "`--no-prefix-caching`; with several replicas route by prefix (`prefix_route`)")
FIX_DYNAMIC = ("move per-request values (time, ids) after the static part of the prompt, at "
               "the end of the last user message, or put prefixgate's `normalize` plugin in "
               "front, which moves them there")


@dataclass
class Finding:
    check: str                     # "a".."d"
    title: str
    status: str                    # PASS, INFO, WARN, FAIL, SKIP
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)


def ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.0f} ms"


# --- (a) transport -------------------------------------------------------------------------
def burst(tr: StreamReads) -> bool:
    """Whether the stream's content came in a burst: enough events, all in a read or two, at
    the end of a stream long enough that a streaming route would have spread them out."""
    times = tr.content_times
    return (not tr.error and len(times) >= MIN_EVENTS and tr.content_reads <= BURST_READS
            and times[-1] >= MIN_STREAM_S)


def streaming(tr: StreamReads, bursts: int = 0) -> Finding:
    """`bursts`: the streams before `tr` that came in a burst (re-checked: `BURST_RETRIES`)."""
    title = "streaming"
    if tr.error:
        return Finding("a", title, "FAIL", f"the streamed request failed: {tr.error}",
                       "check the URL, the model name and the server's logs")
    times, reads = tr.content_times, tr.content_reads
    data = {"content_events": len(times), "content_reads": reads, "reads": len(tr.reads),
            "ttft_ms": tr.ttft and round(tr.ttft * 1000, 1),
            "end_ms": tr.end and round(tr.end * 1000, 1), "headers": tr.headers,
            "bursts_before": bursts}
    if tr.encoding not in ("", "identity"):
        return Finding("a", title, "FAIL", f"the event stream is compressed (Content-Encoding: "
                       f"{tr.encoding}); a compressor holds tokens back until its window fills",
                       FIX_BUFFERING, data)
    if "content-length" in tr.headers:
        return Finding("a", title, "FAIL", f"the stream came with Content-Length: "
                       f"{tr.headers['content-length']}, so something read it whole before "
                       f"sending it on (first content at {ms(tr.ttft)})", FIX_BUFFERING, data)
    if len(times) < MIN_EVENTS:
        return Finding("a", title, "INFO", f"only {len(times)} content events came back (the "
                       f"model stopped early?); too few to judge the arrival pattern", data=data)
    span = times[-1] - times[0]
    if burst(tr):
        return Finding("a", title, "FAIL", f"all {len(times)} content events arrived in "
                       f"{reads} read(s) at {ms(times[0])}..{ms(times[-1])}, in {bursts + 1} "
                       f"stream(s) of {bursts + 1}: the stream is buffered on the way (a "
                       f"streaming server sends one event per token)", FIX_BUFFERING, data)
    return Finding("a", title, "PASS", f"{len(times)} content events over {reads} reads, first "
                   f"at {ms(times[0])}, last at {ms(times[-1])} ({ms(span / (len(times) - 1))} "
                   f"apart on average): not buffered", data=data)


def client_vs_server(client_ttft: float | None, server_ttft: float | None,
                     source: str | None) -> Finding:
    title = "client vs server TTFT"
    if client_ttft is None:
        return Finding("a", title, "SKIP", "no client TTFT measured")
    if server_ttft is None:
        return Finding("a", title, "INFO", f"client TTFT {ms(client_ttft)}; the server exposes "
                       "no TTFT histogram to compare with (pass --metrics-url of the engine)")
    outside = client_ttft - server_ttft
    data = {"client_ms": round(client_ttft * 1000, 1), "server_ms": round(server_ttft * 1000, 1),
            "metric": source}
    if outside > OUTSIDE_S and outside > OUTSIDE_FRAC * client_ttft:
        return Finding("a", title, "WARN", f"client TTFT {ms(client_ttft)} but the server "
                       f"reports {ms(server_ttft)} ({source}): {ms(outside)} is spent between "
                       "them", "reuse connections (keep-alive), move the client closer, remove "
                       "proxies in between, and check the streaming finding above", data)
    return Finding("a", title, "PASS", f"client TTFT {ms(client_ttft)}, server {ms(server_ttft)}"
                   f" ({source}): no time lost in between", data=data)


# The TTFT breakdown, from the Server-Timing header (prefixgate.common.server_timing): the
# gateway's entries, the engine's, and what neither accounts for. Per segment: its label in the
# detail, what the verdict calls it and the status when it dominates (SEGMENTS), and the fix
# (FIXES).
GATEWAY_ENTRIES = ("gw", "gw-queue", "connect", "upstream")
ENGINE_ENTRIES = ("tokenize", "queue", "prefill", "decode")
SEGMENTS = {
    "gateway": ("gateway", "the gateway's own work", "WARN"),
    "gateway_queue": ("gateway queue", "waiting for admission in the gateway", "WARN"),
    "connect": ("connect", "connecting to the upstream", "WARN"),
    "engine_tokenize": ("engine tokenize", "engine tokenization", "WARN"),
    "engine_queue": ("engine queue", "engine queueing", "WARN"),
    "prefill": ("prefill", "prefill", "INFO"),
    "first_decode": ("first decode", "the first decode (token sampled to token sent)", "WARN"),
    "upstream_other": ("upstream other", "upstream time outside the engine", "WARN"),
    "transfer": ("transfer/unaccounted", "transfer/unaccounted time", "WARN"),
}
FIX_IN_BETWEEN = ("time between the client and the server: a buffering proxy, the network, or "
                  "a slow HTTP layer")
FIXES = {
    "gateway": "the gateway's own work dominates: check tokenizer-based plugins (prerender) "
               "and the host's CPU",
    "gateway_queue": "requests wait for admission: raise max_inflight if the engines have "
                     "headroom, else add replicas",
    "connect": "connections are opened per request: check keep-alive / pool size "
               "(max_inflight)",
    "engine_tokenize": "long prompts tokenized per request: pre-render/prefix-stable prompts, "
                       "or forward tokens",
    "engine_queue": "add replicas or cap concurrency (the engine's max_num_seqs, or the "
                    "gateway's admission/max_inflight)",
    "prefill": "prefill dominates, as it should for a cold long prompt: see (b) prefix cache",
    "first_decode": "the engine's event loop is slow to send the first token: too many "
                    "streams per process?",
    "upstream_other": FIX_IN_BETWEEN,
    "transfer": FIX_IN_BETWEEN,
}

_ENTRY_SEGMENT = {"gw": "gateway", "gw-queue": "gateway_queue", "connect": "connect",
                  "tokenize": "engine_tokenize", "queue": "engine_queue", "prefill": "prefill",
                  "decode": "first_decode"}


def breakdown_segments(client_ms: float, timing: dict[str, float]) -> dict[str, float]:
    """{segment: ms} of one response's TTFT. Behind the gateway the rest is client TTFT minus
    (gw + gw-queue + connect + upstream), and upstream minus the engine's entries is "upstream
    other"; straight at the engine the rest is client TTFT minus the engine's entries."""
    seg = {_ENTRY_SEGMENT[e]: timing[e] for e in (*GATEWAY_ENTRIES, *ENGINE_ENTRIES)
           if e in _ENTRY_SEGMENT and e in timing}
    engine = sum(timing[e] for e in ENGINE_ENTRIES if e in timing)
    if any(e in timing for e in GATEWAY_ENTRIES):
        if "upstream" in timing:
            seg["upstream_other"] = max(0.0, timing["upstream"] - engine)
        accounted = sum(timing.get(e, 0.0) for e in ("gw", "gw-queue", "connect")) + (
            timing["upstream"] if "upstream" in timing else engine)
    else:
        accounted = engine
    seg["transfer"] = max(0.0, client_ms - accounted)
    return {k: round(v, 1) for k, v in seg.items()}


def ttft_breakdown(client_ttft: float | None, timing: dict[str, float] | None) -> Finding:
    """Where the streamed probe's TTFT went, by the response's Server-Timing header."""
    title = "TTFT breakdown"
    if not timing:
        return Finding("a", title, "SKIP", "the server sends no Server-Timing header to break "
                       "TTFT down with (vLLM doesn't; the bundled engine and the prefixgate "
                       "gateway do)")
    known = [e for e in (*GATEWAY_ENTRIES, *ENGINE_ENTRIES) if e in timing]
    if not known:
        return Finding("a", title, "SKIP", f"the server's Server-Timing has none of the entries "
                       f"prefixgate reads ({', '.join(timing)}; expected "
                       f"{', '.join(GATEWAY_ENTRIES + ENGINE_ENTRIES)})",
                       data={"server_timing": timing})
    if client_ttft is None:
        return Finding("a", title, "SKIP", "no client TTFT measured (the streamed request "
                       "failed)", data={"server_timing": timing})
    client_ms = client_ttft * 1000.0
    seg = breakdown_segments(client_ms, timing)
    largest = max(seg, key=seg.get)
    share = seg[largest] / client_ms if client_ms > 0 else 0.0
    dominant = (largest if share >= DOMINANT_SHARE and seg[largest] >= DOMINANT_MIN_S * 1000
                else None)
    data = {"client_ms": round(client_ms, 1), "segments": seg, "dominant": dominant,
            "share": round(share, 3), "server_timing": timing}
    parts = ", ".join(f"{SEGMENTS[k][0]} {v:.1f} ms ({v / client_ms:.0%})" if client_ms > 0
                      else f"{SEGMENTS[k][0]} {v:.1f} ms" for k, v in seg.items())
    listing = f"client TTFT {client_ms:.1f} ms = {parts}"
    if dominant is None:
        why = ("no segment dominates" if share < DOMINANT_SHARE
               else "too short to matter")
        return Finding("a", title, "PASS", f"{why} ({listing})", data=data)
    _, noun, status = SEGMENTS[dominant]
    fix = FIXES[dominant]
    detail = f"{share:.0%} of TTFT is {noun} ({listing})"
    if status == "INFO":
        detail += f"; {fix}"
    return Finding("a", title, status, detail, fix, data)


# --- (b) prefix cache ----------------------------------------------------------------------
def prefix_cache(ttft1: float | None, ttft2: float | None, before: dict | None,
                 after: dict | None, errors: list[str]) -> Finding:
    title = "prefix cache"
    if errors:
        return Finding("b", title, "FAIL", f"the probe request failed: {errors[0]}",
                       "check the URL, the model name and the server's logs")
    times = f"TTFT {ms(ttft1)} then {ms(ttft2)}"
    data = {"ttft1_ms": ttft1 and round(ttft1 * 1000, 1),
            "ttft2_ms": ttft2 and round(ttft2 * 1000, 1)}
    q = pm.delta(before or {}, after or {}, "prefix_queries") if after else None
    h = pm.delta(before or {}, after or {}, "prefix_hits") if after else None
    if q is not None:
        data.update(queries=q[1], hits=h[1] if h else 0.0, metric=q[0])
        if q[1] <= 0:
            return Finding("b", title, "FAIL", f"the server counted no prefix-cache lookups for "
                           f"the repeated request ({q[0]}): caching is off; {times}",
                           FIX_CACHE, data)
        ratio = (h[1] if h else 0.0) / q[1]
        data["hit_ratio"] = round(ratio, 3)
        verdict = "PASS" if ratio >= HIT_RATIO_OK else "FAIL"
        return Finding("b", title, verdict, f"the same request sent twice: {ratio:.0%} of the "
                       f"second one's prompt tokens came from the cache ({q[0]}); {times}",
                       "" if verdict == "PASS" else FIX_CACHE, data)
    if ttft1 is None or ttft2 is None or ttft1 < TIMING_MIN_S:
        return Finding("b", title, "INFO", f"no prefix-cache counters in /metrics and the "
                       f"prefill is too short to judge by timing ({times})", data=data)
    if ttft2 <= TIMING_FASTER * ttft1:
        return Finding("b", title, "PASS", f"the same request sent twice: {times} (judged by "
                       "timing; no cache counters in /metrics)", data=data)
    if ttft2 >= TIMING_SAME * ttft1:
        return Finding("b", title, "FAIL", f"the same request sent twice was not faster the "
                       f"second time: {times} (judged by timing)", FIX_CACHE, data)
    return Finding("b", title, "WARN", f"the second identical request was only a little "
                   f"faster: {times}; inconclusive without cache counters", FIX_CACHE, data)


# --- (d) engine state ----------------------------------------------------------------------
def engine_state(start: dict | None, end: dict | None) -> list[Finding]:
    if end is None:
        return [Finding("d", "KV cache and preemptions", "SKIP", "no /metrics at this URL "
                        "(pass --metrics-url of the engine)")]
    kv, pre = pm.get(end, "kv_usage"), pm.delta(start or {}, end, "preemptions")
    waiting = pm.get(end, "waiting")
    if kv is None and pre is None:
        return [Finding("d", "KV cache and preemptions", "SKIP", "this /metrics has no engine "
                        "metrics (a gateway?); pass --metrics-url of the engine")]
    out = []
    if kv is not None:
        usage = kv[1] / 100.0 if kv[1] > 1.0 else kv[1]
        status = "WARN" if usage >= KV_HIGH else "PASS"
        out.append(Finding("d", "KV cache usage", status, f"{usage:.0%} of the KV cache in use "
                           f"({kv[0]})", "" if status == "PASS" else (
                               "give the KV cache more memory (vLLM --gpu-memory-utilization, "
                               "--kv-cache-memory), use an FP8 KV cache, lower --max-num-seqs, "
                               "or add replicas"), {"kv_usage": usage}))
    if pre is not None:
        total = pm.get(end, "preemptions")[1]
        status = "FAIL" if pre[1] > 0 else ("WARN" if total > 0 else "PASS")
        out.append(Finding("d", "preemptions", status, f"{pre[1]:g} preemptions during this "
                           f"check, {total:g} since the server started ({pre[0]})",
                           "" if status == "PASS" else (
                               "preempted requests are recomputed from scratch: give the KV "
                               "cache more room or admit fewer concurrent requests"),
                           {"during": pre[1], "total": total}))
    if waiting is not None and waiting[1] > 0:
        out.append(Finding("d", "queue", "WARN", f"{waiting[1]:g} requests waiting for a slot "
                           f"({waiting[0]})", "add capacity or admission control; a long queue "
                           "is TTFT", {"waiting": waiting[1]}))
    return out
