"""A stand-in OpenAI-compatible upstream that streams SSE like vLLM.

Its answers have vLLM 0.32's shape, checked against the real server (tests/vllm): compact
JSON; streams labelled `text/event-stream; charset=utf-8`, chat's opening with the
assistant's role and an empty content, the finish reason on the last token's event, and the
usage in an event of its own only when `stream_options.include_usage` asks for it.

Used by the tests, the benchmarks and `prefixgate doctor`'s self-check. Besides chat and
completions it serves Anthropic's Messages API as vLLM does (`/v1/messages`, whole and
streamed, and `/v1/messages/count_tokens`: the request converted to chat by
common/anthropic_messages.py, the chat answer converted back; its prompt is the chat
conversion's, for the prefix-cache model too, and what it received is recorded with that
conversion as `chat`), the rest of vLLM's OpenAI-compatible surface (embeddings, the Responses
API, rerank, score, tokenize, audio uploads ...: proxy/testing/surface.py) and SGLang's
/generate. With `models` or `lora` set it serves only those ids, listed in /v1/models as vLLM
lists them (adapters with their `parent`), and answers others with vLLM's 404. It records what it
received, counts TCP connections and aborted streams, and can be slowed down or made to
misbehave. Per-request behaviour can be overridden with a vendor field in the request body,
`"x_standin": {"gap": 0.3, ...}` (which also proves that unknown fields pass through).
With `prefix_cache` set it also models prefill: `prefill_per_token` seconds per prompt token
(4 characters) that its block-chained prefix cache does not hold (none, when False), and
vLLM's prefix-cache counters in /metrics; `prefixgate doctor` and the bench tests use it;
a request's `cache_salt` is folded into its first block, as vLLM folds it. `refused_fields`
makes it a server that answers a field it does not take with a 400.
With `serial_prefill` its prefills (`first_delay` and the per-token time) run one at a time
in arrival order, as an engine's do, the others counted as waiting in /metrics: a busy
stand-in answers later, as a busy engine does.

    python -m prefixgate.proxy.testing.standin --port 8001 --tokens 16 --gap 0.01
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field, fields, replace

from aiohttp import web
from multidict import CIMultiDict

from prefixgate.common.anthropic_answers import MessageStream, count_tokens_answer, message_of
from prefixgate.common.anthropic_messages import to_chat
from prefixgate.common.runtime import install_uvloop, start_app
from prefixgate.proxy.testing.surface import (
    EVENT_STREAM,
    Surface,
    answer_model,
    anthropic_error,
    base_models,
    compact,
    json_response,
    messages_invalid,
    model_cards,
    model_not_found,
    not_served,
    paced_tokens,
    was_reset,
)


@dataclass
class Behaviour:
    tokens: int = 8              # content events per streamed response
    first_delay: float = 0.0     # seconds before the first event (prefill)
    gap: float = 0.0             # seconds between events (decode)
    model: str = "standin-model"
    fail: str = ""               # "", "reset_after" (close mid-stream), "hang", "garbage", "status"
    fail_after: int = 2          # events sent before "reset_after" closes the connection
    status: int = 500            # status for fail="status"
    record: bool = True          # keep request bodies (off for long benchmarks)
    # opt-in prefill model: None = off (no extra delay, no cache counters); True/False = a
    # backend with/without a prefix cache, exposing vLLM's prefix-cache counters
    prefix_cache: bool | None = None
    prefill_per_token: float = 0.0   # seconds per uncached prompt token, added to first_delay
    # the model ids served (None: just `model`, and any requested model is answered); set (or
    # `lora` set), /v1/models lists them and a request naming another one gets vLLM's 404.
    # Both are read per request, so a test may change them while the stand-in runs.
    models: list[str] | None = None
    lora: dict[str, str] = field(default_factory=dict)   # LoRA adapter id -> its base model id
    kv_usage: float = 0.0        # vllm:kv_cache_usage_perc its /metrics reports
    metrics_delay: float = 0.0   # seconds before /metrics answers (a starved API process)
    serial_prefill: bool = False     # prefills one at a time, in arrival order (a queue)
    # body fields it answers with a 400, as a server whose request model forbids extra fields
    # (one that does not take vLLM's cache_salt, say)
    refused_fields: list[str] = field(default_factory=list)


@dataclass
class StandIn(Surface):
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list = field(default_factory=list)
    connections: int = 0
    aborted: int = 0
    completed: int = 0
    running: int = 0
    waiting: int = 0             # requests waiting for their turn to prefill (serial_prefill)
    url: str = ""
    cache: PrefixCacheModel = field(default_factory=lambda: PrefixCacheModel())
    responses: dict = field(default_factory=dict)     # Responses API: id -> response (in memory)
    _background: dict = field(default_factory=dict)   # id -> task of a `background` response
    _peers: set = field(default_factory=set)      # client (host, port): one per connection
    _prefill_turn: asyncio.Lock = field(default_factory=asyncio.Lock)   # FIFO (serial_prefill)
    _runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        self.add_surface(app)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> StandIn:
        self._runner, self.url = await start_app(self.app(), host, port)
        return self

    async def stop(self) -> None:
        for task in list(self._background.values()):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    def _count_connection(self, request: web.Request) -> None:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer not in self._peers:
            self._peers.add(peer)
            self.connections += 1

    def _behaviour(self, body: dict | None) -> Behaviour:
        """The behaviour for one request: the stand-in's, with the body's `x_standin`."""
        overrides = (body or {}).get("x_standin") or {}
        if not isinstance(overrides, dict):
            return self.behaviour
        known = {f.name for f in fields(Behaviour)}
        return replace(self.behaviour, **{k: v for k, v in overrides.items() if k in known})

    def _record(self, request: web.Request, body, b: Behaviour, **extra) -> None:
        if b.record:
            self.requests.append({"path": request.path, "json": body,
                                  "headers": CIMultiDict(request.headers), "t": time.monotonic(),
                                  **extra})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        self._count_connection(request)
        body = await request.json()
        b = self._behaviour(body)
        self._record(request, body, b)
        if (err := model_not_found(b, body.get("model"))) is not None:
            return err
        if refused := _refused(b, body):
            return json_response({"error": {"message": refused, "type": "BadRequestError",
                                            "code": 400}}, status=400)
        b = replace(b, model=answer_model(b, body.get("model")))
        if b.fail == "status":
            return json_response({"error": {"message": "stand-in failure", "type":
                                                "server_error", "code": None}}, status=b.status)
        if b.fail == "hang":
            await asyncio.sleep(3600)
        if b.fail == "garbage":
            return web.Response(body=b"\x00not json at all", content_type="text/plain")
        b, cached = await self._prefill(b, body)
        usage = _usage(body, b.tokens, cached)
        self.running += 1
        try:
            if body.get("stream"):
                return await self._stream(request, body, b, usage)
            await asyncio.sleep(b.first_delay + b.gap * max(b.tokens - 1, 0))
            return json_response(self._whole(request.path, body, b, usage))
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.running -= 1

    # --- Anthropic's Messages API -------------------------------------------------------------
    async def _messages_request(self, request: web.Request, counting: bool):
        """(body, its chat conversion, behaviour) after counting and recording (the chat
        request as `chat`), or (None, None, the Anthropic-shaped error to answer)."""
        self._count_connection(request)
        try:
            body = await request.json()
        except ValueError:
            body = None
        b = self._behaviour(body if isinstance(body, dict) else None)
        chat = to_chat(body) if isinstance(body, dict) else None
        self._record(request, body, b, chat=chat)
        if (err := messages_invalid(body, counting)) is not None:
            return None, None, err
        if (message := not_served(b, body.get("model"))) is not None:
            return None, None, anthropic_error(message, 404, "NotFoundError")
        if refused := _refused(b, body):
            return None, None, anthropic_error(refused, 400, "BadRequestError")
        if b.fail == "status":
            return None, None, anthropic_error("stand-in failure", b.status,
                                               SERVER_ERRORS.get(b.status, "InternalServerError"))
        if b.fail == "hang":
            await asyncio.sleep(3600)
        return body, chat, replace(b, model=answer_model(b, body.get("model")))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages as vLLM serves it: the request converted to chat (its prompt,
        what the prefix-cache model sees), the chat answer converted back, whole or streamed
        (common/anthropic_answers.py); min(tokens, max_tokens) tokens, `max_tokens` the stop reason
        when they reach it, else `end_turn`."""
        body, chat, b = await self._messages_request(request, counting=False)
        if body is None:
            return b
        if b.fail == "garbage":
            return web.Response(body=b"\x00not json at all", content_type="text/plain")
        tokens = max(0, min(b.tokens, body["max_tokens"]))
        finish = "length" if tokens >= body["max_tokens"] else "stop"
        b, cached = await self._prefill(replace(b, tokens=tokens), chat)
        usage = _usage(chat, tokens, cached)
        self.running += 1
        try:
            if body.get("stream"):
                return await self._stream_message(request, b, usage, finish)
            await asyncio.sleep(b.first_delay + b.gap * max(tokens - 1, 0))
            self.completed += 1
            return json_response(message_of({
                "id": MESSAGE_ID, "model": b.model, "usage": usage, "choices": [
                    {"index": 0, "finish_reason": finish,
                     "message": {"role": "assistant", "content": _text(tokens)}}]}))
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.running -= 1

    async def _stream_message(self, request, b: Behaviour, usage: dict,
                              finish: str) -> web.StreamResponse:
        if b.fail == "reset_after" and b.fail_after == 0:
            request.transport.close()
            return web.Response()
        return await self._write_stream(request, b, message_writes(b.model, b.tokens, usage,
                                                                    finish))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/messages/count_tokens: the prompt's tokens as the chat request vLLM makes
        of it (counted as the prefix-cache model counts them)."""
        body, chat, b = await self._messages_request(request, counting=True)
        if body is None:
            return b
        return json_response(count_tokens_answer(_prompt_len(chat)))

    async def _prefill(self, b: Behaviour, prompt_body: dict) -> tuple[Behaviour, int | None]:
        """The modelled prefill of `prompt_body`'s prompt: its prefix-cache lookup (the uncached
        tokens' time added to the first delay) and, with `serial_prefill`, its turn; (the
        behaviour with the delay still to take, the cached tokens or None)."""
        cached = None
        if b.prefix_cache is not None:
            uncached, cached = self.cache.lookup(_prompt_text(prompt_body), use=b.prefix_cache,
                                                 salt=prompt_body.get("cache_salt"))
            b = replace(b, first_delay=b.first_delay + b.prefill_per_token * uncached)
        if b.serial_prefill:
            await self._prefill_in_turn(b.first_delay)
            b = replace(b, first_delay=0.0)
        return b, cached

    async def _prefill_in_turn(self, seconds: float) -> None:
        """Wait for the prefills that came before, then take `seconds` for this one."""
        self.waiting += 1
        turn = False
        try:
            async with self._prefill_turn:
                self.waiting -= 1
                turn = True
                await asyncio.sleep(seconds)
        finally:
            if not turn:               # cancelled (the client left) while it waited
                self.waiting -= 1

    async def _stream(self, request, body, b: Behaviour, usage: dict) -> web.StreamResponse:
        if b.fail == "reset_after" and b.fail_after == 0:
            request.transport.close()          # reset before any byte of the response
            return web.Response()
        chat = request.path.endswith("chat/completions")
        return await self._write_stream(request, b, stream_writes(body, chat, b.model, b.tokens,
                                                                  usage))

    async def _write_stream(self, request, b: Behaviour, writes: list[bytes]):
        """One write per token as the behaviour paces them, the last write after them."""
        resp = web.StreamResponse(headers={"Content-Type": EVENT_STREAM})
        await resp.prepare(request)
        async for i in paced_tokens(b, request):
            await resp.write(writes[i])
        if was_reset(request):
            return resp
        await resp.write(writes[-1])
        await resp.write_eof()
        self.completed += 1
        return resp

    def _whole(self, path, body, b: Behaviour, usage: dict) -> dict:
        text = "".join(f"tok{i} " for i in range(b.tokens))
        self.completed += 1
        if path.endswith("chat/completions"):
            return {"id": "chatcmpl-standin", "object": "chat.completion", "model": b.model,
                    "created": int(time.time()), "usage": usage,
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": text}}]}
        return {"id": "cmpl-standin", "object": "text_completion", "model": b.model,
                "created": int(time.time()), "usage": usage,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}

    async def models(self, request):
        return json_response({"object": "list", "data": model_cards(self.behaviour)})

    async def health(self, request):
        return web.Response(text="ok")

    async def metrics(self, request):
        b = self.behaviour
        if b.metrics_delay:
            await asyncio.sleep(b.metrics_delay)
        return web.Response(text=metrics_page(base_models(b)[0], self.running, b.kv_usage,
                                              self.cache if b.prefix_cache is not None else None,
                                              self.waiting))


def metrics_page(model: str, running: int, kv_usage: float,
                 cache: PrefixCacheModel | None, waiting: int = 0) -> str:
    """vLLM's /metrics, the part the gateway reads: gauges and counters labelled by engine and
    served model, with their HELP and TYPE lines (and the per-reason waiting gauge whose name
    begins like the total's)."""
    labels = f'engine="0",model_name="{model}"'

    def family(name: str, kind: str, what: str, samples: list[tuple[str, str, float]]) -> str:
        lines = [f"# HELP {name} {what}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{suffix}{{{labels}{extra}}} {float(value)}"
                  for suffix, extra, value in samples]
        return "\n".join(lines) + "\n"
    page = [family("vllm:num_requests_running", "gauge",
                   "Number of requests in model execution batches.", [("", "", running)]),
            family("vllm:num_requests_waiting", "gauge",
                   "Number of requests waiting to be processed.", [("", "", waiting)]),
            family("vllm:num_requests_waiting_by_reason", "gauge",
                   "Number of requests waiting, by the reason they wait.",
                   [("", f',reason="{r}"', 0) for r in ("capacity", "deferred")]),
            family("vllm:kv_cache_usage_perc", "gauge",
                   "KV-cache usage. 1 means 100 percent usage.", [("", "", kv_usage)])]
    if cache is not None:
        page += [family("vllm:prefix_cache_queries", "counter",
                        "Prefix cache queries, in terms of number of queried tokens.",
                        [("_total", "", cache.queries)]),
                 family("vllm:prefix_cache_hits", "counter",
                        "Prefix cache hits, in terms of number of cached tokens.",
                        [("_total", "", cache.hits)])]
    return "".join(page)


@dataclass
class PrefixCacheModel:
    """Prompt prefixes remembered in blocks of 16 'tokens' (4 characters each), chained like
    vLLM's block hashes: a block hits only when every block before it hit too."""
    block_chars: int = 64
    queries: int = 0             # prompt tokens looked up
    hits: int = 0                # ... and found
    _seen: set = field(default_factory=set)

    def lookup(self, text: str, use: bool, salt: str | None = None) -> tuple[int, int]:
        """Count the lookup, remember the blocks; return the prompt tokens left to compute
        and those found cached. A `salt` (vLLM's cache_salt) is folded into the first block,
        as vLLM folds it: prompts share blocks only under equal salts."""
        tokens = max(1, len(text) // 4)
        self.queries += tokens
        hit_chars, parent, hitting = 0, hash(("cache_salt", salt)) if salt else 0, use
        for start in range(0, len(text) - self.block_chars + 1, self.block_chars):
            parent = hash((parent, text[start:start + self.block_chars]))
            if hitting and parent in self._seen:
                hit_chars += self.block_chars
            else:
                hitting = False
            if use:
                self._seen.add(parent)
        hit = min(hit_chars // 4, tokens - 1)    # the last token is always computed
        self.hits += hit
        return tokens - hit, hit


def _usage(body: dict, completion_tokens: int, cached: int | None) -> dict:
    """The usage block; with a modelled prefix cache also its hits, as vLLM reports them."""
    prompt = _prompt_len(body)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
             "total_tokens": prompt + completion_tokens}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def stream_writes(body: dict, chat: bool, model: str, tokens: int, usage: dict) -> list[bytes]:
    """A streamed answer as the stand-in writes it, shaped like vLLM's: one write per token
    (chat's first also carries the opening role event; the last token's event carries the
    finish reason), then the tail: a finish event if there was no token, the usage in an
    event of its own only when `stream_options.include_usage` asks, and [DONE]."""
    rid = "cmpl-standin"          # fixed, so proxied and direct streams compare byte for byte
    writes = []
    for i in range(tokens):
        events = [_chunk(rid, chat, model, role=True)] if chat and i == 0 else []
        events.append(_chunk(rid, chat, model, f"tok{i} ", "length" if i == tokens - 1 else None))
        writes.append(b"".join(map(_event, events)))
    tail = [_chunk(rid, chat, model, "", "length", role=chat)] if tokens == 0 else []
    if (body.get("stream_options") or {}).get("include_usage"):
        tail.append({"id": rid, "object": _chunk_object(chat), "created": 0, "model": model,
                     "choices": [], "usage": usage})
    writes.append(b"".join(map(_event, tail)) + b"data: [DONE]\n\n")
    return writes


MESSAGE_ID = "chatcmpl-standin"     # vLLM's message id is its chat request's
# a failing vLLM's error types (serve/exception_handling/error_response.py: GenerationError)
SERVER_ERRORS = {500: "InternalServerError", 503: "ServiceUnavailableError"}


def message_writes(model: str, tokens: int, usage: dict, finish: str = "length") -> list[bytes]:
    """A streamed Messages answer as the stand-in writes it: the chat chunks vLLM makes for
    the converted request (the role's with the prompt's usage, one per token, the usage
    chunk, [DONE]) through the Anthropic converter, one write per token — the first with
    `message_start` and the text block's start (vLLM sends its role chunk with the first
    token) — then the tail: the block's end, `message_delta`, `message_stop`."""
    events = MessageStream()
    chunk = {"id": MESSAGE_ID, "object": "chat.completion.chunk", "created": 0, "model": model}
    head = events.chunk({**chunk, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": 0,
                  "total_tokens": usage["prompt_tokens"]}})
    writes = []
    for i in range(tokens):
        writes.append((head if i == 0 else b"") + events.chunk({**chunk, "choices": [
            {"index": 0, "delta": {"content": f"tok{i} "},
             "finish_reason": finish if i == tokens - 1 else None}]}))
    tail = (b"" if tokens else head) + events.chunk({**chunk, "choices": [], "usage": usage})
    writes.append(tail + events.done())
    return writes


def streamed_bytes(body: dict, tokens: int, model: str, chat: bool = True) -> bytes:
    """Every byte of the stand-in's streamed answer to `body` (without a modelled prefix
    cache), for checkers that compare what a client received."""
    usage = _usage(body, tokens, None)
    return b"".join(stream_writes(body, chat, model, tokens, usage))


def _chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def _chunk(rid: str, chat: bool, model: str, text: str = "", finish: str | None = None,
           role: bool = False) -> dict:
    """One streamed event's JSON; for chat, `role` makes it the opening one (the assistant
    role and an empty content, as vLLM sends before the first token)."""
    if chat:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": _chunk_object(chat), "created": 0, "model": model,
            "choices": [choice]}


