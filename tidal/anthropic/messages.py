"""Anthropic's Messages API request and response shapes, translated to and from chat.

A Messages request becomes a chat request (``chat_request``): ``system`` the system turn, text
blocks the turns' content, ``tool_use`` blocks an assistant turn's tool calls, ``tool_result``
blocks tool turns; ``tools`` (``input_schema``), ``tool_choice`` (auto / any / tool / none),
``stop_sequences`` and the sampling fields map to their chat twins, and ``thinking`` (enabled or
disabled) to the template's ``enable_thinking``. The answer's content blocks come back from what
the chat reader read: a ``thinking`` block (with --reasoning-parser), a ``text`` block, then one
``tool_use`` block per call.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec

from tidal.errors import bad_request
from tidal.service.decode import INT32_MAX, Metadata, TopP, bounded

MAX_MESSAGES = 1024
# Every number in the body bounded in its type (so /openapi.json and its fuzzer see the bounds)
MaxTokens = bounded(int, "max_tokens must be between 1 and 2^31-1", ge=1, le=INT32_MAX)
Temperature = bounded(float, "temperature must be between 0 and 1", ge=0.0, le=1.0)  # Anthropic's range, not OpenAI's
TopK = bounded(int, "top_k must be -1 (off), 0 (off) or positive", ge=-1, le=INT32_MAX)
BudgetTokens = bounded(int, "budget_tokens must be at least 0", ge=0, le=INT32_MAX)


class TextBlock(msgspec.Struct, kw_only=True):
    """A block inside a tool_result or the system prompt (text; other kinds are refused)."""

    type: str
    text: str | None = None


class Block(msgspec.Struct, kw_only=True):
    """One content block (its kinds' fields in one struct): text, tool_use, tool_result, thinking."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[TextBlock] | None = None  # a tool_result's
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class ClientTool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent: a client tool (server tools are refused)


class MessagesToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: BudgetTokens | None = None  # accepted; the thinking is bounded by max_tokens


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: MaxTokens
    messages: Annotated[list[Message], msgspec.Meta(max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: list[ClientTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: Metadata | None = None  # Anthropic's holds user_id; bounded as OpenAI's
    thinking: Thinking | None = None


def _text(content: str | list[Block] | list[TextBlock] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for block in content:
        if block.type != "text":
            raise bad_request(f"{where}: only text blocks are supported here (got {block.type!r})", where)
        texts.append(block.text or "")
    return "".join(texts)


def chat_messages(request: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (plain dicts, as a chat request's body has them)."""
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system, "system")})
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        if message.role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant'", f"{where}.role")
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts, calls = [], []
        for j, block in enumerate(message.content):
            at = f"{where}.content[{j}]"
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use" and message.role == "assistant":
                if not block.id or not block.name:
                    raise bad_request(f"{at}: a tool_use block needs id and name", at)
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input or {}, ensure_ascii=False)}})
            elif block.type == "tool_result" and message.role == "user":
                if not block.tool_use_id:
                    raise bad_request(f"{at}: a tool_result block needs tool_use_id", at)
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": _text(block.content, at)})
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # earlier thinking is not shown again (as chat templates drop it)
            else:
                raise bad_request(f"{at}: a {message.role} message may not hold a {block.type!r} block", at)
        if texts or calls:
            turn: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
    return messages


def chat_request(request: MessagesRequest) -> dict[str, Any]:
    chat: dict[str, Any] = {"messages": chat_messages(request), "max_tokens": request.max_tokens,
                            "stream": request.stream}
    for name, value in (("temperature", request.temperature), ("top_p", request.top_p), ("top_k", request.top_k)):
        if value is not None:
            chat[name] = value
    if request.stop_sequences:
        chat["stop"] = request.stop_sequences
    if request.tools:
        tools = []
        for i, tool in enumerate(request.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"tools[{i}]: server tools ({tool.type!r}) are not supported", f"tools[{i}]")
            function = {"name": tool.name, "parameters": tool.input_schema or {"type": "object", "properties": {}}}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        chat["tools"] = tools
    choice = request.tool_choice
    if choice is not None:
        modes = {"auto": "auto", "any": "required", "none": "none"}
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs a name", "tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice.type in modes:
            chat["tool_choice"] = modes[choice.type]
        else:
            raise bad_request("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", "tool_choice")
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if request.thinking is not None:
        if request.thinking.type not in ("enabled", "disabled"):
            raise bad_request("thinking.type must be 'enabled' or 'disabled'", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": request.thinking.type == "enabled"}
    return chat


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": arguments if isinstance(arguments, dict) else {"value": arguments}}


def stop_reason(finish_reason: str | None, stop: str | int | None, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for how the chat request ended."""
    if has_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(num_input: int, num_output: int, num_cached: int) -> dict[str, Any]:
    return {"input_tokens": num_input, "output_tokens": num_output, "cache_read_input_tokens": num_cached,
            "cache_creation_input_tokens": 0}
