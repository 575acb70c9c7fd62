"""OpenAI's chat and completions answers: stream chunks (SSE frames or WebSocket payloads), SSE framing,
and the renderer that makes them of a reader's deltas (``ChatRenderer``, for tidal/service/stream.py).

The streaming hot path builds each SSE frame from a prefix prepared once per request plus the
JSON-encoded text, so a frame costs one small ``msgspec.json.encode`` and a bytes join.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from tidal.errors import ApiError
from tidal.service.reader import OutputReader, usage

__all__ = ["SSE_DONE", "ChatRenderer", "ChunkEncoder", "sse", "usage"]

_json_encode = msgspec.json.encode


class ChunkEncoder:
    """Builds one request's stream chunks (SSE frames or WebSocket payload objects)."""

    def __init__(self, kind: Literal["chat", "completions"], model: str, index: int = 0,
                 same_response_as: "ChunkEncoder | None" = None):
        self.kind = kind
        self.index = index  # the choice (n > 1); its encoders share the response's id and time
        if same_response_as is not None:
            self.id, self.created = same_response_as.id, same_response_as.created
        else:
            self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
            self.created = int(time.time())
        self.model = model
        head = {"id": self.id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": self.created, "model": model}
        self._head = _json_encode(head)[:-1]  # without the closing brace
        if kind == "chat":
            self._first = self._head + b',"choices":[{"index":%d,"delta":{"role":"assistant","content":' % index
            self._next = self._head + b',"choices":[{"index":%d,"delta":{"content":' % index
            self._mid = b'},"logprobs":'
        else:
            self._first = self._next = self._head + b',"choices":[{"index":%d,"text":' % index
            self._mid = b',"logprobs":'
        self._sent_first = False
        # the SSE frame of a chunk with content only, around the JSON text (``content_frame``)
        self._first_frame, self._next_frame = b"data: " + self._first, b"data: " + self._next
        self._content_tail = self._mid + b'null,"finish_reason":null}]}\n\n'

    def content_frame(self, text: str) -> bytes:
        """``sse(chunk_json(text, None))`` in one step: a non-final chunk without logprobs or tool
        calls, as the engine reader task sends one per token for a caught-up stream."""
        prefix = self._next_frame if self._sent_first else self._first_frame
        self._sent_first = True
        return prefix + _json_encode(text) + self._content_tail

    def chunk_json(self, text: str, finish_reason: str | None, logprobs: Any = None,
                   tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> bytes:
        """One chunk as JSON bytes: the first chat chunk also carries the role."""
        if tool_calls or reasoning:
            return self._delta_chunk(text, finish_reason, logprobs, tool_calls, reasoning)
        prefix = self._next if self._sent_first else self._first
        self._sent_first = True
        reason = b"null" if finish_reason is None else _json_encode(finish_reason)
        lp = b"null" if logprobs is None else _json_encode(logprobs)
        return prefix + _json_encode(text) + self._mid + lp + b',"finish_reason":' + reason + b"}]}"

    def _delta_chunk(self, text: str, finish_reason: str | None, logprobs: Any,
                     tool_calls: list[dict[str, Any]] | None, reasoning: str | None) -> bytes:
        """A chat chunk that carries thinking (``reasoning_content``) or the message's tool calls
        (whole: name and all arguments)."""
        delta: dict[str, Any] = {} if self._sent_first else {"role": "assistant"}
        self._sent_first = True
        delta["content"] = text or None
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._head + b',"choices":[' + _json_encode(choice) + b"]}"

    def usage_json(self, usage_obj: dict[str, Any]) -> bytes:
        return self._head + b',"choices":[],"usage":' + _json_encode(usage_obj) + b"}"

    def full_response(self, text: str, finish_reason: str | None, usage_obj: dict[str, Any],
                      stop_reason: str | int | None, logprobs: Any = None,
                      tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["content"] = text or None
                message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in tool_calls]
            choice = {"index": self.index, "message": message, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            obj = "chat.completion"
        else:
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage_obj}


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ChatRenderer:
    """Chat and completions chunks as SSE frames (tidal/service/stream.py's ``Renderer``), and the whole
    response object (its ``Collector``). ``frame`` frames one chunk's JSON: the WebSocket's is its own."""

    def __init__(self, encoder: ChunkEncoder, include_usage: bool):
        self.encoder = encoder
        self.include_usage = include_usage
        self.content_frame = encoder.content_frame
        self._parts: list[str] = []

    def frame(self, chunk: bytes) -> bytes:
        return sse(chunk)

    def opening(self, reader: OutputReader) -> bytes:
        return b""

    def frames(self, reader: OutputReader, text: str) -> bytes:
        finish = reader.finish_reason
        reasoning = reader.take_reasoning()
        if finish is None and not text and not reasoning:
            return b""  # e.g. text held back by the stop-string check: nothing to say yet
        return self.frame(self.encoder.chunk_json(text, finish, reader.take_logprobs(), reader.tool_calls, reasoning))

    def closing(self, reader: OutputReader) -> bytes:
        if self.include_usage:
            return sse(self.encoder.usage_json(reader.usage())) + SSE_DONE
        return SSE_DONE

    def error_frame(self, error: ApiError) -> bytes:
        return sse(error.json()) + SSE_DONE

    def add(self, reader: OutputReader, text: str) -> None:
        self._parts.append(text)

    def answer(self, reader: OutputReader) -> dict[str, Any]:
        return self.encoder.full_response("".join(self._parts), reader.finish_reason, reader.usage(),
                                          reader.stop_reason, reader.take_logprobs(), reader.tool_calls,
                                          reader.take_reasoning())
