"""JSON errors in the client's API's shape: OpenAI's `{"error": {"message", "type", "code"}}`
everywhere, Anthropic's `{"type": "error", "error": {"type", "message"}}` on the Messages API
(`/v1/messages...`), with the error types each API uses for a status."""
from __future__ import annotations

import json

from aiohttp import web

# status -> OpenAI error type, as the OpenAI API and vLLM report them
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# status -> Anthropic error type (its API's documented set; the status itself is kept)
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)      # the Messages API and its count_tokens


def shape_for(path: str) -> str:
    """The error shape of a request to `path`: "anthropic" or "openai"."""
    return "anthropic" if path.startswith(ANTHROPIC_PATHS) else "openai"


class HTTPError(Exception):
    """Raised anywhere in request handling (plugins too); turned into a JSON error response."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def payload(self, shape: str = "openai") -> dict:
        if shape == "anthropic":
            kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if
                                        self.status < 500 else "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def response(self, extra_headers: dict[str, str] | None = None,
                 shape: str = "openai") -> web.Response:
        headers = {**self.headers, **(extra_headers or {})}
        return web.Response(status=self.status, text=json.dumps(self.payload(shape)),
                            content_type="application/json", headers=headers)

    def sse_event(self, shape: str = "openai") -> bytes:
        """The error as one SSE event, for failures after a stream has started (Anthropic's
        names its event `error`)."""
        data = json.dumps(self.payload(shape)).encode()
        return (b"event: error\ndata: " if shape == "anthropic" else b"data: ") + data + b"\n\n"
