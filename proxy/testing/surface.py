"""The stand-in's OpenAI-compatible surface beyond chat and completions, shaped like vLLM's,
and the errors of its Messages API in Anthropic's shape (vllm/entrypoints/anthropic/
api_router.py).

`Surface` is mixed into `StandIn` (proxy/testing/standin.py): embeddings, the Responses API
(whole, streamed and in the background, kept in memory like vLLM's response store), rerank,
score, tokenize/detokenize, moderations (OpenAI's shape: vLLM has none), audio transcriptions
and translations (multipart/form-data, with the file part's and the whole body's sha256
recorded so tests can prove an upload arrived byte for byte), and SGLang's native /generate
for passthrough tests. The JSON shapes follow vLLM's protocol models:
vllm/entrypoints/openai/engine/protocol.py (ErrorResponse, ModelCard, ModelPermission,
UsageInfo), vllm/entrypoints/openai/models/serving.py (/v1/models, LoRA cards),
vllm/entrypoints/openai/engine/serving.py (_check_model's 404),
vllm/entrypoints/pooling/embed/protocol.py, vllm/entrypoints/pooling/score/protocol.py,
vllm/entrypoints/openai/responses/{protocol,serving,simple_streaming_events,api_router}.py,
and the tokenize and transcription models of vllm/entrypoints/openai/protocol.py.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import struct
import time
import uuid
from dataclasses import replace

from aiohttp import MultipartReader, web
from aiohttp.streams import StreamReader

from prefixgate.common.routes import add_routes

MAX_MODEL_LEN = 4096
EVENT_STREAM = "text/event-stream; charset=utf-8"     # as vLLM (FastAPI) labels its streams
MODERATION_CATEGORIES = ("harassment", "harassment/threatening", "hate", "hate/threatening",
                         "illicit", "illicit/violent", "self-harm", "self-harm/intent",
                         "self-harm/instructions", "sexual", "sexual/minors", "violence",
                         "violence/graphic")


def compact(data) -> str:
    """JSON as vLLM (FastAPI, pydantic) writes it: no spaces after separators."""
    return json.dumps(data, separators=(",", ":"))


def json_response(data, **kw) -> web.Response:
    return web.json_response(data, dumps=compact, **kw)


def random_uuid() -> str:
    return uuid.uuid4().hex                # vLLM's vllm.utils.random_uuid


# --- models ----------------------------------------------------------------------------------
def strict(b) -> bool:
    """Does this stand-in check the request's model? Only with `models` or `lora` set: a
    default stand-in answers any model, as it always has."""
    return b.models is not None or bool(b.lora)


def base_models(b) -> list[str]:
    return list(b.models) if b.models is not None else [b.model]


def served(b) -> list[str]:
    return base_models(b) + list(b.lora)


def answer_model(b, model) -> str:
    """The model an answer names: the one asked for (a LoRA adapter's own id, as vLLM says),
    else the first base model."""
    if strict(b) and isinstance(model, str) and model:
        return model
    return base_models(b)[0] if strict(b) else b.model


def vllm_error(message: str, status: int, err_type: str, param: str | None = None
               ) -> web.Response:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code": <status>}}."""
    return json_response({"error": {"message": message, "type": err_type, "param": param,
                                        "code": status}}, status=status)


def model_not_found(b, model) -> web.Response | None:
    """vLLM's _check_model: None (no model: the default one) or a served id passes; the 404
    names the base models (not the adapters) as the valid aliases."""
    message = not_served(b, model)
    return None if message is None else vllm_error(message, 404, "NotFoundError", "model")


def not_served(b, model) -> str | None:
    """Why `model` is not served (vLLM's words), None when it is (module doc: _check_model)."""
    if not strict(b) or model is None or model in served(b):
        return None
    return f"The model `{model}` does not exist. Valid aliases: {', '.join(base_models(b))}."


def validation_error(field: str, kind: str, msg: str, value) -> web.Response:
    """vLLM's answer to a body that fails its request model (FastAPI's validation, as
    vllm/entrypoints/serve/exception_handling/handlers/validation.py words it)."""
    detail = {"type": kind, "loc": f"body.{field}", "msg": msg, "input": value}
    return vllm_error(f"1 validation error:\n  {detail}", 400, "Bad Request", f"body.{field}")


async def paced_tokens(b, request: web.Request):
    """Token indexes 0..tokens-1, paced like a backend (`first_delay`, then `gap`); with
    fail="reset_after" the connection is closed after `fail_after` tokens (see `was_reset`)."""
    if b.first_delay:
        await asyncio.sleep(b.first_delay)
    for i in range(b.tokens):
        if b.fail == "reset_after" and i == b.fail_after:
            request.transport.close()
            return
        if i and b.gap:
            await asyncio.sleep(b.gap)
        yield i


def was_reset(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def pooling_answer(prefix: str, b, body: dict, data: list, tokens: int) -> web.Response:
    """vLLM's envelope of an embedding or score answer (id, list, created, model, usage)."""
    return json_response({
        "id": f"{prefix}-{random_uuid()}", "object": "list", "created": int(time.time()),
        "model": answer_model(b, body.get("model")), "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None}})


def model_cards(b) -> list[dict]:
    """/v1/models as vLLM lists it: the base models, then each LoRA adapter with its parent."""
    now = int(time.time())

    def card(model_id, root, parent, max_len):
        return {"id": model_id, "object": "model", "created": now, "owned_by": "vllm",
                "root": root, "parent": parent, "max_model_len": max_len,
                "permission": [{"id": f"modelperm-{random_uuid()}", "object": "model_permission",
                                "created": now, "allow_create_engine": False,
                                "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
    bases = base_models(b)
    return ([card(m, m, None, MAX_MODEL_LEN) for m in bases]
            + [card(name, f"/adapters/{name}", parent or bases[0], None)
               for name, parent in b.lora.items()])


# --- the Messages API: its errors in Anthropic's shape (the answers: common/anthropic_answers.py)
def anthropic_error(message: str, status: int, err_type: str) -> web.Response:
    """vLLM's AnthropicErrorResponse: the error's type is the one vLLM's own error names
    (`NotFoundError`, ...: api_router.translate_error_response)."""
    return json_response({"type": "error", "error": {"type": err_type, "message": message}},
                         status=status)


def messages_invalid(body, counting: bool = False) -> web.Response | None:
    """A /v1/messages (`counting`: count_tokens) body its request model refuses, as a 400 in
    Anthropic's shape whose message names the field as vLLM's validation does (vLLM itself
    answers FastAPI's validation errors in OpenAI's shape, even here; the stand-in keeps
    Anthropic's on these paths); None when it is fine."""
    def invalid(field: str, kind: str, msg: str, value) -> web.Response:
        shown = f"<{type(value).__name__} of {len(value)} items>" if isinstance(
            value, (dict, list)) else value
        detail = {"type": kind, "loc": f"body.{field}", "msg": msg, "input": shown}
        return anthropic_error(f"1 validation error:\n  {detail}", 400,
                               "invalid_request_error")
    if not isinstance(body, dict):
        return invalid("", "model_attributes_type", "Input should be a valid dictionary", body)
    for field in ("model", "messages") + (() if counting else ("max_tokens",)):
        if field not in body:
            return invalid(field, "missing", "Field required", body)
    if not isinstance(body["model"], str):
        return invalid("model", "string_type", "Input should be a valid string", body["model"])
    if not counting and (not isinstance(body["max_tokens"], int)
                         or isinstance(body["max_tokens"], bool)):
        return invalid("max_tokens", "int_type", "Input should be a valid integer",
                       body["max_tokens"])
    if not isinstance(body["messages"], list):
        return invalid("messages", "list_type", "Input should be a valid list", body["messages"])
    for i, msg in enumerate(body["messages"]):
        if not isinstance(msg, dict):
            return invalid(f"messages.{i}", "model_type", "Input should be a valid dictionary",
                           msg)
        if msg.get("role") not in ("user", "assistant", "system"):
            return invalid(f"messages.{i}.role", "literal_error",
                           "Input should be 'user', 'assistant' or 'system'", msg.get("role"))
        if not isinstance(msg.get("content"), (str, list)):
            return invalid(f"messages.{i}.content", "missing" if "content" not in msg
                           else "list_type", "Field required" if "content" not in msg
                           else "Input should be a valid list", msg.get("content"))
    return None


# --- small helpers -----------------------------------------------------------------------------
def _tokens_of(text: str) -> int:
    return max(1, len(text) // 4)


def _texts(value) -> list[str]:
    """A str | list[str] | list[int] | list[list[int]] input as a list of texts."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [json.dumps(value)]
    if isinstance(value, list):
        return [v if isinstance(v, str) else json.dumps(v) for v in value]
    return [json.dumps(value)]


def _vector(text: str, dims: int) -> list[float]:
    out, counter = [], 0
    while len(out) < dims:
        digest = hashlib.sha256(f"{counter}:{text}".encode()).digest()
        out += [round(x / 32768 - 1.0, 6) for x in struct.unpack("<16H", digest)]
        counter += 1
    return out[:dims]


def _relevance(query: str, doc: str) -> float:
    """A deterministic score in (0, 1): the share of words in common, a hash breaking ties."""
    q, d = set(query.lower().split()), set(doc.lower().split())
    tie = int(hashlib.sha256((query + "\0" + doc).encode()).hexdigest()[:4], 16) / 65536
    return round((len(q & d) + tie / 100) / (len(q | d) + 1), 6)


def _sse(event: dict) -> bytes:
    """A Responses API event as vLLM frames it (api_router._convert_stream_to_sse_events)."""
    return f"event: {event['type']}\ndata: {compact(event)}\n\n".encode()


class _Replayed:
    """The flow-control side of a StreamReader that replays bytes already read."""
    connected = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


def _replay(raw: bytes) -> StreamReader:
    reader = StreamReader(_Replayed(), max(len(raw), 2 ** 16), loop=asyncio.get_running_loop())
    reader.feed_data(raw)
    reader.feed_eof()
    return reader


class Surface:
    """vLLM's other endpoints, for `StandIn` (uses its behaviour, _behaviour, _record,
    _count_connection, responses, running, completed, aborted and _background)."""

    def add_surface(self, app: web.Application) -> None:
        add_routes(app, {
            "POST /v1/embeddings": self.embeddings,
            "POST /v1/responses": self.create_response,
            "GET /v1/responses/{response_id}": self.retrieve_response,
            "POST /v1/responses/{response_id}/cancel": self.cancel_response,
            "POST /v1/rerank": self.rerank,
            "POST /rerank": self.rerank,
            "POST /v1/score": self.score,
            "POST /score": self.score,
            "POST /tokenize": self.tokenize,
            "POST /detokenize": self.detokenize,
            "POST /v1/moderations": self.moderations,
            "POST /v1/audio/transcriptions": self.audio,
            "POST /v1/audio/translations": self.audio,
            "POST /generate": self.sglang_generate,
        })

    async def _json_request(self, request: web.Request, check_model: bool = False):
        """(body, behaviour) after counting and recording, or (None, error response); with
        `check_model`, a model it does not serve is vLLM's 404."""
        self._count_connection(request)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return None, vllm_error("request body must be a JSON object", 400, "BadRequestError")
        b = self._behaviour(body)
        self._record(request, body, b)
        if b.fail == "status":
            return None, vllm_error("stand-in failure", b.status, "InternalServerError")
        if b.fail == "hang":
            await asyncio.sleep(3600)
        if check_model and (err := model_not_found(b, body.get("model"))) is not None:
            return None, err
        return body, b

    # --- embeddings ------------------------------------------------------------------------
    async def embeddings(self, request: web.Request) -> web.Response:
        body, b = await self._json_request(request, check_model=True)
        if body is None:
            return b
        if "input" not in body and "messages" not in body:
            return vllm_error("'input' is required", 400, "BadRequestError", "input")
        texts = _texts(body.get("input", body.get("messages")))
        dims = body.get("dimensions") or 8
        data = []
        for i, text in enumerate(texts):
            vec = _vector(text, dims)
            if body.get("encoding_format") == "base64":
                vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"index": i, "object": "embedding", "embedding": vec})
        prompt = sum(_tokens_of(t) for t in texts)
        await asyncio.sleep(b.first_delay)
        return pooling_answer("embd", b, body, data, prompt)

    # --- the Responses API -------------------------------------------------------------------
    async def create_response(self, request: web.Request) -> web.StreamResponse:
        body, b = await self._json_request(request, check_model=True)
        if body is None:
            return b
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.responses:
            return _response_not_found(previous)
        if "input" not in body:
            return vllm_error("'input' is required", 400, "BadRequestError", "input")
        limit = body.get("max_output_tokens")
        tokens = min(b.tokens, limit) if isinstance(limit, int) and limit > 0 else b.tokens
        b = replace(b, tokens=tokens)
        rid, item_id = f"resp_{random_uuid()}", f"msg_{random_uuid()}"
        prompt = sum(_tokens_of(t) for t in _texts(body["input"]))
        resp = _response(rid, body, answer_model(b, body.get("model")), "in_progress", [])
        store = body.get("store", True) is not False
        if store:
            self.responses[rid] = resp
        if body.get("background"):
            if not store:
                return vllm_error("background can only be used when `store` is true", 400,
                                  "BadRequestError", "background")
            resp["status"] = "queued"
            task = asyncio.get_running_loop().create_task(self._generate(b, resp, item_id, prompt))
            self._background[rid] = task
            task.add_done_callback(lambda _t: self._background.pop(rid, None))
            return json_response(resp)
        self.running += 1
        try:
            if body.get("stream"):
                return await self._stream_response(request, b, resp, item_id, prompt)
            await self._generate(b, resp, item_id, prompt)
            return json_response(resp)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.running -= 1

    async def _generate(self, b, resp: dict, item_id: str, prompt: int) -> None:
        """Fill in `resp` as a finished generation (in place: the stored one too)."""
        resp["status"] = "in_progress"
        await asyncio.sleep(b.first_delay + b.gap * max(b.tokens - 1, 0))
        _finish(resp, item_id, _text(b), prompt, b.tokens)
        self.completed += 1

    async def _stream_response(self, request, b, resp: dict, item_id: str,
                               prompt: int) -> web.StreamResponse:
        """vLLM's simple (non-harmony) event sequence, numbered by `sequence_number`."""
        out = web.StreamResponse(headers={"Content-Type": EVENT_STREAM})
        await out.prepare(request)
        seq = iter(range(1 << 30))

        async def send(event: dict) -> None:
            event["sequence_number"] = next(seq)
            await out.write(_sse(event))
        head = json.loads(json.dumps(resp))          # as it stood when the stream began
        await send({"response": head, "type": "response.created"})
        await send({"response": head, "type": "response.in_progress"})
        await send({"item": _message(item_id, None), "output_index": 0,
                    "type": "response.output_item.added"})
        await send({"content_index": 0, "item_id": item_id, "output_index": 0,
                    "part": {"annotations": [], "text": "", "type": "output_text",
                             "logprobs": []}, "type": "response.content_part.added"})
        async for i in paced_tokens(b, request):
            await send({"content_index": 0, "delta": f"tok{i} ", "item_id": item_id,
                        "logprobs": [], "output_index": 0, "type": "response.output_text.delta"})
        if was_reset(request):
            return out
        text = _text(b)
        _finish(resp, item_id, text, prompt, b.tokens)
        await send({"content_index": 0, "item_id": item_id, "logprobs": [], "output_index": 0,
                    "text": text, "type": "response.output_text.done"})
        await send({"content_index": 0, "item_id": item_id, "output_index": 0,
                    "part": {"annotations": [], "text": text, "type": "output_text",
                             "logprobs": None}, "type": "response.content_part.done"})
        await send({"item": _message(item_id, text), "output_index": 0,
                    "type": "response.output_item.done"})
        await send({"response": resp, "type": "response.completed"})
        await out.write_eof()
        self.completed += 1
        return out

    def _stored_response(self, request: web.Request) -> tuple[str, dict | web.Response]:
        """(id, the stored response) of GET/cancel, or (id, vLLM's error answer)."""
        self._count_connection(request)
        rid = request.match_info["response_id"]
        self._record(request, None, self.behaviour)
        resp = self.responses.get(rid)
        return rid, resp if resp is not None else _response_not_found(rid)

    async def retrieve_response(self, request: web.Request) -> web.Response:
        _, resp = self._stored_response(request)
        return resp if isinstance(resp, web.Response) else json_response(resp)

    async def cancel_response(self, request: web.Request) -> web.Response:
        rid, resp = self._stored_response(request)
        if isinstance(resp, web.Response):
            return resp
        if resp["status"] not in ("queued", "in_progress"):
            return vllm_error("Cannot cancel a synchronous response.", 400,
                              "invalid_request_error", "response_id")
        resp["status"] = "cancelled"
        task = self._background.pop(rid, None)
        if task is not None:
            task.cancel()
        return json_response(resp)

    # --- scoring -----------------------------------------------------------------------------
    async def rerank(self, request: web.Request) -> web.Response:
        body, b = await self._json_request(request, check_model=True)
        if body is None:
            return b
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(docs, list):
            return vllm_error("'query' (a string) and 'documents' (a list) are required", 400,
                              "BadRequestError")
        docs = [d if isinstance(d, str) else json.dumps(d) for d in docs]
        results = sorted(({"index": i, "document": {"text": d},
                           "relevance_score": _relevance(query, d)} for i, d in enumerate(docs)),
                         key=lambda r: -r["relevance_score"])
        top_n = body.get("top_n") or 0
        if top_n > 0:
            results = results[:top_n]
        return json_response({
            "id": f"rerank-{random_uuid()}", "model": answer_model(b, body.get("model")),
            "usage": {"total_tokens": sum(_tokens_of(query + d) for d in docs)},
            "results": results})

    async def score(self, request: web.Request) -> web.Response:
        body, b = await self._json_request(request, check_model=True)
        if body is None:
            return b
        if "text_1" not in body or "text_2" not in body:
            return vllm_error("'text_1' and 'text_2' are required", 400, "BadRequestError")
        left, right = _texts(body["text_1"]), _texts(body["text_2"])
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            return vllm_error("text_1 and text_2 must have the same length", 400,
                              "BadRequestError")
        pairs = list(zip(left, right))
        tokens = sum(_tokens_of(a + b_) for a, b_ in pairs)
        return pooling_answer("score", b, body, [
            {"index": i, "object": "score", "score": _relevance(a, b_)}
            for i, (a, b_) in enumerate(pairs)], tokens)

    # --- tokenizer -----------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        """One token per UTF-8 byte, so /detokenize inverts it exactly."""
        body, b = await self._json_request(request, check_model=True)
        if body is None:
            return b
        if isinstance(body.get("prompt"), str):
            text = body["prompt"]
        elif isinstance(body.get("messages"), list):
            text = "".join(f"{m.get('role')}\n{m.get('content')}\n" for m in body["messages"]
                           if isinstance(m, dict))
        else:
            return vllm_error("'prompt' or 'messages' is required", 400, "BadRequestError")
        tokens = list(text.encode())
        strs = [bytes([t]).decode("latin-1") for t in tokens] if body.get(
            "return_token_strs") else None
        return json_response({"count": len(tokens), "max_model_len": MAX_MODEL_LEN,
                                  "tokens": tokens, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body, b = await self._json_request(request, check_model=True)
        if body is None:
            return b
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            return validation_error("tokens", "list_type", "Input should be a valid list", tokens)
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or isinstance(t, bool):
                return validation_error(f"tokens.{i}", "int_type",
                                        "Input should be a valid integer", t)
        # ids outside the vocabulary decode to nothing, as vLLM's tokenizer skips them
        return json_response({"prompt": bytes(t for t in tokens if 0 <= t < 256).decode(
            "utf-8", "replace")})

    # --- moderations (OpenAI's shape) ----------------------------------------------------------
    async def moderations(self, request: web.Request) -> web.Response:
        body, b = await self._json_request(request, check_model=True)
        if body is None:
            return b
        results = []
        for text in _texts(body.get("input", "")):
            hit = "attack" in text.lower()
            results.append({
                "flagged": hit,
                "categories": {c: hit and c == "violence" for c in MODERATION_CATEGORIES},
                "category_scores": {c: 0.9 if hit and c == "violence" else 0.0001
                                    for c in MODERATION_CATEGORIES},
                "category_applied_input_types": {c: ["text"] for c in MODERATION_CATEGORIES}})
        return json_response({"id": f"modr-{random_uuid()}",
                                  "model": answer_model(b, body.get("model")),
                                  "results": results})

    # --- audio ---------------------------------------------------------------------------------
    async def audio(self, request: web.Request) -> web.StreamResponse:
        """Transcriptions and translations: the form read with aiohttp's multipart reader
        over the raw body (kept, so its sha256 is recorded next to the file part's)."""
        self._count_connection(request)
        raw = await request.read()
        entry = {"body_sha256": hashlib.sha256(raw).hexdigest(), "body_size": len(raw),
                 "parts": [], "form": {}, "file": None}
        try:
            reader = MultipartReader(request.headers, _replay(raw))
            while (part := await reader.next()) is not None:
                entry["parts"].append(part.name)
                if part.filename is None:
                    entry["form"][part.name] = await part.text()
                    continue
                digest, size = hashlib.sha256(), 0
                while chunk := await part.read_chunk(64 * 1024):
                    digest.update(chunk)
                    size += len(chunk)
                entry["file"] = {"field": part.name, "filename": part.filename,
                                 "content_type": part.headers.get("Content-Type"),
                                 "size": size, "sha256": digest.hexdigest()}
        except (ValueError, AssertionError, RuntimeError) as e:
            self._record(request, None, self.behaviour, **entry)
            return vllm_error(f"invalid multipart body: {e}", 400, "BadRequestError")
        b = self.behaviour
        self._record(request, None, b, **entry)
        form = entry["form"]
        if (err := model_not_found(b, form.get("model"))) is not None:
            return err
        if entry["file"] is None:
            return vllm_error("'file' is required", 400, "BadRequestError", "file")
        model = answer_model(b, form.get("model"))
        size = entry["file"]["size"]
        text = f"heard {size} bytes: " + _text(b).strip()
        seconds = max(1, size // 32000)           # 16 kHz, 16-bit mono
        if form.get("stream", "").lower() == "true":
            return await self._stream_audio(request, b, model, form)
        await asyncio.sleep(b.first_delay)
        if form.get("response_format") == "text":
            return web.Response(text=text)
        if request.path.endswith("translations"):
            return json_response({"text": text})
        return json_response({"text": text, "usage": {"type": "duration",
                                                          "seconds": seconds}})

    async def _stream_audio(self, request, b, model: str, form: dict) -> web.StreamResponse:
        """vLLM's speech-to-text stream: transcription.chunk deltas, then [DONE]."""
        out = web.StreamResponse(headers={"Content-Type": EVENT_STREAM})
        await out.prepare(request)
        rid, created = f"trsc-{random_uuid()}", int(time.time())
        kind = "translation" if request.path.endswith("translations") else "transcription"
        async for i in paced_tokens(b, request):
            last = i == b.tokens - 1
            chunk = {"id": rid, "object": f"{kind}.chunk", "created": created, "model": model,
                     "choices": [{"delta": {"content": f"tok{i} "},
                                  "finish_reason": "length" if last else None,
                                  "stop_reason": None}]}
            await out.write(b"data: " + compact(chunk).encode() + b"\n\n")
        if was_reset(request):
            return out
        if form.get("stream_include_usage", "").lower() == "true":
            usage = {"id": rid, "object": f"{kind}.chunk", "created": created, "model": model,
                     "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": b.tokens,
                                              "total_tokens": 1 + b.tokens}}
            await out.write(b"data: " + compact(usage).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    # --- SGLang's native /generate (for passthrough) -----------------------------------------
    async def sglang_generate(self, request: web.Request) -> web.StreamResponse:
        """{"text", "sampling_params", "stream"} -> {"text", "meta_info"}; streamed as SGLang
        does: each event carries the text so far, then [DONE]."""
        body, b = await self._json_request(request)
        if body is None:
            return b
        params = body.get("sampling_params") or {}
        limit = params.get("max_new_tokens")
        b = replace(b, tokens=min(b.tokens, limit) if isinstance(limit, int) and limit > 0
                    else b.tokens)
        prompt = body.get("text") if isinstance(body.get("text"), str) else json.dumps(
            body.get("input_ids"))
        rid, started = random_uuid(), time.monotonic()

        def answer(n: int, done: bool) -> dict:
            return {"text": "".join(f"tok{i} " for i in range(n)), "meta_info": {
                "id": rid, "finish_reason": {"type": "length", "length": b.tokens} if done
                else None, "prompt_tokens": _tokens_of(prompt), "completion_tokens": n,
                "cached_tokens": 0, "e2e_latency": round(time.monotonic() - started, 6)}}
        if not body.get("stream"):
            await asyncio.sleep(b.first_delay + b.gap * max(b.tokens - 1, 0))
            return json_response(answer(b.tokens, True))
        out = web.StreamResponse(headers={"Content-Type": EVENT_STREAM})
        await out.prepare(request)
        if b.first_delay:
            await asyncio.sleep(b.first_delay)
        for i in range(1, b.tokens + 1):
            if i > 1 and b.gap:
                await asyncio.sleep(b.gap)
            await out.write(b"data: " + compact(answer(i, i == b.tokens)).encode()
                            + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _text(b) -> str:
    return "".join(f"tok{i} " for i in range(b.tokens))


def _message(item_id: str, text: str | None) -> dict:
    """An assistant output message: in progress (no text yet) or completed."""
    content = [] if text is None else [{"annotations": [], "text": text, "type": "output_text",
                                        "logprobs": None}]
    return {"id": item_id, "content": content, "role": "assistant",
            "status": "in_progress" if text is None else "completed", "type": "message"}


def _response(rid: str, body: dict, model: str, status: str, output: list) -> dict:
    """vLLM's ResponsesResponse, `id` first (as pydantic dumps it: the gateway finds it
    there in a stream's head)."""
    return {"id": rid, "created_at": int(time.time()), "incomplete_details": None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"),
            "model": model, "object": "response", "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "tool_choice":
            body.get("tool_choice", "auto" if body.get("tools") else "none"),
            "tools": body.get("tools", []),
            "top_p": body.get("top_p", 1.0), "background": bool(body.get("background")),
            "max_output_tokens": body.get("max_output_tokens") or MAX_MODEL_LEN,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"), "prompt": None,
            "reasoning": None, "service_tier": body.get("service_tier", "auto"),
            "status": status, "text": None, "top_logprobs": None, "truncation": "disabled",
            "usage": None, "user": body.get("user")}


def _finish(resp: dict, item_id: str, text: str, prompt: int, tokens: int) -> None:
    """The response as it ends: "incomplete" when `max_output_tokens` cut it short (as vLLM
    reports a generation that stopped at its length limit), else "completed"."""
    if resp["status"] == "cancelled":
        return
    if tokens >= resp["max_output_tokens"]:
        resp.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    else:
        resp["status"] = "completed"
    resp.update(output=[_message(item_id, text)], usage={
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + tokens})


def _response_not_found(rid: str) -> web.Response:
    return vllm_error(f"Response with id '{rid}' not found.", 404, "invalid_request_error",
                      "response_id")


