"""``POST /v1/messages``: admit -> first output -> answer, with Anthropic's content blocks and events.

The request is translated to chat (tidal/anthropic/messages.py) and admitted by ``Api`` like any
chat request; the answer reads the same ``OutputReader``. A stream (the one ``EventStream``, with ``MessagesRenderer``) sends Anthropic's events in
their order: ``message_start``; per block ``content_block_start``, ``content_block_delta``
(``thinking_delta``, ``text_delta``, ``input_json_delta``), ``content_block_stop``; then
``message_delta`` (stop reason, output tokens) and ``message_stop``. Errors are Anthropic's
shape (tidal/anthropic/errors.py). A disconnect closes the request as for chat (the handler's RequestScope,
tidal/registry/frontend.py).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tidal.anthropic import errors
from tidal.anthropic import messages as shapes
from tidal.errors import ApiError
from tidal.service.api import Answer, Api, answer, guarded
from tidal.service.decode import new_id, read_struct
from tidal.service.reader import OutputReader
from tidal.service.stream import Writer

_json_encode = msgspec.json.encode


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json_encode({"type": kind, **fields}) + b"\n\n"


class ContentBlocks:
    """The content blocks of one answer as its deltas come, and the events that tell them."""

    def __init__(self):
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the block deltas go to now ("thinking", "text")
        self._parts: list[str] = []

    def feed(self, reasoning: str | None, text: str) -> bytes:
        out = b""
        if reasoning:
            out += self._delta("thinking", reasoning)
        if text:
            out += self._delta("text", text)
        return out

    def _delta(self, kind: str, delta: str) -> bytes:
        out = b""
        if self._open != kind:
            out += self.close()
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            out += _event("content_block_start", index=len(self.blocks), content_block=start)
            self._open = kind
        self._parts.append(delta)
        body = {"type": "thinking_delta", "thinking": delta} if kind == "thinking" \
            else {"type": "text_delta", "text": delta}
        return out + _event("content_block_delta", index=len(self.blocks), delta=body)

    def close(self) -> bytes:
        kind, self._open = self._open, None
        if kind is None:
            return b""
        text, self._parts = "".join(self._parts), []
        block = {"type": "thinking", "thinking": text, "signature": ""} if kind == "thinking" \
            else {"type": "text", "text": text}
        out = b""
        if kind == "thinking":  # the SDK expects a signature on every thinking block
            out += _event("content_block_delta", index=len(self.blocks), delta={"type": "signature_delta",
                                                                               "signature": ""})
        self.blocks.append(block)
        return out + _event("content_block_stop", index=len(self.blocks) - 1)

    def calls(self, tool_calls: list[dict[str, Any]]) -> bytes:
        out = self.close()
        for call in tool_calls:
            block = shapes.tool_use_block(call)
            index = len(self.blocks)
            out += _event("content_block_start", index=index, content_block={**block, "input": {}})
            out += _event("content_block_delta", index=index, delta={"type": "input_json_delta",
                                                                     "partial_json": json.dumps(block["input"])})
            self.blocks.append(block)
            out += _event("content_block_stop", index=index)
        return out


class MessagesService:
    """The Messages route's answers (a ``Route``: tidal/service/api.py), in Anthropic's shapes."""

    def __init__(self, api: Api):
        self.api = api

    def error_answer(self, error: ApiError) -> Answer:
        return errors.error_answer(error)

    def _message(self, message_id: str, content: list[dict[str, Any]], reader: OutputReader,
                 done: bool) -> dict[str, Any]:
        reason, sequence = (shapes.stop_reason(reader.finish_reason, reader.stop_reason, bool(reader.tool_calls))
                            if done else (None, None))
        return {"id": message_id, "type": "message", "role": "assistant", "model": self.api.served_name(reader.request),
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": shapes.usage(reader.request.num_prompt_tokens, reader.num_tokens if done else 0,
                                      reader.num_cached_tokens)}

    async def respond(self, body: bytes, scope: dict, writer: Writer | None) -> Answer:
        return await guarded(self._respond(body, scope, writer), errors.error_answer, "messages")

    async def _respond(self, body: bytes, scope: dict, writer: Writer | None) -> Answer:
        request: shapes.MessagesRequest = await read_struct(body, shapes.MessagesRequest)
        self.api.adapters.resolve(request.model)  # the base model or a LoRA adapter: 404 first for any other
        active, checked = await self.api.admit("chat", {**shapes.chat_request(request), "model": request.model},
                                               self.api.timeline(scope))
        reader = await self.api.first_output(active, checked)
        renderer = MessagesRenderer(self, new_id("msg", 24))
        return await answer(reader, renderer, renderer, bool(request.stream), writer)


class MessagesRenderer:
    """One message's events (tidal/service/stream.py's ``Renderer``) and the whole message (its
    ``Collector``)."""

    content_frame = None

    def __init__(self, service: MessagesService, message_id: str):
        self.service = service
        self.message_id = message_id
        self.blocks = ContentBlocks()

    def opening(self, reader: OutputReader) -> bytes:
        return _event("message_start", message=self.service._message(self.message_id, [], reader, done=False))

    def frames(self, reader: OutputReader, text: str) -> bytes:
        return self.blocks.feed(reader.take_reasoning(), text)

    def closing(self, reader: OutputReader) -> bytes:
        frames = self.blocks.calls(reader.tool_calls or [])
        reason, sequence = shapes.stop_reason(reader.finish_reason, reader.stop_reason, bool(reader.tool_calls))
        frames += _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                         usage={"output_tokens": reader.num_tokens})
        return frames + _event("message_stop")

    def error_frame(self, error: ApiError) -> bytes:
        return _event("error", error=errors.error_body(error)["error"])

    add = frames

    def answer(self, reader: OutputReader) -> dict[str, Any]:
        self.blocks.calls(reader.tool_calls or [])
        return self.service._message(self.message_id, self.blocks.blocks, reader, done=True)
