"""Tool calls: the grammar a forced call is generated under, and parsers of model formats.

``tool_choice`` "required" or a named function is grammar-constrained (any model, no server
flag): a named function's output is its arguments object; "required" produces a JSON array of
``{"name", "arguments"}`` objects. ``tool_choice`` "auto" leaves the model free and parses its
own format, chosen with ``--tool-call-parser``:

- ``hermes`` (Qwen2/Qwen2.5/Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  repeated for parallel calls; text before the first tag is the message content.
- ``llama3_json`` (Llama 3.1+): the whole message is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

``ToolCallStream`` turns the text stream into content deltas plus, at the end, the calls:
content streams as it comes until a call may have started; from there text is held and parsed
once the request finishes (text that does not parse is returned as content, nothing is lost).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tidal.errors import ApiError
from tidal.service import json_depth

PARSERS = ("hermes", "llama3_json", "mistral")
# Calls in one "required" answer (a finite language: a random-weight model must still finish)
MAX_PARALLEL_TOOL_CALLS = 16
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def to_openai(self, index: int) -> dict[str, Any]:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(name: Any, arguments: Any) -> ToolCall:
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a name")
    if arguments is None:
        arguments = {}
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, "call_" + uuid.uuid4().hex[:24])


# ------------------------------------------------------------------ forced calls (grammar)


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON schema of the output under tool_choice "required": an array of calls."""
    variants = [{
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, "arguments": tool.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for tool in tools]
    return {"type": "array", "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
            "minItems": 1, "maxItems": MAX_PARALLEL_TOOL_CALLS if parallel else 1}


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of the output under a named tool_choice: that function's arguments."""
    return tool.get("parameters") or {"type": "object"}


def parse_forced(text: str, named: str | None) -> list[ToolCall]:
    """The calls in grammar-constrained output (raises ValueError if it is incomplete)."""
    value = json_depth.loads(text, "the tool call")
    if named is not None:
        return [_call(named, value)]
    return [_call(item["name"], item["arguments"]) for item in value]


# ------------------------------------------------------------------ model formats (auto)


def parse_model_output(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole message in the ``parser`` format; no calls if there are none.

    Raises ValueError when the text starts a call that does not parse.
    """
    if parser == "hermes":
        marker = _MARKERS["hermes"]
        start = text.find(marker)
        if start < 0:
            return text, []
        calls = []
        for part in text[start:].split(marker)[1:]:
            body = part.split("</tool_call>", 1)[0]
            value = json_depth.loads(body, "the tool call")
            calls.append(_call(value.get("name"), value.get("arguments", value.get("parameters"))))
        return text[:start].strip(), calls
    if parser == "mistral":
        marker = _MARKERS["mistral"]
        start = text.find(marker)
        if start < 0:
            return text, []
        calls = []
        for value in json_depth.values(text[start + len(marker):]):
            for item in value if isinstance(value, list) else [value]:
                calls.append(_call(item.get("name"), item.get("arguments", item.get("parameters"))))
        return text[:start].strip(), calls
    if parser == "llama3_json":
        body = text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG):]
        if not body.startswith("{"):
            return text, []
        calls = [_call(v.get("name"), v.get("parameters", v.get("arguments"))) for v in json_depth.values(body)]
        return "", calls
    raise ValueError(f"unknown tool call parser {parser!r}")


class ToolCallStream:
    """One request's text -> content deltas, and its tool calls at the end.

    ``forced`` ("required" or a function name) means the whole output is a constrained call;
    else ``parser`` names the model's format (tool_choice "auto").
    """

    def __init__(self, parser: str | None = None, forced: str | None = None, named: bool = False):
        self.parser = parser
        self.forced = forced
        self.named = named
        self._held = ""  # text that may be (part of) a call
        self._in_call = forced is not None
        self._decided = parser != "llama3_json"  # llama3_json decides on the first non-blank text

    def feed(self, text: str) -> str:
        """The content this text releases (possibly empty: held as a possible call)."""
        if self._in_call:
            self._held += text
            return ""
        held = self._held + text
        if not self._decided:
            stripped = held.lstrip()
            if not stripped or _PYTHON_TAG.startswith(stripped[:len(_PYTHON_TAG)]) and len(stripped) < len(_PYTHON_TAG):
                self._held = held
                return ""
            self._decided = True
            if stripped.startswith("{") or stripped.startswith(_PYTHON_TAG):
                self._in_call, self._held = True, held
                return ""
            self._held = ""
            self.parser = None  # plain content from here on
            return held
        marker = _MARKERS.get(self.parser or "")
        if marker is None:
            self._held = ""
            return held
        start = held.find(marker)
        if start >= 0:
            self._in_call, self._held = True, held[start:]
            return held[:start]
        keep = _partial_suffix(held, marker)  # a marker may be arriving split across deltas
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(remaining content, calls) once the request is over."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        try:
            if self.forced is not None:
                return "", parse_forced(held, self.forced if self.named else None)
            content, calls = parse_model_output(self.parser, held)  # type: ignore[arg-type]
            return content, calls
        except json_depth.TooDeep as exc:  # the request ends with this error, not a cut stream
            raise ApiError(400, f"The model's output is not a usable tool call: {exc}", "invalid_request_error",
                           "tools") from None
        except (ValueError, KeyError, TypeError, AttributeError):
            return held, []  # not a call after all (or cut off by max_tokens): keep it as text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
