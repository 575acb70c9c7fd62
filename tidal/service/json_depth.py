"""The one depth-bounded JSON reader: every nested value a request carries or a model writes.

Request bodies, strings that hold JSON (``guided_json``, a tool call's ``arguments``), schemas,
tool parameters and model output parsed as JSON (tool calls) all pass through here before any
recursive code sees them (msgspec, ``json``, ``json.dumps``, the chat template, the grammar
compiler): deeper than ``MAX_DEPTH`` is ``TooDeep`` (a ValueError), which callers answer with a
400, never a RecursionError that escapes as a 500 or kills a connection.

Text is decoded by msgspec (C; its own guard turns a depth near the recursion limit into TooDeep)
and the value walked without recursion: the cost is the number of containers, not of characters,
so a 1 MB prompt string costs nothing. Only model output that holds several values (parsed with
``json.JSONDecoder.raw_decode``, tool-call formats) is scanned as text first.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

# Deeper than any schema, message list or tool call a client writes (a JSON schema rarely passes
# 20), and far below Python's recursion limit (1000) that json, jinja and msgspec run into.
MAX_DEPTH = 128
TOO_DEEP = f"it is nested too deeply (the limit is {MAX_DEPTH} levels)"

# a whole string (escapes included) or one bracket: strings are skipped in one match
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.S)  # unrolled: ~1 ns a character
_OPEN = frozenset("[{")


class TooDeep(ValueError):
    def __init__(self, what: str = "JSON"):
        super().__init__(f"{what} is not accepted: {TOO_DEEP}")


def check_text(text: str | bytes, what: str = "JSON") -> None:
    """Raise TooDeep if the JSON (or JSON-like) text nests deeper than MAX_DEPTH (a Python scan:
    for short texts such as a model's output)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "replace")
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return  # cannot be too deep: skip the scan
    depth = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in _OPEN:
            depth += 1
            if depth > MAX_DEPTH:
                raise TooDeep(what)
        elif token in "]}" and len(token) == 1:
            depth -= 1


def check(value: Any, what: str = "JSON") -> Any:
    """Return ``value`` (decoded JSON or msgspec structs) if it nests at most MAX_DEPTH; else TooDeep."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        elif isinstance(item, msgspec.Struct):
            children = [getattr(item, name) for name in item.__struct_fields__]
        else:
            continue
        if depth >= MAX_DEPTH:
            raise TooDeep(what)
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list, tuple, msgspec.Struct)))
    return value


def loads(text: str | bytes, what: str = "JSON") -> Any:
    """``json.loads`` that refuses depth past MAX_DEPTH (TooDeep) and invalid JSON (ValueError)."""
    try:
        return check(msgspec.json.decode(text), what)
    except RecursionError:
        raise TooDeep(what) from None


def values(text: str, separators: str = " \t\r\n;,") -> list[Any]:
    """Consecutive JSON values in ``text`` (separated by ``separators``), depth-bounded like ``loads``."""
    check_text(text)
    decoder = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i == len(text):
            return out
        value, i = decoder.raw_decode(text, i)
        out.append(value)
