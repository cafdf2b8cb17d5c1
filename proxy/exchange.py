"""One attempt to one upstream: the request it sends, its first-byte timeout, its health
outcome and its accounting (DESIGN.md §2). The plain path and every P/D leg go through it:

    with Attempt(gw, ctx, up) as attempt:
        first = await attempt.send(method, data, read="first")
        ...                      # read attempt.resp on; attempt.broken(why) if it breaks

From entering the block to leaving it an attempt owns the upstream's in-flight count, its
CLIENT span (and the `traceparent` the upstream gets), the headers sent upstream, the wait
for the answer, the TTFT breakdown's connect and upstream time, and the upstream's response,
closed on the way out (unfinished: the connection is dropped, so the backend stops). Its
health outcome is classified once — the connection failed, the answer was bad (with why), or
it was good — and told to Health when the attempt ends.

`may_retry` is the one rule for trying another upstream after one failed.
"""
from __future__ import annotations

import asyncio
import time

from prefixgate.common.errors import HTTPError
from prefixgate.proxy import route
from prefixgate.proxy.observe import breakdown
from prefixgate.proxy.upstream import h1pool

# Connection-scoped headers (RFC 9110 §7.6.1) plus ones the gateway recomputes itself.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding",
    "expect",      # 100-continue is between the client and us; the body is already coming
})
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})   # replaced when the gateway traces
CLIENT_KEY_HEADERS = frozenset({"authorization", "x-api-key"})   # a gateway key's headers
# answers worth another upstream when no byte has reached the client yet (nginx's default set)
RETRY_STATUSES = frozenset({502, 503, 504})
FIRST_BYTE_TIMEOUT = "first-byte timeout"


class UpstreamFailed(Exception):
    """The upstream failed before any byte reached the client: safe to try another one."""


def may_retry(gw, ctx, tried: list, roles: frozenset = route.SERVING) -> bool:
    """May another upstream of `roles` take this request, now that those in `tried` failed
    it? Only while no more than `retries` attempts failed, the endpoint's body can be sent
    again, the client has no byte yet, and a healthy upstream of `roles` that serves the
    request's model has not been tried."""
    if len(tried) > gw.retries or not ctx.endpoint.replayable or ctx.client_has_bytes:
        return False
    model = ctx.model
    return any(u.healthy and u.role in roles and u not in tried
               and (model is None or u.serves(model)) for u in gw.upstreams)


class Attempt:
    """One request to one upstream, from its headers to its closed response (module doc).

    `path`: the path sent (default: the request's target). `in_line`: the client's answer
    waits on this attempt (the plain path, a decode leg, vLLM's prefill leg), so it is
    stamped `upstream_sent` and its time goes into the request's TTFT breakdown.
    """
    __slots__ = ("gw", "ctx", "up", "path", "in_line", "resp", "span", "failure", "problem",
                 "connect_failed")

    def __init__(self, gw, ctx, up, path: str | None = None, in_line: bool = True):
        self.gw, self.ctx, self.up = gw, ctx, up
        self.path = path if path is not None else ctx.target
        self.in_line = in_line
        self.resp: h1pool.Response | None = None
        self.span = None
        self.failure: str | None = None     # given up without an answer (the span's error)
        self.problem: str | None = None     # why the upstream did badly (Health's reason)
        self.connect_failed = False         # no connection could be opened at all

    def __enter__(self) -> Attempt:
        observer = self.gw.observer
        if observer is not None:
            self.span = observer.attempt(self.ctx)
        self.up.inflight += 1
        return self

    def __exit__(self, *exc_info) -> None:
        up, resp = self.up, self.resp
        up.inflight -= 1
        if resp is not None:
            resp.close()
        health = self.gw.health
        if self.connect_failed:
            health.connect_failed(up, self.failure)
        elif self.problem is not None:
            health.bad_answer(up, self.problem)
        elif resp is not None:
            health.good_answer(up)
        if self.span is not None:
            self.gw.observer.attempt_done(self.ctx, self.span, up, self.path, resp,
                                          self.failure)

    async def send(self, method: str, data, length: int | None = None,
                   read: str = "head") -> bytes:
        """Send the request (`length`: a streamed upload's) and wait, within the upstream's
        first-byte timeout, for the answer's head and `read` of its body: nothing ("head"),
        its first chunk ("first": a stream's first event) or all of it ("all": a prefill
        leg, which answers once its first token is out). `attempt.resp` is the answer.

        No answer: UpstreamFailed (the connection failed or broke: another upstream may
        take the request), or HTTPError 504 once the timeout passed (not tried elsewhere:
        the upstream may be busy with it still).
        """
        ctx, up = self.ctx, self.up
        started = ctx.stamp("upstream_sent") if self.in_line else time.monotonic()
        try:
            async with asyncio.timeout(up.timeouts["first_byte"]):
                self.resp = resp = await up.pool.request(method, self.path, self.headers(),
                                                         data, length=length)
                body = (await resp.read() if read == "first"
                        else await resp.read_all() if read == "all" else b"")
        except TimeoutError:
            self.failure = self.problem = FIRST_BYTE_TIMEOUT
            raise HTTPError(504, f"upstream {up.name} sent no response within "
                            f"{up.timeouts['first_byte']}s", code="upstream_timeout") from None
        except h1pool.UpstreamError as e:
            self.failure = self.problem = str(e)
            self.connect_failed = e.connect
            raise UpstreamFailed(self.failure) from None
        finally:
            if self.in_line:
                breakdown.account_attempt(ctx, started, self.resp, self.connect_failed)
        if resp.status >= 500:
            self.problem = f"HTTP {resp.status}"
        return body

    def broken(self, why: str) -> None:
        """The answer went bad after its head (cut off, stalled, not what was asked for)."""
        self.problem = why

    def give_up(self) -> UpstreamFailed:
        """Leave this answer unrelayed (a 5xx another upstream may do better than): the
        exception that hands the request on."""
        self.failure = self.problem
        return UpstreamFailed(self.failure)

    def headers(self) -> list[tuple[str, str]]:
        """The client's headers as the upstream gets them: without hop-by-hop ones and those
        the gateway sets itself (the trace context while it traces, a gateway key unless
        `auth` forwards it), then the gateway's own, the upstream's and the key's."""
        ctx, up = self.ctx, self.up
        replaced = up.replaced_headers                # set below, or by the upstream's config
        if self.span is not None:                     # the gateway's span is the parent now
            replaced = replaced | TRACE_HEADERS
        key = ctx.key
        if not self.gw.auth.forward:       # a key for the gateway is not one for the backend
            replaced = replaced | CLIENT_KEY_HEADERS
        if key is not None and key.upstream_headers:
            replaced = replaced | key.replaced
        headers = [(k, v) for k, v in ctx.headers.items()
                   if k.lower() not in HOP_BY_HOP and k.lower() not in replaced]
        headers += [("Accept-Encoding", "identity"),  # never let a stream be compressed
                    ("X-Request-Id", ctx.request_id)]
        kind = ctx.endpoint.body
        if kind == "json" or (kind == "raw" and ctx.body_changed):
            headers.append(("Content-Type", "application/json"))
        elif kind != "none":          # multipart (its boundary) or a passthrough body
            headers.append(("Content-Type", ctx.headers.get("Content-Type",
                                                            "application/octet-stream")))
        headers += up.extra_headers.items()
        if key is not None:
            headers += key.upstream_headers.items()
        if self.span is not None:
            headers += self.span.headers
        return headers
