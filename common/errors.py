"""OpenAI-shaped errors: every failure a client sees is `{"error": {"message", "type", "code"}}`."""
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

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        headers = {**self.headers, **(extra_headers or {})}
        return web.Response(status=self.status, text=json.dumps(self.payload()),
                            content_type="application/json", headers=headers)

    def sse_event(self) -> bytes:
        """The error as one SSE event, for failures after a stream has started."""
        return b"data: " + json.dumps(self.payload()).encode() + b"\n\n"
