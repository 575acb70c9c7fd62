"""Anthropic's error shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

Every layer raises ``ApiError`` (OpenAI's shape); the Messages route answers the same error in
Anthropic's shape, its ``type`` chosen by status as Anthropic's API does.
"""

from __future__ import annotations

import msgspec

from tidal.errors import ApiError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(error: ApiError) -> dict:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def error_json(error: ApiError) -> bytes:
    return msgspec.json.encode(error_body(error))


def error_answer(error: ApiError) -> tuple[int, dict[str, str], bytes]:
    return error.status, {"Content-Type": "application/json", **error.headers}, error_json(error)
