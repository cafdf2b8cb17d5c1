"""The OpenAI-compatible surface: which paths the gateway proxies and how each is routed.

Every endpoint is routed by the body's `model` (the core's model filter) with the same
streaming, limits, auth, health, retries and metrics. The prompt plugins (normalize,
prerender, ...) rewrite chat and completion prompts only. The Responses API keeps state on
the server that created a response (vLLM holds it in memory), so its reads and follow-ups go
back there: `ResponseStore` remembers response id -> upstream from the answers that pass
through. Native paths (SGLang's and TGI's /generate, llama.cpp's /completion) are proxied
only when listed under `passthrough:`; anything else is 404, never an open proxy.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from prefixgate.proxy.lru import LRU


@dataclass(frozen=True)
class Endpoint:
    path: str                   # the route, in aiohttp's syntax ({name} for a path part)
    method: str = "POST"
    body: str = "json"          # json | multipart (streamed through) | raw (passthrough) | none
    prompt: bool = False        # chat/completions: the prompt plugins' on_request hooks run
    responses: bool = False     # Responses API: pinned to / remembered for one upstream

    @property
    def replayable(self) -> bool:
        """Can a failed attempt be sent again elsewhere? Not an upload streamed through."""
        return self.body != "multipart"


ENDPOINTS = (
    Endpoint("/v1/chat/completions", prompt=True),
    Endpoint("/v1/completions", prompt=True),
    Endpoint("/v1/embeddings"),
    Endpoint("/v1/responses", responses=True),
    Endpoint("/v1/responses/{response_id}", method="GET", body="none", responses=True),
    Endpoint("/v1/responses/{response_id}/cancel", body="none", responses=True),
    Endpoint("/v1/rerank"),
    Endpoint("/rerank"),
    Endpoint("/v1/score"),
    Endpoint("/score"),
    Endpoint("/tokenize"),
    Endpoint("/detokenize"),
    Endpoint("/v1/moderations"),
    Endpoint("/v1/audio/transcriptions", body="multipart"),
    Endpoint("/v1/audio/translations", body="multipart"),
)


def passthrough(paths: list[str]) -> tuple[Endpoint, ...]:
    """`passthrough:` paths: POSTed bodies forwarded as they are (routed by a JSON `model`
    when the body has one)."""
    return tuple(Endpoint(p, body="raw") for p in paths)


# the first response id in a Responses API answer or stream (`response.created` comes first)
_STREAM_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')


class ResponseStore:
    """response id -> the name of the upstream that created it (bounded, least recent out)."""

    def __init__(self, capacity: int = 100_000):
        self.owners: LRU[str, str] = LRU(capacity)

    def owner(self, response_id: str) -> str | None:
        return self.owners.get(response_id)

    def learn_whole(self, body: bytes, upstream: str) -> None:
        try:
            answer = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return
        if isinstance(answer, dict) and isinstance(answer.get("id"), str):
            self.owners.put(answer["id"], upstream)

    def learn_stream(self, chunk: bytes, upstream: str) -> bool:
        """Look for the response id in a chunk of the event stream; True once found."""
        m = _STREAM_ID.search(chunk)
        if m is None:
            return False
        self.owners.put(m.group(1).decode("utf-8", "replace"), upstream)
        return True
