"""The OpenAI API's shapes for the bundled engine: request bodies checked and turned into
sampling parameters, prompts and chat messages; responses (whole, SSE chunks, usage) built.

Bad requests raise `HTTPError` 400s that name the field (code `invalid_value`, or
`unsupported_value` for what the engine does not do), as vLLM answers them; a request for a
model the server does not serve gets vLLM's 404 (`ModelNotFound`).
"""
from __future__ import annotations

import json
import time
import uuid

from prefixgate.backend.sampling import SamplingParams
from prefixgate.common.errors import HTTPError
from prefixgate.common.runtime import parse_json_object
from prefixgate.common.schema import is_type, json_value, type_name

# --- requests ---------------------------------------------------------------------------------

async def json_body(request) -> dict:
    """An aiohttp request's body, which must be one JSON object."""
    return parse_json_object(await request.read())


def body_field(body: dict, name: str, types, default=None, check=None, what=None):
    """A typed, optional request field; bad values raise a 400 that names the field."""
    value = body.get(name)
    if value is None:
        return default
    if not is_type(value, types) or (check is not None and not check(value)):
        raise HTTPError(400, f"'{name}' must be {what or type_name(types)}, "
                             f"got {json_value(value)}", code="invalid_value")
    return value


def sampling_params(body: dict, prompt_len: int, max_model_len: int,
                    default_max_tokens: int) -> SamplingParams:
    if body_field(body, "n", int, 1) != 1:
        raise HTTPError(400, "'n' other than 1 is not supported", code="unsupported_value")
    for flag in ("logprobs", "echo"):
        if body.get(flag) not in (None, False, 0):
            raise HTTPError(400, f"'{flag}' is not supported by the bundled engine",
                            code="unsupported_value")
    room = max_model_len - prompt_len
    positive = (lambda v: v >= 1, "a positive integer")
    max_tokens = body_field(body, "max_completion_tokens", int, None, *positive)
    max_tokens = body_field(body, "max_tokens", int, max_tokens, *positive)
    stop = body_field(body, "stop", (str, list), [], lambda v: isinstance(v, str) or all(
        isinstance(s, str) and s for s in v), "a string or a list of non-empty strings")
    number = (int, float)
    return SamplingParams(
        max_tokens=min(max_tokens or default_max_tokens, room),
        temperature=float(body_field(body, "temperature", number, 1.0, lambda v: v >= 0,
                                     "a number >= 0")),
        top_p=float(body_field(body, "top_p", number, 1.0, lambda v: 0 < v <= 1,
                               "a number in (0, 1]")),
        top_k=body_field(body, "top_k", int, 0, lambda v: v >= -1,
                         "-1, 0 or a positive integer"),
        seed=body_field(body, "seed", int, None, lambda v: -2**63 <= v < 2**64,
                        "a 64-bit integer"),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=body_field(body, "stop_token_ids", list, [], lambda v: all(
            is_type(t, int) for t in v), "a list of integers"),
        ignore_eos=body_field(body, "ignore_eos", bool, False),
    )


# vLLM 0.32's validate_cache_salt (vllm/entrypoints/generate/base/protocol.py)
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
MAX_CACHE_SALT_LENGTH = 128


class CacheSaltError(HTTPError):
    """A `cache_salt` vLLM refuses: its 400 (type "Bad Request", `param` "cache_salt") with
    its message (vLLM wraps it in pydantic's error dump; the message is the part it raised)."""

    def __init__(self, message: str):
        super().__init__(400, message, code=400, type="Bad Request")

    def payload(self, shape: str = "openai") -> dict:
        out = super().payload(shape)
        if shape == "openai":
            out["error"]["param"] = "cache_salt"
        return out


def cache_salt_of(body: dict) -> str | None:
    """The request's `cache_salt` checked as vLLM checks it (None: absent): a non-empty string
    of at most 128 characters without '@', '/', '\\' or NUL."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise CacheSaltError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(salt) > MAX_CACHE_SALT_LENGTH or not CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise CacheSaltError("Parameter 'cache_salt' must be at most 128 characters and must "
                             "not contain '@', '/', '\\\\', or NUL.")
    return salt


class ModelNotFound(HTTPError):
    """A request for a model this server does not serve: vLLM's 404, `param` included."""

    def __init__(self, name: str):
        super().__init__(404, f"The model `{name}` does not exist.", code=404, type="NotFoundError")

    def payload(self, shape: str = "openai") -> dict:
        out = super().payload(shape)
        if shape == "openai":
            out["error"]["param"] = "model"
        return out


