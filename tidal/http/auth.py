"""The API key, checked in one place for HTTP and WebSocket (``auth_error``).

A WebSocket handshake carries it in the ``Authorization`` header or in a subprotocol. A browser's ``WebSocket`` cannot send headers, so a page offers the key as the subprotocol
``tidal.bearer.<base64url of the key, unpadded>`` next to the plain ``tidal`` one (the same
trick Kubernetes uses for its bearer tokens); the server then accepts ``tidal``, so the key is
never echoed back.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from tidal.errors import ApiError

SUBPROTOCOL = "tidal"
_BEARER_PREFIX = "tidal.bearer."


def authorization(headers, subprotocols: list[str] = ()) -> str:  # type: ignore[assignment]
    """The ``Authorization`` header, or the one an ``x-api-key`` header (Anthropic's clients) or
    a WebSocket bearer subprotocol stands for."""
    header = headers.get("Authorization", "")
    if header:
        return header
    key = headers.get("x-api-key", "")
    if key:
        return "Bearer " + key
    for protocol in subprotocols:
        if protocol.startswith(_BEARER_PREFIX):
            encoded = protocol[len(_BEARER_PREFIX):]
            try:
                return "Bearer " + base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (binascii.Error, UnicodeDecodeError):
                return ""
    return ""


def accepted_subprotocol(subprotocols: list[str]) -> str | None:
    """The subprotocol to accept: a client that offers any must get one back, or it fails."""
    return SUBPROTOCOL if SUBPROTOCOL in subprotocols else None


def auth_error(api_key: str | None, authorization: str) -> ApiError | None:
    """The 401 for an ``Authorization`` header that does not carry ``api_key``; None if it does."""
    if api_key is None or hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
        return None
    return ApiError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                    "authentication_error", None, "invalid_api_key")
