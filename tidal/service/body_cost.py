"""What decoding a JSON body may cost, bounded before it is paid, and paid off the event loop.

Decoding JSON into Python objects costs per value, and most per container (a dict or a list, and
the cyclic GC's passes over them). msgspec decodes in C holding the GIL, so a worker thread alone
does not make a huge decode free for the event loop: 15 MiB of small values in a loosely typed
field (``chat_template_kwargs``, a tool's ``parameters``, ``metadata``) held it for seconds. So a
large body is first *scanned* as bytes (``scan``: numpy, which releases the GIL) on a worker
thread: its values and containers are counted and its depth measured outside strings, and it is
refused past ``MAX_JSON_VALUES`` or ``MAX_JSON_CONTAINERS`` (413) or ``json_depth.MAX_DEPTH`` (400)
before one object exists. What passes is decoded on that thread with the cyclic GC paused
(``decode``). A body under ``OFF_LOOP_BYTES`` cannot hold enough to matter and is decoded in place.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import trio

from tidal.errors import NESTED_TOO_DEEPLY, ApiError, bad_request
from tidal.service.json_depth import MAX_DEPTH
from tidal.tokenizer import rendered_size

T = TypeVar("T")

# Up to here a body decodes in well under a millisecond: on the event loop, no scan.
OFF_LOOP_BYTES = 64 << 10
# A 128k-token prompt as token ids is 131,072 values; a chat history, tools and schemas far fewer
# containers than this. At the bounds a decode holds the GIL ~0.1 s on a loaded 2-core host.
MAX_JSON_VALUES = 1 << 20
MAX_JSON_CONTAINERS = 1 << 16
_CHUNK = 1 << 20  # bytes scanned at once: numpy's temporaries stay ~20 MB per scan

_QUOTE, _COMMA = ord('"'), ord(",")
_OPENERS, _CLOSERS = (ord("["), ord("{")), (ord("]"), ord("}"))


@dataclass(frozen=True)
class JsonShape:
    """What a JSON text holds, counted outside its strings."""

    values: int  # at most this many: the root, and one per comma and per container
    containers: int  # objects and arrays
    depth: int


def scan(body: bytes) -> JsonShape:
    """Count ``body``'s values and containers and measure its depth, without decoding it.

    Linear in its bytes, in numpy (the GIL is released while it runs). Invalid JSON gets some
    shape; the decoder refuses it afterwards.
    """
    # an escaped quote or backslash is not a string's end: blank them out (they are never structure)
    text = np.frombuffer(body.replace(b"\\\\", b"__").replace(b'\\"', b"__"), dtype=np.uint8)
    in_string, depth, deepest, commas, containers = 0, 0, 0, 0, 0
    for start in range(0, len(text), _CHUNK):
        chunk = text[start:start + _CHUNK]
        quotes = chunk == _QUOTE
        outside = ((np.cumsum(quotes, dtype=np.int64) + in_string) & 1) == 0
        opens = ((chunk == _OPENERS[0]) | (chunk == _OPENERS[1])) & outside
        closes = ((chunk == _CLOSERS[0]) | (chunk == _CLOSERS[1])) & outside
        levels = np.cumsum(opens.astype(np.int32) - closes, dtype=np.int64) + depth
        if len(levels):
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
        commas += int(np.count_nonzero((chunk == _COMMA) & outside))
        containers += int(np.count_nonzero(opens))
        in_string = (in_string + int(np.count_nonzero(quotes))) & 1
    return JsonShape(values=1 + commas + containers, containers=containers, depth=deepest)


def check(body: bytes) -> None:
    """Refuse a body whose decode would cost more than the bounds allow: 413 or 400, naming the bound."""
    shape = scan(body)
    if shape.depth > MAX_DEPTH:
        raise bad_request(NESTED_TOO_DEEPLY)
    if shape.containers > MAX_JSON_CONTAINERS:
        raise ApiError(413, f"Request body holds too many JSON objects and arrays ({shape.containers}; "
                            f"the limit is {MAX_JSON_CONTAINERS}).", "invalid_request_error")
    if shape.values > MAX_JSON_VALUES:
        raise ApiError(413, f"Request body holds too many JSON values ({shape.values}; the limit is "
                            f"{MAX_JSON_VALUES}).", "invalid_request_error")


def is_large(body: bytes | str | dict) -> bool:
    """Whether work over ``body`` (JSON text, or a body a WebSocket message carried, decoded) belongs
    off the event loop."""
    if isinstance(body, dict):  # the tokenizer's measure: what a template could render of it
        return rendered_size(body, OFF_LOOP_BYTES) > OFF_LOOP_BYTES
    return len(body) >= OFF_LOOP_BYTES


async def decode(body: bytes | str | dict, decode_fn: Callable[[bytes | str | dict], T]) -> T:
    """``decode_fn(body)``: in place for a small body; for a large one, ``check`` (text) then the
    decode, on a worker thread with the cyclic GC paused. Cancellation waits for the thread."""
    if not is_large(body):
        return decode_fn(body)
    return await trio.to_thread.run_sync(_checked_decode, body, decode_fn)


def _checked_decode(body: bytes | str | dict, decode_fn: Callable[[bytes | str | dict], T]) -> T:
    if not isinstance(body, dict):
        check(body.encode() if isinstance(body, str) else bytes(body))
    with gc_paused():
        return decode_fn(body)


async def run(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a worker thread with the cyclic GC paused: the work on a large body after its
    decode (its messages as the template wants them). Cancellation waits for the thread."""
    return await trio.to_thread.run_sync(_gc_paused_call, fn, *args)


def _gc_paused_call(fn: Callable[..., T], *args) -> T:
    with gc_paused():
        return fn(*args)


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextmanager
def gc_paused():
    """The cyclic GC off while any caller is inside (it is process-wide; reference counting still
    frees everything). A decode makes its containers faster than a collection can pass over them."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()