def check_model(body: dict, served: list[str]) -> None:
    """The body's `model` must be one of `served` (absent or empty: the default, as vLLM)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError(400, f"'model' must be a string, got {json_value(model)}",
                        code="invalid_value")
    if model and model not in served:
        raise ModelNotFound(model)


def completion_prompt(body: dict, vocab_size: int) -> str | list[int]:
    """`/v1/completions`' `prompt`: a non-empty text, or token ids within the vocabulary (a
    batch of one is its prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(is_type(t, int) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise HTTPError(400, f"prompt token id {bad} is outside the vocabulary "
                                 f"[0, {vocab_size})", code="invalid_value")
        return list(prompt)
    raise HTTPError(400, "'prompt' must be a non-empty string or a non-empty list of token ids "
                         "(batches of several prompts are not supported)", code="invalid_value")


def chat_messages(body: dict) -> list[dict]:
    """`messages`, each with a `role`, their content parts joined into one string."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise HTTPError(400, "'messages' must be a non-empty list of objects with a 'role'",
                        code="invalid_value")
    return [_arguments_as_objects(flatten_content(m)) for m in messages]


def _arguments_as_objects(message: dict) -> dict:
    """An assistant's tool calls with their `arguments` as objects, not JSON text, as chat
    templates expect them (and vLLM hands them over: bad or empty JSON becomes {})."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list) or not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or isinstance(function.get("arguments"), dict):
            out.append(call)
            continue
        try:
            args = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = {}
        out.append({**call, "function": {**function,
                                         "arguments": args if isinstance(args, dict) else {}}})
    return {**message, "tool_calls": out}


def flatten_content(message: dict) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}]) -> one string, as templates
    expect."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if (not isinstance(part, dict) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)):
                raise HTTPError(400, "only text content parts are supported", code="invalid_value")
            parts.append(part["text"])
        return {**message, "content": "".join(parts)}
    if content is not None and not isinstance(content, str):
        raise HTTPError(400, "message 'content' must be a string or a list of text parts",
                        code="invalid_value")
    return message


# --- the Messages API (Anthropic's) ------------------------------------------------------------

MESSAGE_ROLES = ("user", "assistant", "system")
TOOL_CHOICES = ("auto", "any", "tool", "none")


def check_messages_request(body: dict, count_tokens: bool = False) -> None:
    """A `/v1/messages` body (or `/v1/messages/count_tokens`', which has no `max_tokens`) as
    vLLM's AnthropicMessagesRequest takes it: `model`, `messages` and `max_tokens` required, the
    fields both share typed; a 400 names the field. Fields it does not know (`metadata`,
    `cache_control` on blocks, `prompt_cache_key`, ...) pass."""
    _required(body, "model", lambda v: isinstance(v, str) and v, "a non-empty string")
    messages = _required(body, "messages", lambda v: isinstance(v, list), "a list of messages")
    for i, msg in enumerate(messages):
        _check_message(msg, f"messages[{i}]")
    if not count_tokens:
        _required(body, "max_tokens", lambda v: is_type(v, int) and v >= 1,
                  "a positive integer")
        body_field(body, "stream", bool)
        body_field(body, "stop_sequences", list, None, lambda v: all(isinstance(s, str)
                                                                    for s in v),
                   "a list of strings")
        for name in ("temperature", "top_p"):
            body_field(body, name, (int, float))
        body_field(body, "top_k", int)
        body_field(body, "metadata", dict)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "system")
    tools = body_field(body, "tools", list, [])
    for i, tool in enumerate(tools):
        if (not isinstance(tool, dict) or not isinstance(tool.get("name"), str)
                or not isinstance(tool.get("input_schema", {}), dict)):
            raise HTTPError(400, f"'tools[{i}]' must be an object with a 'name' (a string) and "
                                 f"an 'input_schema' (an object), got {json_value(tool)}",
                            code="invalid_value")
    choice = body_field(body, "tool_choice", dict)
    if choice is not None and (choice.get("type") not in TOOL_CHOICES or (
            choice["type"] == "tool" and not choice.get("name"))):
        raise HTTPError(400, "'tool_choice' must be {\"type\": \"auto\"|\"any\"|\"none\"} or "
                             "{\"type\": \"tool\", \"name\": ...}, got "
                             f"{json_value(choice)}", code="invalid_value")


def vllm_text_content(message: dict) -> dict:
    """A message as vLLM's chat path hands it to a template that takes text content (the
    Messages path renders this way): text parts joined with newlines, no content as ""."""
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         for p in content):
        return {**message, "content": "\n".join(str(p.get("text") or "") for p in content)}
    return message


def _required(body: dict, name: str, check, what: str):
    value = body.get(name)
    if value is None:
        raise HTTPError(400, f"'{name}' is required ({what})", code="invalid_value")
    if not check(value):
        raise HTTPError(400, f"'{name}' must be {what}, got {json_value(value)}",
                        code="invalid_value")
    return value


