"""Answer rewriters: what the client gets in place of the upstream's answer.

A rewriter turns one attempt's answer into the client's, in whichever form it comes:

    whole(answer: dict) -> dict     a whole JSON answer (status 200)
    feed(chunk: bytes) -> bytes     a stream's bytes, split anywhere: whole events out
    flush() -> bytes                the stream has ended: what is held back

`for_attempt` chooses them once per attempt; None when nothing rewrites the answer, so the
relay passes its bytes on unread (DESIGN.md §2). The rewriters: a chat sent as token ids
answered as chat (token_forward.py), the Responses API's ids (response_ids.py), a warm API
request's answer (warm.py). Streams are read with the one SSE reader (common/sse.py).
"""
from __future__ import annotations

from typing import Protocol

from prefixgate.proxy import token_forward, warm
from prefixgate.proxy.response_ids import Rewriter as ResponseIdsRewriter


class AnswerRewriter(Protocol):
    def whole(self, answer: dict) -> dict: ...
    def feed(self, chunk: bytes) -> bytes: ...
    def flush(self) -> bytes: ...


class Chain:
    """Several rewriters, each given what the one before it made."""

    def __init__(self, rewriters: list[AnswerRewriter]):
        self.rewriters = rewriters

    def whole(self, answer: dict) -> dict:
        for r in self.rewriters:
            answer = r.whole(answer)
        return answer

    def feed(self, chunk: bytes) -> bytes:
        for r in self.rewriters:
            chunk = r.feed(chunk)
        return chunk

    def flush(self) -> bytes:
        out = b""
        for r in self.rewriters:
            out = r.feed(out) + r.flush()
        return out


def for_attempt(gw, ctx, up, as_tokens: bool) -> AnswerRewriter | None:
    """The rewriters of one attempt on `up` (`as_tokens`: the chat went as token ids)."""
    chosen: list[AnswerRewriter] = []
    if as_tokens:
        chosen.append(token_forward.ChatFromCompletions())
    if ctx.endpoint.responses:
        chosen.append(ResponseIdsRewriter(gw.response_ids, up.name, ctx.previous_response))
    if ctx.warm == "api":
        chosen.append(warm.WarmAnswer(gw.warmer, ctx, up.name))
    if not chosen:
        return None
    return chosen[0] if len(chosen) == 1 else Chain(chosen)
