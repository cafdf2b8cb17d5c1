"""OpenAI-compatible HTTP server for the bundled engine: the aiohttp app, its handlers and
its lifecycle (`start_server`, `serve_forever`). The API's request and response shapes are in
backend/openai.py, the flags that build `ServerArgs` in backend/cli.py.

`/v1/chat/completions` and `/v1/completions` (prompt as text or token ids), streamed as SSE
events as tokens are sampled, or whole; `usage` in both (with `prompt_tokens_details.
cached_tokens` from the prefix cache). `/v1/models`, `/health`, `/metrics`. A client that
disconnects aborts its sequence, which frees its KV blocks.

As vLLM: the model answers to every `--served-model-name` and reports the first in responses;
a request naming another model gets vLLM's 404 (a request without `model` is served);
`/tokenize` (a prompt, or chat messages rendered with the template) and `/detokenize`.

Anthropic's Messages API, as vLLM serves it: `POST /v1/messages` (whole, or streamed as
Anthropic's events, the first with the first token) and `/v1/messages/count_tokens`; the
request becomes the chat request vLLM makes of it (common/anthropic_messages.py) and goes
through the chat path, the answer is made of the chat answer (common/anthropic_answers.py),
errors on these paths come in Anthropic's shape. With `tools` in a chat request (and
`tool_choice` not "none") the model's Hermes-format tool calls (backend/tool_calls.py) are the
answer's `tool_calls` (Messages: `tool_use` blocks); a matched stop string is the choice's
`stop_reason` (Messages: `stop_sequence`).

Extensions, as vLLM names them: `top_k`, `seed`, `stop_token_ids`, `ignore_eos`, and
`return_token_ids` (adds `prompt_token_ids` and per-choice `token_ids` to the response).

Prefill/decode disaggregation (`--role prefill|decode|both`): `kv_transfer_params` in vLLM's
KV-connector form hands a prompt's KV from a prefill engine to a decode engine (see
backend/kv_transfer.py).

Every answer carries a `Server-Timing` header (tokenize, queue, prefill, decode: see
backend/timing.py); with `--otlp-traces-endpoint` each request is also an `llm_request` span.

Warm-up (backend/warmup.py): the server listens as soon as the engine is built, and until the
warm-up has run `/health` answers 503 `{"status": "warming up"}` and the generation endpoints
answer an OpenAI-shaped 503 (code `warming_up`, `Retry-After: 1`) rather than queueing behind
it: a client or gateway can retry elsewhere at once, and no request shares the engine with the
warm-up, whose counters and cache are put back as they were. `--skip-server-warmup` (SGLang's
flag) serves at once.

`--kv-events-config` (vLLM's flag and JSON keys) publishes the prefix cache's KV events over
ZMQ in vLLM's wire format (backend/kv_events.py); the publisher closes with the server.

The cache contract: vLLM's `cache_salt` on every generation endpoint (checked as vLLM checks it)
keys the request's blocks apart from other salts' (backend/block_manager.py); Anthropic
`cache_control` breakpoints on /v1/messages and /v1/chat/completions pin the blocks of each
marked prefix for its ttl (backend/cache_pins.py), and usage reports vLLM's
`prompt_tokens_details.created_cache_tokens` (Messages: `cache_creation_input_tokens`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefixgate.backend import kv_transfer
from prefixgate.backend.async_engine import AsyncEngine, engine_thread
from prefixgate.backend.config import DEFAULT_MAX_TOKENS, ServerArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.metrics import EngineMetrics
from prefixgate.backend.openai import (
    ResponseFormat,
    body_field,
    cache_salt_of,
    chat_messages,
    check_messages_request,
    check_model,
    completion_prompt,
    json_body,
    open_final_message,
    sampling_params,
    vllm_text_content,
)
from prefixgate.backend.timing import RequestTiming
from prefixgate.backend.tool_calls import ToolCallStream, parse_tool_calls
from prefixgate.common import anthropic_answers, server_timing, tracing
from prefixgate.common.anthropic_messages import needs_system_first, to_chat
from prefixgate.common.cache_control import CacheControlError, breakpoints, prefix_of
from prefixgate.common.errors import HTTPError
from prefixgate.common.routes import add_routes
from prefixgate.common.runtime import json_errors_middleware, start_app
from prefixgate.common.schema import is_type

log = logging.getLogger("prefixgate.engine")

KV_HEADER = "x-prefixgate-kv"     # "pulled" on an answer whose prompt KV came from a prefill engine
LONG_TEXT_CHARS = 4096            # tokenize longer texts off the event loop


# --- the app ----------------------------------------------------------------------------------

class EngineServer:
    """The HTTP handlers over one engine."""

    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 served_model_names: list[str] | None = None,
                 tracer: tracing.Tracing | None = None, kv: kv_transfer.KVTransfer | None = None):
        self.engine = engine
        self.kv = kv
        self.tracer = tracer
        self.core = engine.engine
        self.engine_metrics = metrics
        # every name is answered to; the first is the one responses carry (as vLLM)
        names = served_model_names or [self.core.served_model_name]
        self.served_model_names = list(dict.fromkeys(names))
        self.model_name = self.served_model_names[0]
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self._merge_system: bool | None = None     # see merge_inline_system()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
        add_routes(app, {
            "POST /v1/chat/completions": self.chat,
            "POST /v1/completions": self.completions,
            "POST /v1/messages": self.messages,
            "POST /v1/messages/count_tokens": self.count_tokens,
            "POST /tokenize": self.tokenize,
            "POST /detokenize": self.detokenize,
            "GET /v1/models": self.models,
            "GET /health": self.health,
            "GET /metrics": self.metrics,
        })
        return app

    async def _request_body(self, request: web.Request) -> dict:
        """The JSON body, after checking its `model`."""
        body = await json_body(request)
        check_model(body, self.served_model_names)
        return body

    async def health(self, request: web.Request) -> web.Response:
        status = self.engine.status        # ok | warming up | warm-up failed
        return web.json_response({"status": status}, status=200 if status == "ok" else 503)

    def _refuse_until_ready(self) -> None:
        """Generation waits for no warm-up: a 503 now lets the client retry (or go elsewhere)."""
        if not self.engine.ready:
            raise HTTPError(503, f"the engine is not serving yet ({self.engine.status}); retry "
                                 "shortly", code="warming_up", headers={"Retry-After": "1"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "prefixgate",
            "root": self.core.args.model, "parent": None,
            "max_model_len": self.core.max_model_len}
            for name in self.served_model_names]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.engine_metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self._refuse_until_ready()
        with RequestTiming(self.tracer, request.headers) as timing:
            body = await self._request_body(request)
            salt = cache_salt_of(body)
            text = self._render_chat(body)
            ids = await self._encode(text, add_special_tokens=False)
            pins = await self._cache_pins(body, ids, lambda cut: self._render_chat(
                cut, add_generation_prompt=False))
            return await self._generate(request, body, ids, timing, chat=True,
                                        cache=(salt, pins))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API, served through the chat path as vLLM serves it: the
        request becomes the chat request vLLM makes of it (common/anthropic_messages.py), the
        chat answer the Messages answer (common/anthropic_answers.py)."""
        self._refuse_until_ready()
        with RequestTiming(self.tracer, request.headers) as timing:
            body, chat, ids = await self._messages_prompt(request, count_tokens=False)
            salt = cache_salt_of(body)
            pins = await self._cache_pins(body, ids, lambda cut: self._render_messages(
                cut, add_generation_prompt=False)[1])
            return await self._generate(request, chat, ids, timing, chat=True, anthropic=True,
                                        cache=(salt, pins))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """`/v1/messages/count_tokens`: the prompt tokens /v1/messages would compute."""
        _, _, ids = await self._messages_prompt(request, count_tokens=True)
        return web.json_response(anthropic_answers.count_tokens_answer(len(ids)))

    async def _messages_prompt(self, request: web.Request,
                               count_tokens: bool) -> tuple[dict, dict, list[int]]:
        """A Messages request's body, its chat request and its prompt token ids."""
        body = await json_body(request)
        check_messages_request(body, count_tokens)
        check_model(body, self.served_model_names)
        chat, text = self._render_messages(body)
        return body, chat, await self._encode(text, add_special_tokens=False)

    def _render_messages(self, body: dict, add_generation_prompt: bool = True) -> tuple[dict, str]:
        """A Messages body as the chat request vLLM makes of it, and that request rendered."""
        chat = to_chat(body, self.merge_inline_system())
        chat["messages"] = [vllm_text_content(m) for m in chat["messages"]]
        text = self._render_chat(chat, add_generation_prompt, template_kwargs=body_field(
            chat, "chat_template_kwargs", dict, {}))
        return chat, text

    async def _cache_pins(self, body: dict, ids: list[int], render) -> list[tuple[int, float]]:
        """The body's cache_control breakpoints as (prompt tokens, ttl seconds): the longest
        common token prefix of the prompt and the breakpoint's prefix, rendered by `render`
        as the prompt was (but with no generation prompt), floored to whole blocks. A cut the
        template cannot render alone (tools without any message) pins nothing."""
        try:
            marks = breakpoints(body)
        except CacheControlError as e:
            raise HTTPError(400, str(e), code="invalid_value") from None
        bs = self.core.args.block_size
        pins = []
        for mark in marks:
            try:
                text = render(prefix_of(body, mark))
            except HTTPError:
                continue
            cut = await self._encode(text, add_special_tokens=False)
            n = _common_prefix_len(cut, ids) // bs * bs
            if n:
                pins.append((n, mark.ttl_s))
        return pins

    def merge_inline_system(self) -> bool:
        """Whether the chat template needs the system message first, so a Messages request's
        inline system messages join the leading one (probed once, as vLLM probes it)."""
        if self._merge_system is None:
            self._merge_system = needs_system_first(self.core.tokenizer.chat_template)
            if self._merge_system:
                log.warning("the chat template needs the system message first: inline system "
                            "messages of /v1/messages requests join the leading one, which "
                            "changes the prompt's prefix each time one is added")
        return self._merge_system

    def _render_chat(self, body: dict, add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     template_kwargs: dict | None = None) -> str:
        """`messages` (and `tools`) rendered with the model's chat template."""
        messages = chat_messages(body)
        tools = body_field(body, "tools", list)
        reserved = ("messages", "tools", "add_generation_prompt", "continue_final_message")
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in reserved}
        try:
            text = self.core.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        except HTTPError:
            raise
        except Exception as e:    # the template's own raise_exception(), or a bad message shape
            raise HTTPError(400, f"chat template failed: {e}", code="invalid_value") from None
        if continue_final_message:
            text = open_final_message(text, messages[-1].get("content"))
        return text

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` (TokenizeCompletionRequest) or `messages`
        (TokenizeChatRequest)."""
        body = await self._request_body(request)
        if "messages" in body and "prompt" in body:
            raise HTTPError(400, "give either 'prompt' or 'messages', not both",
                            code="invalid_value")
        return_strs = body_field(body, "return_token_strs", bool, False)
        if "messages" in body:
            add_generation_prompt = body_field(body, "add_generation_prompt", bool, True)
            continue_final_message = body_field(body, "continue_final_message", bool, False)
            if add_generation_prompt and continue_final_message:
                raise HTTPError(400, "Cannot set both `continue_final_message` and "
                                     "`add_generation_prompt` to True.", code="invalid_value")
            text = self._render_chat(body, add_generation_prompt, continue_final_message,
                                     body_field(body, "chat_template_kwargs", dict, {}))
            add_special = body_field(body, "add_special_tokens", bool, False)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise HTTPError(400, "'prompt' must be a string (or send 'messages' to tokenize "
                                     "a chat)", code="invalid_value")
            add_special = body_field(body, "add_special_tokens", bool, True)
        ids = await self._encode(text, add_special_tokens=add_special)
        strs = None
        if return_strs:
            tok = self.core.tokenizer._tok      # the `tokenizers` object: id -> vocabulary entry
            strs = [tok.id_to_token(i) for i in ids]
        return web.json_response({"count": len(ids), "max_model_len": self.core.max_model_len,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: `tokens` -> `prompt`, special tokens kept (so /tokenize
        round-trips)."""
        body = await self._request_body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(is_type(t, int) for t in ids):
            raise HTTPError(400, "'tokens' must be a list of token ids (integers)",
                            code="invalid_value")
        tok = self.core.tokenizer
        bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise HTTPError(400, f"token id {bad} is outside the vocabulary [0, {tok.vocab_size})",
                            code="invalid_value")
        if len(ids) > LONG_TEXT_CHARS:
            text = await asyncio.to_thread(tok.decode, ids, skip_special_tokens=False)
        else:
            text = tok.decode(ids, skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._refuse_until_ready()
        with RequestTiming(self.tracer, request.headers) as timing:
            return await self._completions(request, timing)

    async def _completions(self, request: web.Request,
                           timing: RequestTiming) -> web.StreamResponse:
        body = await self._request_body(request)
        salt = cache_salt_of(body)
        prompt = completion_prompt(body, self.core.model_config.vocab_size)
        if isinstance(prompt, str):
            ids = await self._encode(prompt, add_special_tokens=True)
        else:
            ids = prompt
        return await self._generate(request, body, ids, timing, chat=False, cache=(salt, []))

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tok = self.core.tokenizer
        if len(text) > LONG_TEXT_CHARS:
            return await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens)
        return tok.encode(text, add_special_tokens=add_special_tokens)

    async def _generate(self, request, body, ids, timing: RequestTiming, chat: bool,
                        anthropic: bool = False, cache=(None, [])) -> web.StreamResponse:
        """`cache`: the request's cache_salt and cache_control pins (see _cache_pins)."""
        salt, pins = cache
        limit = self.core.max_model_len
        if len(ids) >= limit:
            raise HTTPError(400, f"This model's maximum context length is {limit} tokens, but the "
                                 f"prompt has {len(ids)} tokens (at least one must be left for the "
                                 f"completion).", code="context_length_exceeded")
        if not ids:
            raise HTTPError(400, "the prompt is empty", code="invalid_value")
        params = sampling_params(body, len(ids), limit, self.default_max_tokens)
        stream = body_field(body, "stream", bool, False)
        opts = body_field(body, "stream_options", dict, {})
        return_ids = bool(body_field(body, "return_token_ids", bool, False))
        fmt = ResponseFormat(chat, self.model_name, return_ids, ids,
                             bool(opts.get("include_usage")),
                             bool(opts.get("continuous_usage_stats")))
        turn = _Turn.of(body, params.stop, anthropic) if chat else _Turn()
        timing.describe(request.headers.get("X-Request-Id") or fmt.id, self.model_name, params)
        kv = self._kv_request(body, stream)
        hold, headers = None, {}
        if isinstance(kv, kv_transfer.RemotePrefill):       # leg 2: the prompt's KV is elsewhere
            out_stream, timing.kv_pull = await self.kv.pull(kv, ids, params, cache_salt=salt)
            headers[KV_HEADER] = "pulled"
        else:
            if kv is not None:
                await self.kv.listen()          # a `both` engine's first leg 1 opens its KV port
            hold = self.kv.new_transfer_id() if kv is not None else None    # leg 1: keep the KV
            # the engine's arrival: now
            out_stream = self.engine.generate(ids, params, kv_hold=hold, cache_salt=salt,
                                              cache_pins=pins)
        try:
            if stream:
                return await self._stream(request, out_stream, fmt, timing, headers, turn)
            return await self._whole(out_stream, fmt, timing, headers, turn, hold)
        finally:
            out_stream.close()          # aborts the sequence unless it finished
            if hold is not None:
                self.kv.settle(hold)
            if not out_stream.completed:
                self.engine_metrics.forget(out_stream.request_id)

    def _kv_request(self, body: dict, stream: bool):
        """The request's `kv_transfer_params`, checked against this engine's role (None: plain)."""
        kv = kv_transfer.parse_params(body)
        role = self.kv.role if self.kv is not None else "both"
        if isinstance(kv, kv_transfer.RemoteDecode):
            if self.kv is None or not self.kv.serves:
                raise HTTPError(400, f"this engine's role is {role}: it does not prefill for a "
                                     "remote decode ('kv_transfer_params.do_remote_decode'); send "
                                     "leg 1 to a prefill engine", code="kv_role")
            if stream:
                raise HTTPError(400, "'stream' must be false with "
                                     "'kv_transfer_params.do_remote_decode' (the answer carries "
                                     "the transfer handle)", code="invalid_value")
        elif isinstance(kv, kv_transfer.RemotePrefill) and (self.kv is None or not self.kv.pulls):
            raise HTTPError(400, f"this engine's role is {role}: it does not decode a remote "
                                 "prefill ('kv_transfer_params.do_remote_prefill'); send leg 2 to "
                                 "a decode engine", code="kv_role")
        return kv

    def _matched_stop(self, turn: _Turn, out, token_ids: list[int], sent: int) -> str | None:
        """The stop string that ended the answer (None: none did), as vLLM's `stop_reason`: the
        engine cuts the text before it, so it is where the sent text ends in the decoded ids."""
        if not turn.stop or out is None or out.finish_reason != "stop":
            return None
        text = self.core.tokenizer.decode(token_ids)
        return next((s for s in turn.stop if text.startswith(s, sent)), None)

    async def _whole(self, outputs, fmt: ResponseFormat, timing: RequestTiming, headers: dict,
                     turn: _Turn, hold: str | None = None) -> web.Response:
        text, token_ids, last = [], [], None
        async for out in outputs:
            timing.output(out)
            text.append(out.text)
            token_ids.extend(out.token_ids)
            last = out
        text = "".join(text)
        stop = self._matched_stop(turn, last, token_ids, len(text))
        content, calls = parse_tool_calls(text) if turn.tools else (text, [])
        obj = fmt.whole(content, token_ids, last, calls, turn.finish_reason(last, calls), stop)
        if hold is not None:
            obj["kv_transfer_params"] = self.kv.hand_over(hold)
            if obj["kv_transfer_params"] is None:
                raise HTTPError(500, "the engine holds no KV for this request", code="engine_error")
        if turn.anthropic:
            obj = anthropic_answers.message_of(obj)
        return web.json_response(text=json.dumps(obj),
                                 headers={server_timing.HEADER: timing.header(), **headers})

    async def _stream(self, request, outputs, fmt: ResponseFormat, timing: RequestTiming,
                      headers: dict, turn: _Turn) -> web.StreamResponse:
        resp = None
        messages = anthropic_answers.MessageStream() if turn.anthropic else None
        encode = messages.chunk if messages is not None else fmt.sse
        calls = ToolCallStream() if turn.tools else None
        token_ids, sent = [], 0         # for the stop string, when the request has some
        try:
            async for out in outputs:
                timing.output(out)
                head = b""
                if resp is None:    # headers go out with the first token, so early errors stay JSON
                    if fmt.chat:
                        head = encode(fmt.chunk(role=True))
                    resp = web.StreamResponse(headers={
                        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                        server_timing.HEADER: timing.header(), **headers})
                    await resp.prepare(request)
                if turn.stop:
                    token_ids += out.token_ids
                    sent += len(out.text)
                delta, reason, stop = None, None, None
                if calls is not None:
                    delta = self._tool_delta(calls, out)
                if out.finished:
                    reason = turn.finish_reason(out, calls.calls if calls is not None else [])
                    stop = self._matched_stop(turn, out, token_ids, sent)
                event = head + encode(fmt.chunk(out=out, delta=delta, finish_reason=reason,
                                                stop_reason=stop))
                if event:
                    await resp.write(event)
                if out.finished and fmt.include_usage:
                    await resp.write(encode(fmt.usage_chunk(out)))
        except RuntimeError as e:           # the engine failed mid-request
            if resp is None:
                raise HTTPError(500, str(e), code="engine_error") from None
            error = HTTPError(500, str(e), code="engine_error")
            if messages is not None:        # Anthropic's stream ends at its error event
                await resp.write(error.sse_event(shape="anthropic"))
                await resp.write_eof()
                return resp
            await resp.write(error.sse_event())
        await resp.write(messages.done() if messages is not None else b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _tool_delta(calls: ToolCallStream, out) -> dict:
        """`out`'s chat delta with the request's tools: text before the first call, and each
        call once it has closed."""
        before = len(calls.calls)
        text, new = calls.feed(out.text)
        if out.finished:
            tail, more = calls.finish()
            text, new = text + tail, new + more
        delta = {"content": text} if text else {}
        if new:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(new, before)]
        return delta


@dataclass
class _Turn:
    """What a chat answer is made of beyond the model's text: tool calls parsed from it when
    the request has tools (and tool_choice is not "none"), the stop string that ended it, the
    Messages API's shape."""
    tools: bool = False
    named_tool: bool = False            # tool_choice names a function: finish_reason stays "stop"
    stop: list[str] = field(default_factory=list)
    anthropic: bool = False

    @classmethod
    def of(cls, body: dict, stop: list[str], anthropic: bool) -> _Turn:
        choice = body.get("tool_choice")
        tools = isinstance(body.get("tools"), list) and bool(body["tools"]) and choice != "none"
        return cls(tools, isinstance(choice, dict), list(stop), anthropic)

    def finish_reason(self, out, calls: list[dict]) -> str | None:
        """vLLM's: "tool_calls" when the model called tools and stopped by itself."""
        if out is None:
            return None
        if calls and out.finish_reason == "stop" and not self.named_tool:
            return "tool_calls"
        return out.finish_reason


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# 404/405 from the router come out in OpenAI's shape too; a client that hung up is not an error
_errors = json_errors_middleware(passthrough=(ConnectionResetError,),
                                 internal_message=lambda e: f"internal error: {e}", logger=log)


# --- starting it -----------------------------------------------------------------------------

@dataclass
class RunningServer:
    runner: web.AppRunner
    url: str
    engine: AsyncEngine
    metrics: EngineMetrics
    tracer: tracing.Tracing | None = None
    kv: kv_transfer.KVTransfer | None = None

    async def close(self) -> None:
        await self.runner.cleanup()
        if self.kv is not None:
            await self.kv.close()
        await self.engine.stop()
        # the tier's stores end, KV events close
        await asyncio.to_thread(self.engine.engine.close)
        if self.tracer is not None:         # flushes queued spans (bounded), off the loop
            await asyncio.to_thread(self.tracer.close)


async def start_server(args: ServerArgs | None = None, *, host: str | None = None,
                       port: int | None = None, engine: LLMEngine | None = None,
                       wait_for_warmup: bool = True) -> RunningServer:
    """Build the engine (unless given) and serve it in this event loop; `host` and `port`
    override `args`' (port 0 picks a free one; `args.listen_fd`: serve on that socket).
    Returns once the warm-up has run (WarmupError if it failed), or with
    `wait_for_warmup=False` as soon as it listens (`server.engine.wait_ready()` then waits)."""
    args = args or ServerArgs()
    host = host or args.host
    sock = listener(args.listen_fd)         # a bad --listen-fd fails before the model loads
    thread = engine_thread()                # builds it too: one OpenMP team (async_engine.py)
    try:
        core = engine or await asyncio.get_running_loop().run_in_executor(thread, LLMEngine,
                                                                          args.engine)
    except BaseException:
        thread.shutdown(wait=False)
        raise
    async_engine = AsyncEngine(core, warm_up=args.warm_up, thread=thread)
    kv = kv_transfer.KVTransfer(async_engine, host)
    metrics = EngineMetrics(core, kv.stats)
    async_engine.on_step = lambda outs: metrics.observe(outs, time.monotonic())
    server = EngineServer(async_engine, metrics, args.default_max_tokens, args.served_model_names,
                          kv=kv)
    await kv.start()
    # start_app cancels the handler of a client that hangs up, which aborts its sequence
    try:
        runner, url = await start_app(server.app(), host, args.port if port is None else port,
                                      sock=sock)
    except BaseException:
        await kv.close()
        if engine is None:          # ours: let its tier and KV event sockets go
            await asyncio.to_thread(core.close)
        thread.shutdown(wait=False)
        raise
    tracer = server.tracer = tracing.Tracing(args.tracing) if args.tracing else None
    async_engine.start()            # the warm-up first, then the step loop
    running = RunningServer(runner, url, async_engine, metrics, tracer, kv)
    if wait_for_warmup:
        try:
            await async_engine.wait_ready()
        except BaseException:
            await running.close()
            raise
    return running


def listener(fd: int | None) -> socket.socket | None:
    """The listening socket a launcher handed down as file descriptor `fd` (--listen-fd)."""
    if fd is None:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise OSError(f"--listen-fd {fd}: not an open socket ({e.strerror})") from None
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0:
        sock.detach()
        raise OSError(f"--listen-fd {fd}: the socket is not listening")
    return sock


async def serve_forever(args: ServerArgs) -> None:
    """`prefixgate backend`: serve until SIGTERM or SIGINT."""
    server = await start_server(args, wait_for_warmup=False)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):   # not on this platform: Ctrl-C still works
            pass
    try:
        if server.engine.warm_up:
            log.info("listening at %s; /health answers 503 until the warm-up has run", server.url)
        # a signal meanwhile is acted on once the warm-up thread is done (it cannot be interrupted)
        await server.engine.wait_ready()
        name = server.engine.engine.served_model_name
        print(f"prefixgate engine: serving {name} at {server.url}", flush=True)
        await stop.wait()
    finally:
        await server.close()
