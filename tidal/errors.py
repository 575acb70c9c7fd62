"""The one error type every layer raises: a real HTTP status and OpenAI's error JSON.

On the ground floor so that any layer (tokenizer, HTTP, OpenAI shapes, engine boundary) can raise
it without importing the layers above.
"""

from __future__ import annotations

from typing import Any

import msgspec

_json_encode = msgspec.json.encode

NESTED_TOO_DEEPLY = "Request body is not valid JSON: it is nested too deeply"


class ApiError(Exception):
    """An error answered with a real HTTP status and OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return _json_encode(self.body())


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def internal_error(exc: BaseException) -> ApiError:
    """What one request's error boundary answers for a bug: a 500 in the API's shape, for that request only."""
    return ApiError(500, f"Internal server error: {type(exc).__name__}", "server_error")


def context_too_long(max_model_len: int, however: str, param: str | None) -> ApiError:
    """The 400 for a request that does not fit the context window, in OpenAI's (and vLLM's) words;
    ``however`` says by how much, ending with what to reduce."""
    return bad_request(f"This model's maximum context length is {max_model_len} tokens. However, {however}", param)
