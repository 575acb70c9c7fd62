"""A request body into its typed shape, for every API: one decode, one set of shared bounds.

``decode_struct`` turns JSON (or a dict) into a msgspec Struct, depth-bounded first, and answers a
bad body with a 400 naming the field; a number out of its bounds is answered with the bound's own
description (``bounded``). The fields more than one API shares are typed here once.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tidal.errors import NESTED_TOO_DEEPLY, bad_request
from tidal.service import body_cost, json_depth
from tidal.wire import INT32_MAX

__all__ = ["INT32_MAX", "Metadata", "Temperature", "TopP", "bounded", "decode_struct", "new_id", "read_struct"]


# Every number a request carries, bounded once, here: what OpenAI allows where it says, and never
# more than the wire and the engine hold (tidal/wire.py), so nothing accepted can fail to encode.
# A value out of bounds is a 400 whose message is the bound's description (``parse_body``).
def bounded(base: type, description: str, **bounds: Any) -> Any:
    return Annotated[base, Meta(description=description, **bounds)]


Temperature = bounded(float, "temperature must be between 0 and 2", ge=0.0, le=2.0)  # OpenAI's (chat, Responses)
TopP = bounded(float, "top_p must be in (0, 1]", gt=0.0, le=1.0)
# OpenAI's bounds on metadata (Responses; Anthropic's Messages take the same): it is kept with a stored
# response, so what it may hold is bounded
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
METADATA_BOUND = (f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY_CHARS} "
                  f"characters and string values of at most {MAX_METADATA_VALUE_CHARS}")
Metadata = Annotated[dict[Annotated[str, Meta(max_length=MAX_METADATA_KEY_CHARS)],
                          Annotated[str, Meta(max_length=MAX_METADATA_VALUE_CHARS)]],
                     Meta(max_length=MAX_METADATA_PAIRS, description=METADATA_BOUND)]


def new_id(prefix: str, hex_digits: int = 32) -> str:
    """A response, item or message id: ``prefix_`` and random hex."""
    return f"{prefix}_{uuid.uuid4().hex[:hex_digits]}"


_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def _error_param(text: str) -> str | None:
    """The offending field's path from msgspec's message; a missing field's path includes its name."""
    # "... - at `$.a.b`", or for a mapping's key "... - at `key` in `$.a`"
    path = re.split(r"(?:at|in) `\$", text)[-1].rstrip("`").lstrip(".") if re.search(r"(?:at|in) `\$", text) else ""
    path = path.replace("[...]", "")  # msgspec's "some value of this mapping": the mapping is the field
    missing = _MISSING_FIELD.search(text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


async def read_struct(body: bytes | dict, struct: type | msgspec.json.Decoder) -> Any:
    """``decode_struct`` for a route's body: a large one is scanned first (413/400 past the bounds of
    tidal/service/body_cost.py) and decoded on a worker thread. Every route's body goes through here."""
    return await body_cost.decode(body, lambda raw: decode_struct(raw, struct))


def decode_struct(body: bytes | dict, struct: type | msgspec.json.Decoder) -> Any:
    """A body (JSON bytes, or a dict already decoded) as ``struct`` (a Struct, or a Decoder of
    one); a 400 naming the offending field otherwise. Every route's body goes through here.

    Everything nested in it (tool parameters, schemas, earlier tool calls) is depth-bounded here,
    before any recursive code sees it (tidal/service/json_depth.py); a number out of its bounds is
    answered with the bound's own description.
    """
    request_type = struct.type if isinstance(struct, msgspec.json.Decoder) else struct
    try:
        if isinstance(body, dict):
            json_depth.check(body)
            return msgspec.convert(body, struct)  # type: ignore[arg-type]
        if isinstance(struct, msgspec.json.Decoder):
            return json_depth.check(struct.decode(body))
        return json_depth.check(msgspec.json.decode(body, type=struct))
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = _error_param(text)
        raise bad_request(_bound_message(request_type, param, text), param) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from None
    except (json_depth.TooDeep, RecursionError):  # no field of ours nests that deep
        raise bad_request(NESTED_TOO_DEEPLY) from None


_BOUND_VIOLATION = re.compile(r"Expected `[^`]*` (?:[<>]=?|of length)|Number out of range")


def _bound_message(request_type: type, param: str | None, text: str) -> str:
    """msgspec's message, or for a value out of its bounds the bound's own description."""
    if param is None or not _BOUND_VIOLATION.search(text):
        return f"Invalid request: {text}"
    name = re.split(r"[.\[]", param, maxsplit=1)[0]
    field = next((f for f in msgspec.inspect.type_info(request_type).fields if f.name == name), None)
    description = _description(field.type) if field is not None else None
    return f"Invalid request: {description}" if description else f"Invalid request: {text}"


def _description(info: Any) -> str | None:
    """The first bound description in a field's type (a union's or a list's member)."""
    if isinstance(info, msgspec.inspect.Metadata):
        return (info.extra_json_schema or {}).get("description") or _description(info.type)
    for inner in getattr(info, "types", ()) or ((info.item_type,) if hasattr(info, "item_type") else ()):
        found = _description(inner)
        if found:
            return found
    return None
