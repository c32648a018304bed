"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, for every error the server answers."""
from __future__ import annotations

import json

from starlette.responses import Response

# OpenAI's error types by status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """A request the server refuses: its status, a message naming what is wrong, and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ERROR_TYPES.get(status, "invalid_request_error")


def field_error(e: ValueError, fields) -> APIError:
    """The 400 of an engine's or SamplingParams' ValueError, naming the field its message begins with ("seed must
    be ...", "eviction: ...") where it is one of `fields`."""
    field = str(e).split(" ", 1)[0].rstrip(":")
    return APIError(400, str(e), field if field in fields else None)


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> bytes:
    """The JSON of an error. ASCII-escaped: a message that quotes the request (a lone surrogate
    included) always encodes."""
    kind = kind or ERROR_TYPES.get(status, "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


def error_response(error: APIError, close: bool = False) -> Response:
    """The error as a response; `close` ends the connection after it (a body left unread)."""
    headers = {"connection": "close"} if close else None
    return Response(error_body(error.status, error.message, error.param, error.kind), error.status,
                    headers=headers, media_type="application/json")


async def send_error(scope, receive, send, error: APIError, close: bool = False) -> None:
    """Answer an ASGI request with the error (for middleware, which runs outside the app's handlers)."""
    await error_response(error, close)(scope, receive, send)
