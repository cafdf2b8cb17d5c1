"""The API surface: which paths the gateway proxies and how each is routed — OpenAI's and
Anthropic's Messages API (`/v1/messages`: coding agents such as Claude Code speak only it).

Every endpoint is routed by the body's `model` (the core's model filter) with the same
streaming, limits, auth, health, retries and metrics. The prompt plugins (normalize,
prerender, ...) rewrite chat and completion prompts only. The Responses API keeps state on
the server that created a response (vLLM holds it in memory), so its reads and follow-ups go
back there: the ids the client sees name their upstream (response_ids.py). Native paths
(SGLang's and TGI's /generate, llama.cpp's /completion) are proxied only when listed under
`passthrough:`; anything else is 404, never an open proxy.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    path: str                   # the route, in aiohttp's syntax ({name} for a path part)
    method: str = "POST"
    body: str = "json"          # json | multipart (streamed through) | raw (passthrough) | none
    prompt: bool = False        # chat/completions: the prompt plugins' on_request hooks run
    responses: bool = False     # Responses API: pinned to / remembered for one upstream
    api: str = "openai"         # the client's API: its error shape, its stream's events

    @property
    def replayable(self) -> bool:
        """Can a failed attempt be sent again elsewhere? Not an upload streamed through."""
        return self.body != "multipart"


COMPLETIONS = Endpoint("/v1/completions", prompt=True)
MESSAGES = Endpoint("/v1/messages", prompt=True, api="anthropic")
ENDPOINTS = (
    Endpoint("/v1/chat/completions", prompt=True),
    COMPLETIONS,
    MESSAGES,
    Endpoint("/v1/messages/count_tokens", api="anthropic"),
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
    when the body has one); a path the gateway serves itself (/v1/messages, once only a
    passthrough path) is served as its own endpoint."""
    own = {e.path for e in ENDPOINTS}
    return tuple(Endpoint(p, body="raw") for p in paths if p not in own)
