"""OpenAI-compatible HTTP server for the bundled engine.

`/v1/chat/completions` and `/v1/completions` (prompt as text or token ids), streamed as SSE
events as tokens are sampled, or whole; `usage` in both (with `prompt_tokens_details.
cached_tokens` from the prefix cache). `/v1/models`, `/health`, `/metrics`. A client that
disconnects aborts its sequence, which frees its KV blocks.

As vLLM: the model answers to every `--served-model-name` and reports the first in responses;
a request naming another model gets vLLM's 404 (a request without `model` is served);
`/tokenize` (a prompt, or chat messages rendered with the template) and `/detokenize`.

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
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefixgate.backend import kv_transfer
from prefixgate.backend.engine import AsyncEngine, EngineArgs, LLMEngine
from prefixgate.backend.kv_events import KVEventsConfig, KVEventsConfigError, parse_kv_events_config
from prefixgate.backend.loader import LOAD_FORMATS, WeightError
from prefixgate.backend.metrics import EngineMetrics
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.spec_decode import SpecConfigError, SpeculativeConfig, parse_speculative_config
from prefixgate.backend.timing import RequestTiming
from prefixgate.backend.warmup import WarmupError
from prefixgate.common import server_timing
from prefixgate.common import tracing
from prefixgate.common.errors import HTTPError
from prefixgate.common.runtime import json_errors_middleware, parse_json_object, run_on_uvloop, start_app

log = logging.getLogger("prefixgate.engine")

DEFAULT_MAX_TOKENS = 256
KV_HEADER = "x-prefixgate-kv"     # "pulled" on an answer whose prompt KV came from a prefill engine
LONG_TEXT_CHARS = 4096            # tokenize longer texts off the event loop


# --- request parsing --------------------------------------------------------------------------

def _field(body: dict, name: str, types, default=None, check=None, what=None):
    """A typed, optional request field; bad values raise a 400 that names the field."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in _as_tuple(types))
    if not ok or (check is not None and not check(value)):
        raise HTTPError(400, f"'{name}' must be {what or _type_names(types)}, got {json.dumps(value)[:80]}",
                        code="invalid_value")
    return value


def _as_tuple(types):
    return types if isinstance(types, tuple) else (types,)


def _type_names(types) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
             list: "a list", dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in _as_tuple(types))