def _event(data: dict) -> bytes:
    return f"data: {compact(data)}\n\n".encode()


def _refused(b: Behaviour, body: dict) -> str | None:
    """The message of a 400 for the fields of `body` this stand-in refuses (None: none)."""
    extra = sorted(f for f in b.refused_fields if f in body)
    return f"Extra inputs are not permitted: {', '.join(extra)}" if extra else None


def _prompt_text(body: dict) -> str:
    """A chat or completions request's prompt as the prefix-cache model reads it (a Messages
    request's: its chat conversion's); an assistant's tool calls count as their JSON."""
    if "messages" in body:     # tools first: chat templates put them in the system turn
        return json.dumps(body.get("tools") or "") + "".join(
            f"{m.get('role')}\n{m.get('content')}\n"
            + (json.dumps(m["tool_calls"]) + "\n" if m.get("tool_calls") else "")
            for m in body["messages"] if isinstance(m, dict))
    return str(body.get("prompt", ""))


def _text(tokens: int) -> str:
    return "".join(f"tok{i} " for i in range(tokens))


def _prompt_len(body: dict) -> int:
    """A rough prompt length in 'tokens' (4 characters each), as the prefix-cache model counts."""
    return max(1, len(_prompt_text(body)) // 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.proxy.testing.standin",
                                description="Stand-in OpenAI-compatible SSE upstream")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--first-delay", type=float, default=0.0)
    p.add_argument("--gap", type=float, default=0.0)
    p.add_argument("--no-record", action="store_true", help="don't keep request bodies")
    args = p.parse_args(argv)
    standin = StandIn(Behaviour(tokens=args.tokens, first_delay=args.first_delay, gap=args.gap,
                                record=not args.no_record))
    install_uvloop()
    web.run_app(standin.app(), host=args.host, port=args.port, access_log=None,
                handler_cancellation=True, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
