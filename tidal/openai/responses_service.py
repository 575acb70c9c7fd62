"""``POST /v1/responses``: admit -> first output -> answer, with Responses' output items and typed events.

The request is translated to chat (tidal/openai/responses.py) and admitted by ``Api`` like any
chat request; the answer reads the same ``OutputReader`` (thinking split out by the reasoning
parser, tool calls read at the end) and turns its deltas into output items: a ``reasoning`` item,
a ``message`` item, then one ``function_call`` item per call. A stream (the one ``EventStream``, with ``ResponsesRenderer``) sends OpenAI's typed SSE
events in their order (``response.created``, ``response.in_progress``, per item
``response.output_item.added`` ... ``response.output_item.done``, ``response.completed`` with
usage). A disconnect cancels the handler; its request scope (tidal/registry/frontend.py) closes the
request, which frees its KV as for chat.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tidal.errors import ApiError
from tidal.openai import responses as shapes
from tidal.openai.response_store import ResponseStore
from tidal.service.api import Answer, Api, answer, error_answer, guarded
from tidal.service.decode import new_id, read_struct
from tidal.service.reader import OutputReader
from tidal.service.stream import Writer

_json_encode = msgspec.json.encode


class OutputItems:
    """The output items of one answer as its deltas come, and the events that tell them."""

    def __init__(self, response_id: str):
        self.response_id = response_id
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self._open: dict[str, Any] | None = None  # the item deltas go to now
        self._text: list[str] = []
        self.sequence_number = 0
        self.content = ""  # the message text, whole
        self.reasoning = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json_encode(obj) + b"\n\n"

    def feed(self, reasoning: str | None, text: str) -> bytes:
        out = b""
        if reasoning:
            out += self._delta("reasoning", reasoning)
            self.reasoning += reasoning
        if text:
            out += self._delta("message", text)
            self.content += text
        return out

    def _delta(self, kind: str, delta: str) -> bytes:
        out = b""
        if self._open is None or self._open["type"] != kind:
            out += self.close()
            index = len(self.items)
            if kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                        "status": "in_progress"}
                out += self.event("response.output_item.added", output_index=index, item=item)
                out += self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "reasoning_text", "text": ""})
            else:
                item = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []}
                out += self.event("response.output_item.added", output_index=index, item=item)
                out += self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []})
            self._open = item
        self._text.append(delta)
        kind_delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + self.event(kind_delta, item_id=self._open["id"], output_index=len(self.items),
                                content_index=0, delta=delta, **extra)

    def close(self) -> bytes:
        """End the open item (its done events); nothing if none is open."""
        item, self._open = self._open, None
        if item is None:
            return b""
        text, self._text, index = "".join(self._text), [], len(self.items)
        if item["type"] == "reasoning":
            done = shapes.reasoning_item(item["id"], text)
            part = done["content"][0]
            out = self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                             content_index=0, text=text)
        else:
            done = shapes.message_item(item["id"], text)
            part = done["content"][0]
            out = self.event("response.output_text.done", item_id=item["id"], output_index=index,
                             content_index=0, text=text, logprobs=[])
        out += self.event("response.content_part.done", item_id=item["id"], output_index=index,
                          content_index=0, part=part)
        self.items.append(done)
        return out + self.event("response.output_item.done", output_index=index, item=done)

    def calls(self, tool_calls: list[dict[str, Any]]) -> bytes:
        """The function_call items (known whole once the answer is over)."""
        out = self.close()
        for call in tool_calls:
            index, done = len(self.items), shapes.function_call_item(call)
            out += self.event("response.output_item.added", output_index=index,
                              item={**done, "arguments": "", "status": "in_progress"})
            out += self.event("response.function_call_arguments.delta", item_id=done["id"], output_index=index,
                              delta=done["arguments"])
            out += self.event("response.function_call_arguments.done", item_id=done["id"], output_index=index,
                              name=done["name"], arguments=done["arguments"])
            self.items.append(done)
            out += self.event("response.output_item.done", output_index=index, item=done)
        return out


class ResponsesService:
    """The Responses route's answers (a ``Route``: tidal/service/api.py), on the server's ``Api`` and a
    bounded response store."""

    def __init__(self, api: Api, store: ResponseStore | None = None):
        self.api = api
        self.store = store or ResponseStore()

    def error_answer(self, error: ApiError) -> Answer:
        return error_answer(error)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            error = shapes.not_found(response_id)
            error.param = None
            raise error
        return stored.response

    async def respond(self, body: bytes, scope: dict, writer: Writer | None) -> Answer:
        return await guarded(self._respond(body, scope, writer), error_answer, "responses")

    async def _respond(self, body: bytes, scope: dict, writer: Writer | None) -> Answer:
        request: shapes.ResponsesRequest = await read_struct(body, shapes.ResponsesRequest)
        self.api.adapters.resolve(request.model)  # 404 before anything else for an unknown model
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise shapes.not_found(request.previous_response_id)
            history = stored.conversation
        chat = shapes.chat_request(request, history)
        if request.model is not None:
            chat["model"] = request.model  # the base model or the LoRA adapter it names
        try:
            active, checked = await self.api.admit("chat", chat, self.api.timeline(scope))
        except ApiError as error:
            error.param = shapes.response_param(error.param)
            raise
        reader = await self.api.first_output(active, checked)
        conversation = [m for m in chat["messages"] if not (request.instructions and m is chat["messages"][0])]
        renderer = ResponsesRenderer(self, shapes.ResponseShape(request, self.api.served_name(active)), conversation)
        return await answer(reader, renderer, renderer, bool(request.stream), writer)

    def _finish(self, reader: OutputReader, shape: shapes.ResponseShape, items: OutputItems,
                conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The complete response object; stored when the request asked for it."""
        usage = shapes.usage(reader.request.num_prompt_tokens, reader.num_tokens, reader.num_cached_tokens)
        response = shape.body("completed", items.items, usage, reader.finish_reason)
        if shape.request.store:
            turn: dict[str, Any] = {"role": "assistant", "content": items.content}
            if reader.tool_calls:
                turn["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in reader.tool_calls]
            self.store.put(response, conversation + [turn])
        return response


class ResponsesRenderer:
    """One response's typed events (tidal/service/stream.py's ``Renderer``) and its whole object (its
    ``Collector``)."""

    content_frame = None

    def __init__(self, service: ResponsesService, shape: shapes.ResponseShape, conversation: list[dict[str, Any]]):
        self.service = service
        self.shape = shape
        self.conversation = conversation
        self.items = OutputItems(shape.id)

    def opening(self, reader: OutputReader) -> bytes:
        in_progress = self.shape.body("in_progress", [])
        return (self.items.event("response.created", response=in_progress)
                + self.items.event("response.in_progress", response=in_progress))

    def frames(self, reader: OutputReader, text: str) -> bytes:
        return self.items.feed(reader.take_reasoning(), text)

    def closing(self, reader: OutputReader) -> bytes:
        frames = self.items.calls(reader.tool_calls or [])
        response = self.service._finish(reader, self.shape, self.items, self.conversation)
        # always response.completed (an answer cut by max_output_tokens says status "incomplete"
        # inside): the openai SDK's stream helper ends only on it
        return frames + self.items.event("response.completed", response=response)

    def error_frame(self, error: ApiError) -> bytes:
        return self.items.event("error", code=str(error.code), message=error.message, param=error.param)

    add = frames

    def answer(self, reader: OutputReader) -> dict[str, Any]:
        self.items.calls(reader.tool_calls or [])
        return self.service._finish(reader, self.shape, self.items, self.conversation)