def sampling_params(body: dict, prompt_len: int, max_model_len: int, default_max_tokens: int) -> SamplingParams:
    if _field(body, "n", int, 1) != 1:
        raise HTTPError(400, "'n' other than 1 is not supported", code="unsupported_value")
    for flag in ("logprobs", "echo"):
        if body.get(flag) not in (None, False, 0):
            raise HTTPError(400, f"'{flag}' is not supported by the bundled engine", code="unsupported_value")
    room = max_model_len - prompt_len
    max_tokens = _field(body, "max_completion_tokens", int, None, lambda v: v >= 1, "a positive integer")
    max_tokens = _field(body, "max_tokens", int, max_tokens, lambda v: v >= 1, "a positive integer")
    stop = _field(body, "stop", (str, list), [], lambda v: isinstance(v, str) or all(
        isinstance(s, str) and s for s in v), "a string or a list of non-empty strings")
    return SamplingParams(
        max_tokens=min(max_tokens or default_max_tokens, room),
        temperature=float(_field(body, "temperature", (int, float), 1.0, lambda v: v >= 0, "a number >= 0")),
        top_p=float(_field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=_field(body, "top_k", int, 0, lambda v: v >= -1, "-1, 0 or a positive integer"),
        seed=_field(body, "seed", int, None, lambda v: -2**63 <= v < 2**64, "a 64-bit integer"),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=_field(body, "stop_token_ids", list, [], lambda v: all(
            isinstance(t, int) and not isinstance(t, bool) for t in v), "a list of integers"),
        ignore_eos=_field(body, "ignore_eos", bool, False),
    )


class ModelNotFound(HTTPError):
    """A request for a model this server does not serve: vLLM's 404, `param` included."""

    def __init__(self, name: str):
        super().__init__(404, f"The model `{name}` does not exist.", code=404, type="NotFoundError")

    def payload(self) -> dict:
        out = super().payload()
        out["error"]["param"] = "model"
        return out


# --- the app ----------------------------------------------------------------------------------

class EngineServer:
    """The HTTP handlers over one engine."""

    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 served_model_names: list[str] | None = None, tracer: tracing.Tracing | None = None,
                 kv: kv_transfer.KVTransfer | None = None):
        self.engine = engine
        self.kv = kv
        self.tracer = tracer
        self.core = engine.engine
        self.engine_metrics = metrics
        # every name is answered to; the first is the one responses carry (as vLLM)
        self.served_model_names = list(dict.fromkeys(served_model_names or [self.core.served_model_name]))
        self.model_name = self.served_model_names[0]
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def _request_body(self, request: web.Request) -> dict:
        """The JSON body, after checking its `model` (absent or empty: the default, as vLLM)."""
        body = await _json_body(request)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise HTTPError(400, f"'model' must be a string, got {json.dumps(model)[:80]}", code="invalid_value")
        if model and model not in self.served_model_names:
            raise ModelNotFound(model)
        return body

    async def health(self, request: web.Request) -> web.Response:
        status = self.engine.status        # ok | warming up | warm-up failed
        return web.json_response({"status": status}, status=200 if status == "ok" else 503)

    def _refuse_until_ready(self) -> None:
        """Generation waits for no warm-up: a 503 now lets the client retry (or go elsewhere)."""
        if not self.engine.ready:
            raise HTTPError(503, f"the engine is not serving yet ({self.engine.status}); retry shortly",
                            code="warming_up", headers={"Retry-After": "1"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "prefixgate",
            "root": self.core.args.model, "parent": None, "max_model_len": self.core.max_model_len}
            for name in self.served_model_names]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.engine_metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self._refuse_until_ready()
        with RequestTiming(self.tracer, request.headers) as timing:
            body = await self._request_body(request)
            text = self._render_chat(body)
            ids = await self._encode(text, add_special_tokens=False)
            return await self._generate(request, body, ids, timing, chat=True)

    def _render_chat(self, body: dict, add_generation_prompt: bool = True,
                     continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
        """`messages` (and `tools`) rendered with the model's chat template."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise HTTPError(400, "'messages' must be a non-empty list of objects with a 'role'",
                            code="invalid_value")
        tools = _field(body, "tools", list)
        messages = [_flatten_content(m) for m in messages]
        kwargs = {k: v for k, v in (template_kwargs or {}).items()
                  if k not in ("messages", "tools", "add_generation_prompt", "continue_final_message")}
        try:
            text = self.core.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        except HTTPError:
            raise
        except Exception as e:    # the template's own raise_exception(), or a bad message shape
            raise HTTPError(400, f"chat template failed: {e}", code="invalid_value") from None
        if continue_final_message:
            text = _open_final_message(text, messages[-1].get("content"))
        return text

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` (TokenizeCompletionRequest) or `messages` (TokenizeChatRequest)."""
        body = await self._request_body(request)
        if "messages" in body and "prompt" in body:
            raise HTTPError(400, "give either 'prompt' or 'messages', not both", code="invalid_value")
        return_strs = _field(body, "return_token_strs", bool, False)
        if "messages" in body:
            add_generation_prompt = _field(body, "add_generation_prompt", bool, True)
            continue_final_message = _field(body, "continue_final_message", bool, False)
            if add_generation_prompt and continue_final_message:
                raise HTTPError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` "
                                "to True.", code="invalid_value")
            text = self._render_chat(body, add_generation_prompt, continue_final_message,
                                     _field(body, "chat_template_kwargs", dict, {}))
            add_special = _field(body, "add_special_tokens", bool, False)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise HTTPError(400, "'prompt' must be a string (or send 'messages' to tokenize a chat)",
                                code="invalid_value")
            add_special = _field(body, "add_special_tokens", bool, True)
        ids = await self._encode(text, add_special_tokens=add_special)
        strs = None
        if return_strs:
            tok = self.core.tokenizer._tok          # the `tokenizers` object: id -> vocabulary entry
            strs = [tok.id_to_token(i) for i in ids]
        return web.json_response({"count": len(ids), "max_model_len": self.core.max_model_len,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: `tokens` -> `prompt`, special tokens kept (so /tokenize round-trips)."""
        body = await self._request_body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise HTTPError(400, "'tokens' must be a list of token ids (integers)", code="invalid_value")
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

    async def _completions(self, request: web.Request, timing: RequestTiming) -> web.StreamResponse:
        body = await self._request_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]          # a batch of one
        if isinstance(prompt, str) and prompt:
            ids = await self._encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.core.model_config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise HTTPError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                                code="invalid_value")
            ids = list(prompt)
        else:
            raise HTTPError(400, "'prompt' must be a non-empty string or a non-empty list of token ids "
                            "(batches of several prompts are not supported)", code="invalid_value")
        return await self._generate(request, body, ids, timing, chat=False)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tok = self.core.tokenizer
        if len(text) > LONG_TEXT_CHARS:
            return await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens)
        return tok.encode(text, add_special_tokens=add_special_tokens)

    async def _generate(self, request, body, ids, timing: RequestTiming, chat: bool) -> web.StreamResponse:
        limit = self.core.max_model_len
        if len(ids) >= limit:
            raise HTTPError(400, f"This model's maximum context length is {limit} tokens, but the prompt "
                            f"has {len(ids)} tokens (at least one must be left for the completion).",
                            code="context_length_exceeded")
        if not ids:
            raise HTTPError(400, "the prompt is empty", code="invalid_value")
        params = sampling_params(body, len(ids), limit, self.default_max_tokens)
        stream = _field(body, "stream", bool, False)
        opts = _field(body, "stream_options", dict, {})
        fmt = _Format(chat, self.model_name, bool(_field(body, "return_token_ids", bool, False)),
                      ids, bool(opts.get("include_usage")))
        timing.describe(request.headers.get("X-Request-Id") or fmt.id, self.model_name, params)
        kv = self._kv_request(body, stream)
        hold, headers = None, {}
        if isinstance(kv, kv_transfer.RemotePrefill):       # leg 2: the prompt's KV is elsewhere
            out_stream, timing.kv_pull = await self.kv.pull(kv, ids, params)
            headers[KV_HEADER] = "pulled"
        else:
            if kv is not None:
                await self.kv.listen()          # a `both` engine's first leg 1 opens its KV port
            hold = self.kv.new_transfer_id() if kv is not None else None    # leg 1: keep the KV
            out_stream = self.engine.generate(ids, params, kv_hold=hold)   # the engine's arrival: now
        try:
            if stream:
                return await self._stream(request, out_stream, fmt, timing, headers)
            return await self._whole(out_stream, fmt, timing, headers, hold)
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
                raise HTTPError(400, f"this engine's role is {role}: it does not prefill for a remote decode "
                                "('kv_transfer_params.do_remote_decode'); send leg 1 to a prefill engine",
                                code="kv_role")
            if stream:
                raise HTTPError(400, "'stream' must be false with 'kv_transfer_params.do_remote_decode' "
                                "(the answer carries the transfer handle)", code="invalid_value")
        elif isinstance(kv, kv_transfer.RemotePrefill) and (self.kv is None or not self.kv.pulls):
            raise HTTPError(400, f"this engine's role is {role}: it does not decode a remote prefill "
                            "('kv_transfer_params.do_remote_prefill'); send leg 2 to a decode engine",
                            code="kv_role")
        return kv

    async def _whole(self, outputs, fmt: "_Format", timing: RequestTiming, headers: dict,
                     hold: str | None = None) -> web.Response:
        text, token_ids, last = [], [], None
        async for out in outputs:
            timing.output(out)
            text.append(out.text)
            token_ids.extend(out.token_ids)
            last = out
        obj = fmt.whole("".join(text), token_ids, last)
        if hold is not None:
            obj["kv_transfer_params"] = self.kv.hand_over(hold)
            if obj["kv_transfer_params"] is None:
                raise HTTPError(500, "the engine holds no KV for this request", code="engine_error")
        return web.json_response(text=json.dumps(obj), headers={server_timing.HEADER: timing.header(), **headers})

    async def _stream(self, request, outputs, fmt: "_Format", timing: RequestTiming,
                      headers: dict) -> web.StreamResponse:
        resp = None
        try:
            async for out in outputs:
                timing.output(out)
                event = fmt.sse(fmt.chunk(out=out))
                if resp is None:    # headers go out with the first token, so early errors stay JSON
                    if fmt.chat:
                        event = fmt.sse(fmt.chunk(role=True)) + event
                    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache",
                                                       server_timing.HEADER: timing.header(), **headers})
                    await resp.prepare(request)
                await resp.write(event)
                if out.finished and fmt.include_usage:
                    await resp.write(fmt.sse(fmt.usage_chunk(out)))
        except RuntimeError as e:           # the engine failed mid-request
            if resp is None:
                raise HTTPError(500, str(e), code="engine_error") from None
            await resp.write(HTTPError(500, str(e), code="engine_error").sse_event())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class _Format:
    """OpenAI response shapes for one request."""

    def __init__(self, chat: bool, model: str, return_ids: bool, prompt_ids: list[int], include_usage: bool):
        self.chat = chat
        self.model = model
        self.return_ids = return_ids
        self.prompt_ids = prompt_ids
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    @staticmethod
    def sse(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    @staticmethod
    def usage(out) -> dict:
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

    def _envelope(self, choices: list, streaming: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        obj = "chat.completion.chunk" if self.chat and streaming else kind
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, out=None, role: bool = False) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason if out else None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else (
                {"content": out.text} if out.text else {})
        else:
            choice["text"] = out.text
        if out is not None and self.return_ids:
            choice["token_ids"] = out.token_ids
        obj = self._envelope([choice], streaming=True)
        if role and self.return_ids:
            obj["prompt_token_ids"] = self.prompt_ids
        if out is not None and out.finished and not self.include_usage:
            obj["usage"] = self.usage(out)      # usage always arrives, on the last chunk
        return obj

    def usage_chunk(self, out) -> dict:
        obj = self._envelope([], streaming=True)
        obj["usage"] = self.usage(out)
        return obj

    def whole(self, text: str, token_ids: list[int], out) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.return_ids:
            choice["token_ids"] = token_ids
        obj = self._envelope([choice], streaming=False)
        obj["usage"] = self.usage(out)
        if self.return_ids:
            obj["prompt_token_ids"] = self.prompt_ids
        return obj


def _flatten_content(message: dict) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}]) -> one string, as templates expect."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HTTPError(400, "only text content parts are supported", code="invalid_value")
            parts.append(part["text"])
        return {**message, "content": "".join(parts)}
    if content is not None and not isinstance(content, str):
        raise HTTPError(400, "message 'content' must be a string or a list of text parts", code="invalid_value")
    return message


def _open_final_message(text: str, final: str | None) -> str:
    """`continue_final_message`: cut the render just after the last message's content, so the
    model continues that message (as transformers' apply_chat_template does)."""
    if not isinstance(final, str) or not final.strip():
        raise HTTPError(400, "continue_final_message needs a final message with text content", code="invalid_value")
    for piece in (final, final.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[:at + len(piece)]
    raise HTTPError(400, "continue_final_message is set but the final message does not appear in the chat "
                    "after applying the chat template", code="invalid_value")


async def _json_body(request: web.Request) -> dict:
    return parse_json_object(await request.read())


# 404/405 from the router come out in OpenAI's shape too; a client that hung up is not an error
_errors = json_errors_middleware(passthrough=(ConnectionResetError,),
                                 internal_message=lambda e: f"internal error: {e}", logger=log)


# --- starting it -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixgate backend",
                                description="Serve a Llama/Qwen2/Mistral checkpoint with the bundled engine.")
    a = EngineArgs()
    p.add_argument("--model", default="demo", help="Hugging Face model dir, or 'demo' (default)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names the model answers to; the first is the one responses carry "
                   "(default: the dir name, or 'demo')")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16/fp16 on CUDA)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--load-format", default=a.load_format, choices=LOAD_FORMATS,
                   help="mmap (default): weights memory-mapped from the safetensors files, paged in "
                   "on first use and shared through the page cache; eager: read whole into memory "
                   "before serving (no page faults on first requests)")
    p.add_argument("--block-size", type=int, default=a.block_size, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size in bytes, e.g. 2GiB (default: 1GiB on CPU, 85%% of free memory on CUDA)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 (e4m3) | float16 | bfloat16 | float32")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=a.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 512 on CPU, 2048 on CUDA)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="tokens guaranteed each step to the oldest prefill, so short "
                   "prompts cannot starve it (default: budget/4)")
    p.add_argument("--step-overhead-tokens", type=int, default=None,
                   help="a step's fixed cost in tokens of compute: steps stop growing once "
                   "more prefill would delay first tokens more than it saves (default: 32 on "
                   "CPU; 0 on CUDA: fill every step)")
    p.add_argument("--no-chunked-prefill", action="store_true", help="take prompts whole (baseline)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens when a request sets none")
    p.add_argument("--skip-server-warmup", action="store_true",
                   help="serve at once: no warm-up run before /health says 200 (the first requests "
                   "then pay for page faults, allocator growth and kernel compilation)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send one `llm_request` span per request to this OTLP/HTTP collector, "
                   "e.g. http://localhost:4318 (needs the `otel` extra)")
    p.add_argument("--otlp-service-name", default=None,
                   help="the spans' service.name (default: $OTEL_SERVICE_NAME or prefixgate-engine)")
    p.add_argument("--role", default=a.role, choices=kv_transfer.ROLES,
                   help="prefill: answer leg 1 of a P/D pair and hold the prompt's KV for a decode engine; "
                   "decode: pull it and decode (kv_transfer_params, as vLLM's KV connectors); both (default)")
    p.add_argument("--kv-transfer-host", default=None,
                   help="where the KV transfer server listens (prefill, both; default: --host)")
    p.add_argument("--kv-transfer-port", type=int, default=a.kv_transfer_port,
                   help="its port (default 0: a free one; answers carry the real one)")
    p.add_argument("--kv-transfer-timeout", type=float, default=a.kv_transfer_timeout,
                   help="seconds a prefill engine holds a prompt's KV for its pull, and a pull may take "
                   "(default %(default)s)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='prompt-lookup speculative decoding, as vLLM\'s: \'{"method": "ngram", '
                        '"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                        '(also disable_by_batch_size, min_acceptance_rate)')
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                   help="a second KV tier of this many GiB (as vLLM's flag): blocks evicted from the KV "
                   "cache are kept there and loaded back on a prefix hit instead of recomputed; pinned "
                   "host memory on CUDA, a memory-mapped file on CPU (default 0: off)")
    p.add_argument("--kv-offloading-path", default=None, metavar="DIR",
                   help="on CPU, the directory of the second tier's file, e.g. on a fast local disk "
                   "(default: the temp dir; the file is unlinked at once, so it never outlives the engine)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV cache events over ZMQ in vLLM\'s format, as vLLM\'s flag: '
                   '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                   '"topic": "kv-events", "replay_endpoint": "tcp://*:5558"}\' (also buffer_steps, hwm, '
                   'max_queue_size; a port 0 binds a free one)')
    p.add_argument("--log-level", default="info")
    return p


def tracing_config(ns: argparse.Namespace) -> dict | None:
    """The tracing config the flags ask for (None: no tracing); ValueError names the flag."""
    if not ns.otlp_traces_endpoint:
        return None
    raw = {"otlp_endpoint": ns.otlp_traces_endpoint,
           "service_name": ns.otlp_service_name or os.environ.get("OTEL_SERVICE_NAME") or "prefixgate-engine"}
    try:
        return tracing.validate(raw)
    except tracing.ConfigError as e:
        raise ValueError(f"--otlp-traces-endpoint: {e.reason}") from None


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model, dtype=ns.dtype, device=ns.device, load_format=ns.load_format,
        block_size=ns.block_size,
        num_kv_blocks=ns.num_kv_blocks, kv_cache_memory=ns.kv_cache_memory,
        kv_cache_dtype=ns.kv_cache_dtype, max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        step_overhead_tokens=ns.step_overhead_tokens,
        enable_chunked_prefill=not ns.no_chunked_prefill, enable_prefix_caching=not ns.no_prefix_caching,
        attention_backend=ns.attention_backend, enforce_eager=ns.enforce_eager,
        served_model_name=ns.served_model_name[0] if ns.served_model_name else None,
        role=ns.role, kv_transfer_host=ns.kv_transfer_host, kv_transfer_port=ns.kv_transfer_port,
        kv_transfer_timeout=ns.kv_transfer_timeout, speculative_config=speculative_config(ns),
        kv_offloading_size=ns.kv_offloading_size or None, kv_offloading_path=ns.kv_offloading_path,
        kv_events_config=kv_events_config(ns))


def speculative_config(ns: argparse.Namespace) -> SpeculativeConfig | None:
    """`--speculative-config` checked; ValueError names the flag and the key."""
    try:
        return parse_speculative_config(ns.speculative_config)
    except SpecConfigError as e:
        raise ValueError(f"--speculative-config: {e}") from None


def kv_events_config(ns: argparse.Namespace) -> KVEventsConfig | None:
    """`--kv-events-config` checked; ValueError names the flag and the key."""
    try:
        return parse_kv_events_config(ns.kv_events_config)
    except KVEventsConfigError as e:
        raise ValueError(f"--kv-events-config: {e}") from None


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
        await asyncio.to_thread(self.engine.engine.close)     # the tier's stores end, KV events close
        if self.tracer is not None:         # flushes queued spans (bounded), off the loop
            await asyncio.to_thread(self.tracer.close)


async def start_server(argv: list[str] | None = None, *, host: str | None = None, port: int | None = None,
                       engine: LLMEngine | None = None, wait_for_warmup: bool = True) -> RunningServer:
    """Build the engine (unless given) and serve it in this event loop; port 0 picks a free one.
    Returns once the warm-up has run (WarmupError if it failed), or with `wait_for_warmup=False`
    as soon as it listens (`server.engine.wait_ready()` then waits)."""
    ns = build_parser().parse_args(argv or [])
    if ns.served_model_name and not all(ns.served_model_name):
        raise ValueError("--served-model-name: a name must not be empty")
    trace_cfg = tracing_config(ns)          # before the engine: a bad flag fails at once
    core = engine or await asyncio.to_thread(LLMEngine, engine_args(ns))
    async_engine = AsyncEngine(core, warm_up=not ns.skip_server_warmup)
    kv = kv_transfer.KVTransfer(async_engine, host or ns.host)
    metrics = EngineMetrics(core, kv.stats)
    async_engine.on_step = lambda outs: metrics.observe(outs, time.monotonic())
    server = EngineServer(async_engine, metrics, ns.default_max_tokens, ns.served_model_name, kv=kv)
    await kv.start()
    # start_app cancels the handler of a client that hangs up, which aborts its sequence
    try:
        runner, url = await start_app(server.app(), host or ns.host, ns.port if port is None else port)
    except BaseException:
        await kv.close()
        if engine is None:          # ours: let its tier and KV event sockets go
            await asyncio.to_thread(core.close)
        raise
    tracer = server.tracer = tracing.Tracing(trace_cfg) if trace_cfg else None
    async_engine.start()            # the warm-up first, then the step loop
    running = RunningServer(runner, url, async_engine, metrics, tracer, kv)
    if wait_for_warmup:
        try:
            await async_engine.wait_ready()
        except BaseException:
            await running.close()
            raise
    return running


async def _serve_forever(argv: list[str]) -> None:
    server = await start_server(argv, wait_for_warmup=False)
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
        print(f"prefixgate engine: serving {server.engine.engine.served_model_name} at {server.url}", flush=True)
        await stop.wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_on_uvloop(_serve_forever(argv))
    except KeyboardInterrupt:
        pass
    # a bad model dir, flags or weights (before listening), or a warm-up that cannot run
    except (FileNotFoundError, ValueError, OSError, WeightError, WarmupError) as e:
        print(f"prefixgate backend: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
