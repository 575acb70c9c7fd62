"""The API key of a WebSocket handshake: the ``Authorization`` header, or a subprotocol.

A browser's ``WebSocket`` cannot send headers, so a page offers the key as the subprotocol
``tidal.bearer.<base64url of the key, unpadded>`` next to the plain ``tidal`` one (the same
trick Kubernetes uses for its bearer tokens); the server then accepts ``tidal``, so the key is
never echoed back.
"""

from __future__ import annotations

import base64
import binascii

SUBPROTOCOL = "tidal"
_BEARER_PREFIX = "tidal.bearer."


def authorization(headers, subprotocols: list[str]) -> str:
    """The handshake's ``Authorization`` header, or the one its bearer subprotocol stands for."""
    header = headers.get("Authorization", "")
    if header:
        return header
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
