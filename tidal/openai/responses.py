"""OpenAI's Responses API (``POST /v1/responses``): its request and response shapes, over chat.

A Responses request becomes a chat request (``chat_request``): ``instructions`` the system
turn, the stored conversation of ``previous_response_id`` next, then the ``input`` items as chat
messages (``function_call`` items an assistant turn's tool calls, ``function_call_output`` items
tool turns); function tools, ``tool_choice``, ``text.format`` and the sampling fields map to
their chat twins. So it is admitted, bounded, constrained and cancelled as every chat request
is (tidal/service/api.py); this module only translates, and builds the answer's output items.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec

from tidal.errors import ApiError, bad_request
from tidal.service.decode import INT32_MAX, Metadata, Temperature, TopP, bounded, new_id

MAX_INPUT_ITEMS = 1024
# Every number in the body bounded in its type (so /openapi.json and its fuzzer see the bounds)
MaxOutputTokens = bounded(int, "max_output_tokens must be between 1 and 2^31-1", ge=1, le=INT32_MAX)
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1, description="seed must be a 64-bit signed integer")]


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One ``input`` item: a message (``type`` "message" or absent), a ``function_call``, a
    ``function_call_output`` or an earlier ``reasoning`` item (their fields in one struct)."""

    type: str | None = None
    role: str | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningOptions(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[InputItem], msgspec.Meta(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: MaxOutputTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None  # an extension (vLLM's): reproducible sampling
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: Metadata | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as in chat


_ROLES = {"user", "system", "developer", "assistant"}
# chat's field names in errors, as the Responses request names them
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "tools": "tools", "tool_choice": "tool_choice"}


def response_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    head = head.split("[", 1)[0]
    if head in _PARAMS:
        return _PARAMS[head]
    return param


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            raise bad_request(f"{where}: only text content is supported (got type {part.type!r})", where)
        texts.append(part.text or "")
    return "".join(texts)


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The ``input`` as chat messages (plain dicts, as a chat request's body has them)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}", f"{where}.role")
            messages.append({"role": item.role, "content": _text(item.content, where)})
        elif kind == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise bad_request(f"{where}: a function_call needs call_id, name and arguments", where)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise bad_request(f"{where}: a function_call_output needs call_id and output", where)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, where)})
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again (as chat templates drop it)
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", f"{where}.type")
    return messages


def chat_request(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request body this Responses request stands for (``history``: the stored turns of
    ``previous_response_id``)."""
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else [])
    messages += history + input_messages(request)
    chat: dict[str, Any] = {"messages": messages, "stream": request.stream,
                            "parallel_tool_calls": request.parallel_tool_calls}
    for name, value in (("max_tokens", request.max_output_tokens), ("temperature", request.temperature),
                        ("top_p", request.top_p), ("seed", request.seed)):
        if value is not None:
            chat[name] = value
    if request.tools:
        tools = []
        for i, tool in enumerate(request.tools):
            if tool.type != "function" or not tool.name:
                raise bad_request(f"tools[{i}]: only function tools with a name are supported", f"tools[{i}]")
            function = {"name": tool.name, "parameters": tool.parameters or {"type": "object", "properties": {}}}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        chat["tools"] = tools
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        if choice.type != "function" or not choice.name:
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name'}",
                              "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = request.text.format if request.text else None
    forced_call = chat.get("tool_choice") not in (None, "auto", "none")
    if fmt is not None and fmt.type != "text" and not forced_call:  # a forced call's output is the call
        if fmt.type == "json_schema":
            if fmt.schema is None:
                raise bad_request("text.format of type json_schema needs a schema", "text.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}}
        else:
            chat["response_format"] = {"type": fmt.type}
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning is not None and request.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning.effort)  # for templates that read it
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return chat


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def usage(num_input: int, num_output: int, num_cached: int) -> dict[str, Any]:
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input + num_output}


class ResponseShape:
    """The response object of one request, as it is in progress and once complete."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.request = request
        self.model = model

    def body(self, status: str, output: list[dict[str, Any]], usage_obj: dict[str, Any] | None = None,
             finish_reason: str | None = None) -> dict[str, Any]:
        r = self.request
        tools = [msgspec.to_builtins(t) for t in r.tools or []]
        choice = r.tool_choice
        incomplete = None
        if finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        fmt = r.text.format if r.text and r.text.format else TextFormat()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": r.previous_response_id,
            "reasoning": msgspec.to_builtins(r.reasoning) if r.reasoning else {"effort": None, "summary": None},
            "store": r.store, "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": msgspec.to_builtins(fmt)},
            "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
            "tools": tools, "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
            "usage": usage_obj, "user": r.user, "metadata": r.metadata or {},
        }


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found (it was never stored, or it was "
                         "evicted from the response store: see docs/admission.md).", "invalid_request_error",
                    "previous_response_id", "response_not_found")
