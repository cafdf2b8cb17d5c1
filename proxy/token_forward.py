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

from prefixgate.common import sse

# chat fields that change what the chat endpoint itself must do: such requests stay chat
CHAT_ONLY = ("tools", "tool_choice", "functions", "function_call", "response_format",
             "logprobs", "top_logprobs", "reasoning_effort", "parallel_tool_calls")
# sampling and streaming fields with the same meaning in both endpoints
SHARED = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "min_tokens", "logit_bias", "user",
          "skip_special_tokens", "n", "cache_salt")


def eligible(body: dict) -> bool:
    """Can this chat request be forwarded as token ids without losing meaning?"""
    messages = body.get("messages")
    return isinstance(messages, list) and not any(body.get(k) for k in CHAT_ONLY) \
        and body.get("n", 1) in (1, None) and body.get("echo") is None \
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)


def applies(ctx, up) -> bool:
    """Send this chat to `up` as token ids? (`forward: tokens` on the upstream, prerender's
    tokens at hand, a chat that qualifies; P/D legs never ask: they go as the client sent.)"""
    return (up.cfg.get("forward") == "tokens" and ctx.tokens is not None
            and ctx.path == "/v1/chat/completions" and eligible(ctx.body))


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


class ChatFromCompletions(sse.EventRewriter):
    """The answer rewriter (proxy/rewrite.py) of a chat sent as token ids: a completions
    answer, whole or streamed event by event, in chat form."""

    def __init__(self):
        super().__init__()
        self._first = True

    def whole(self, answer: dict) -> dict:
        return completion_to_chat(answer)

    def event(self, raw: bytes) -> bytes:
        obj = sse.json_of(raw)
        if not isinstance(obj, dict):
            return raw                  # [DONE], a comment, not JSON: as it came
        chat = completion_to_chat(obj, stream=True, first=self._first)
        if obj.get("choices"):
            self._first = False
        return b"data: " + json.dumps(chat, ensure_ascii=False).encode() + b"\n\n"