def _check_message(msg, where: str) -> None:
    if not isinstance(msg, dict):
        raise HTTPError(400, f"'{where}' must be an object with 'role' and 'content', got "
                             f"{json_value(msg)}", code="invalid_value")
    if msg.get("role") not in MESSAGE_ROLES:
        raise HTTPError(400, f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}, got "
                             f"{json_value(msg.get('role'))}", code="invalid_value")
    content = msg.get("content")
    if not isinstance(content, str):
        _check_blocks(content, f"{where}.content")


def _check_blocks(blocks, where: str) -> None:
    if not isinstance(blocks, list) or not all(
            isinstance(b, dict) and isinstance(b.get("type"), str) for b in blocks):
        raise HTTPError(400, f"'{where}' must be a string or a list of content blocks (objects "
                             f"with a 'type'), got {json_value(blocks)}", code="invalid_value")


def open_final_message(text: str, final: str | None) -> str:
    """`continue_final_message`: cut the render just after the last message's content, so the
    model continues that message (as transformers' apply_chat_template does)."""
    if not isinstance(final, str) or not final.strip():
        raise HTTPError(400, "continue_final_message needs a final message with text content",
                        code="invalid_value")
    for piece in (final, final.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[:at + len(piece)]
    raise HTTPError(400, "continue_final_message is set but the final message does not appear "
                         "in the chat after applying the chat template", code="invalid_value")


# --- responses --------------------------------------------------------------------------------

class ResponseFormat:
    """OpenAI response shapes for one request. `continuous_usage` (vLLM's
    `stream_options.continuous_usage_stats`) puts the usage so far on every chunk, the role
    chunk's included; the chunk after the last (`usage_chunk`) has it whole, cached tokens
    and all."""

    def __init__(self, chat: bool, model: str, return_ids: bool, prompt_ids: list[int],
                 include_usage: bool, continuous_usage: bool = False):
        self.chat = chat
        self.model = model
        self.return_ids = return_ids
        self.prompt_ids = prompt_ids
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    @staticmethod
    def sse(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    @staticmethod
    def usage(out) -> dict:
        """vLLM's usage: `prompt_tokens_details.cached_tokens` (served from the prefix cache),
        and for a request with cache_control breakpoints `created_cache_tokens` (computed
        inside a breakpoint's prefix: Anthropic's cache_creation_input_tokens)."""
        details = {"cached_tokens": out.cached_tokens}
        if out.created_cache_tokens is not None:
            details["created_cache_tokens"] = out.created_cache_tokens
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
                "prompt_tokens_details": details}

    def _usage_so_far(self, out) -> dict:
        prompt = len(self.prompt_ids)
        done = out.completion_tokens if out is not None else 0
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _envelope(self, choices: list, streaming: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        obj = "chat.completion.chunk" if self.chat and streaming else kind
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, out=None, role: bool = False, delta: dict | None = None,
              finish_reason: str | None = None, stop_reason: str | None = None) -> dict:
        """One streamed chunk: the role's (first), or `out`'s, whose text is the delta unless
        `delta` is given (a chat delta: text and tool calls); `finish_reason` overrides `out`'s
        and `stop_reason` (the stop string that ended it) is added when given, as vLLM."""
        reason = finish_reason or (out.finish_reason if out is not None else None)
        choice = {"index": 0, "logprobs": None, "finish_reason": reason}
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else (
                delta if delta is not None else {"content": out.text} if out.text else {})
        else:
            choice["text"] = out.text
        if out is not None and self.return_ids:
            choice["token_ids"] = out.token_ids
        obj = self._envelope([choice], streaming=True)
        if role and self.return_ids:
            obj["prompt_token_ids"] = self.prompt_ids
        if out is not None and out.finished and not self.include_usage:
            obj["usage"] = self.usage(out)      # usage always arrives, on the last chunk
        elif self.continuous_usage:
            obj["usage"] = self._usage_so_far(out)
        return obj

    def usage_chunk(self, out) -> dict:
        obj = self._envelope([], streaming=True)
        obj["usage"] = self.usage(out)
        return obj

    def whole(self, text: str | None, token_ids: list[int], out,
              tool_calls: list[dict] | None = None, finish_reason: str | None = None,
              stop_reason: str | None = None) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason or out.finish_reason}
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        if self.return_ids:
            choice["token_ids"] = token_ids
        obj = self._envelope([choice], streaming=False)
        obj["usage"] = self.usage(out)
        if self.return_ids:
            obj["prompt_token_ids"] = self.prompt_ids
        return obj
