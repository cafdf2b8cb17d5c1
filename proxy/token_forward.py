"""Send a chat request as token ids (`/v1/completions`) and turn the answer back into chat.

When the gateway has already rendered and tokenized a chat prompt (`prerender`), a backend
that accepts token ids (our engine, vLLM) need not render and tokenize it again: the request
goes to `/v1/completions` with `prompt: [ids]`, and the answer — whole or streamed — is
rewritten into the `chat.completion` / `chat.completion.chunk` shape the client asked for.

Only plain-text chats qualify: tool calls, structured output and logprobs are produced by
the backend's chat endpoint itself, and backends join content parts differently, so requests
using any of them keep their chat form.
"""
from __future__ import annotations

import json

# chat fields that change what the chat endpoint itself must do: such requests stay chat
CHAT_ONLY = ("tools", "tool_choice", "functions", "function_call", "response_format",
             "logprobs", "top_logprobs", "reasoning_effort", "parallel_tool_calls")
# sampling and streaming fields with the same meaning in both endpoints
SHARED = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "min_tokens", "logit_bias", "user",
          "skip_special_tokens", "n")


def eligible(body: dict) -> bool:
    """Can this chat request be forwarded as token ids without losing meaning?"""
    messages = body.get("messages")
    return isinstance(messages, list) and not any(body.get(k) for k in CHAT_ONLY) \
        and body.get("n", 1) in (1, None) and body.get("echo") is None \
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)


def chat_to_completions(body: dict, tokens: list[int]) -> dict:
    """The `/v1/completions` request equivalent to a chat request whose prompt is `tokens`."""
    out = {k: body[k] for k in SHARED if k in body}
    if "max_tokens" not in out and body.get("max_completion_tokens") is not None:
        out["max_tokens"] = body["max_completion_tokens"]
    out["prompt"] = tokens
    return out


def _choice(choice: dict, stream: bool, first: bool) -> dict:
    text = choice.get("text", "")
    if stream:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        if not text and not first:
            delta = {}
        out = {"index": choice.get("index", 0), "delta": delta}
    else:
        out = {"index": choice.get("index", 0),
               "message": {"role": "assistant", "content": text}}
    out["logprobs"] = None
    out["finish_reason"] = choice.get("finish_reason")
    for k in ("stop_reason", "token_ids"):
        if k in choice:
            out[k] = choice[k]
    return out


def completion_to_chat(resp: dict, stream: bool = False, first: bool = True) -> dict:
    """One completions response (or streamed chunk) in chat form; errors pass unchanged."""
    if "choices" not in resp:
        return resp
    out = {k: v for k, v in resp.items() if k not in ("choices", "object")}
    out["object"] = "chat.completion.chunk" if stream else "chat.completion"
    out["choices"] = [_choice(c, stream, first) for c in resp["choices"]]
    return out


class StreamConverter:
    """Rewrites a completions SSE stream into a chat SSE stream, event by event.

    Bytes may arrive split anywhere; whole events (ending in a blank line) are converted and
    returned, the rest is held until its end arrives.
    """

    def __init__(self):
        self._buf = b""
        self._first = True

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        while True:
            cut = self._buf.find(b"\n\n")
            if cut < 0:
                break
            event, self._buf = self._buf[:cut], self._buf[cut + 2:]
            out.append(self._event(event) + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        chat = completion_to_chat(obj, stream=True, first=self._first)
        if obj.get("choices"):
            self._first = False
        return b"data: " + json.dumps(chat, ensure_ascii=False).encode()
