"""OpenAI's request shapes: parse and validate chat and completions bodies into engine sampling parameters.

Pure functions over msgspec structs; no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tidal.errors import bad_request, context_too_long
from tidal.service import body_cost, json_depth
from tidal.service.tool_calls import named_schema, required_schema
from tidal.service.decode import Temperature, TopP, bounded, decode_struct, read_struct
from tidal.wire import INT32_MAX, SamplingParams, StructuredOutput

_json_encode = msgspec.json.encode

MAX_N = 16  # choices per request; each counts as one sequence against the admission bounds
MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's bound)
MAX_LEGACY_LOGPROBS = 5  # completions logprobs (OpenAI's bound)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] | None = None  # JSON text (OpenAI); an object is accepted as is


class ToolCall(msgspec.Struct, kw_only=True):
    """An earlier assistant turn's call: typed, so a ``function`` that is not an object is a 400 at
    the decode, naming the field, never a surprise for the template."""

    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDef


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: NamedFunction


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` object (one constraint)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Every number a request carries, bounded once: what OpenAI allows where it says, and never more
# than the wire and the engine hold (tidal/wire.py), so nothing accepted can fail to encode.
MaxTokens = bounded(int, "max_tokens must be at least 1 (and at most 2^31-1)", ge=1, le=INT32_MAX)
TopK = bounded(int, "top_k must be -1 (off), 0 (off) or positive (at most 2^31-1)", ge=-1, le=INT32_MAX)
MinP = bounded(float, "min_p must be between 0 and 1", ge=0.0, le=1.0)
Penalty = bounded(float, "presence_penalty and frequency_penalty must be between -2 and 2", ge=-2.0, le=2.0)
RepetitionPenalty = bounded(float, "repetition_penalty must be in (0, 10]", gt=0.0, le=10.0)
RequestSeed = bounded(int, "seed must be a 64-bit signed integer", ge=-(2**63), le=2**63 - 1)
StopTokenId = bounded(int, "stop_token_ids must be token ids (0 to 2^31-1)", ge=0, le=INT32_MAX)
StreamInterval = bounded(int, "stream_interval must be at least 1 (and at most 2^31-1)", ge=1, le=INT32_MAX)
Priority = bounded(int, "priority must be in [-2^31, 2^31)", ge=-(2**31), le=INT32_MAX)
NumChoices = bounded(int, f"n must be between 1 and {MAX_N}", ge=1, le=MAX_N)
LegacyLogprobs = bounded(int, f"logprobs must be an integer between 0 and {MAX_LEGACY_LOGPROBS}",
                          ge=0, le=MAX_LEGACY_LOGPROBS)
TopLogprobs = bounded(int, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", ge=0, le=MAX_TOP_LOGPROBS)
# a prompt's token ids: any 64-bit integer parses, the vocabulary check names the real range
PromptTokenId = bounded(int, "prompt token ids must be 64-bit integers", ge=-(2**63), le=2**63 - 1)


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: RequestSeed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StopTokenId] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_interval: StreamInterval | None = None
    priority: Priority = 0
    n: NumChoices = 1
    logprobs: bool | LegacyLogprobs | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs tokens as "token_id:N"
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None  # vLLM's older spellings
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[PromptTokenId | str | list[PromptTokenId]]
    echo: bool = False
    suffix: str | None = None


_decoders = {
    "chat": msgspec.json.Decoder(ChatCompletionRequest),
    "completions": msgspec.json.Decoder(CompletionRequest),
}


ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def parse_body(kind: Literal["chat", "completions"], body: bytes | dict) -> ChatCompletionRequest | CompletionRequest:
    """Decode and type-check a request body (400 with the offending field otherwise)."""
    if isinstance(body, dict):
        return decode_struct(body, ChatCompletionRequest if kind == "chat" else CompletionRequest)
    return decode_struct(body, _decoders[kind])


async def read_body(kind: Literal["chat", "completions"], body: bytes | dict) -> ChatCompletionRequest | CompletionRequest:
    """``parse_body``, a large body's cost bounded and paid off the event loop (``read_struct``)."""
    return await read_struct(body, _decoders[kind] if not isinstance(body, dict) else
                             (ChatCompletionRequest if kind == "chat" else CompletionRequest))


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template; text parts only."""
    return template_messages(request.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as plain dicts for the chat template; text parts only."""
    if not messages:
        raise bad_request("'messages' must contain at least one message", "messages")
    out = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages[{i}].role {message.role!r} is not one of {sorted(ROLES)}",
                              f"messages[{i}].role")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text":
                    raise bad_request(f"messages[{i}]: only text content parts are supported "
                                      f"(got type {part.type!r})", f"messages[{i}].content")
                if part.text is None:
                    raise bad_request(f"messages[{i}]: a text content part needs a 'text' field",
                                      f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            entry["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                   for j, call in enumerate(message.tool_calls)]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out


# Names the template already gets from the server; a request may not replace them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation",
                                       "documents", "chat_template", "continue_final_message", "return_dict"})
MAX_TEMPLATE_KWARGS = 16


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs``, checked: a few plain variables, none the server sets."""
    kwargs = kwargs or {}
    _check(len(kwargs) <= MAX_TEMPLATE_KWARGS, f"chat_template_kwargs may have at most {MAX_TEMPLATE_KWARGS} "
           "entries", "chat_template_kwargs")
    for name in kwargs:
        _check(name.isidentifier() and name not in _RESERVED_TEMPLATE_KWARGS,
               f"chat_template_kwargs may not set {name!r}", "chat_template_kwargs")
    return kwargs


def _template_tool_call(call: ToolCall, param: str) -> dict[str, Any]:
    """An earlier assistant tool call as chat templates expect it: arguments as an object."""
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = _json_text(arguments, f"{param}.function.arguments")
        except json_depth.TooDeep as exc:
            raise bad_request(str(exc), param) from None
        except ValueError:
            pass  # leave it as text; the template decides
    entry: dict[str, Any] = {"type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        entry["id"] = call.id
    return entry


def _json_text(text: str, what: str) -> Any:
    """A JSON value a request carries as text (a schema, a tool call's arguments), its cost bounded
    as a body's is (tidal/service/body_cost.py) before it is decoded."""
    if len(text) >= body_cost.OFF_LOOP_BYTES:
        body_cost.check(text.encode())
    return json_depth.loads(text, what)


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("Batched prompts are not supported: send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return prompt
    if not prompt:
        raise bad_request("'prompt' must not be empty", "prompt")
    return prompt


def _check(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise bad_request(message, param)


# What one request may ask of the stop checks the engine runs after every token (docs/admission.md).
# Matching is linear in the text whatever the stop strings' length (gpu/stop_strings.py); these keep
# the held-back text, the final search and what each request carries to the engine small.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True)
class Validated:
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    stream_interval: int | None
    priority: int
    return_tokens_as_token_ids: bool = False
    structured_param: str | None = None  # the field that set the output constraint
    tools: ToolUse | None = None
    kind: Literal["chat", "completions"] = "chat"
    n: int = 1
    thinking: str | None = None  # with a reasoning parser, where the prompt leaves the thinking (reasoning.py)


def _logprobs(r: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many top alternatives to report per token, or None for no logprobs."""
    if isinstance(r, ChatCompletionRequest):
        _check(r.logprobs is None or isinstance(r.logprobs, bool), "logprobs must be a boolean", "logprobs")
        top = r.top_logprobs
        _check(not top or r.logprobs, "top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if r.logprobs else None
    value = r.logprobs
    if value is None or value is False:
        return None
    _check(not isinstance(value, bool), f"logprobs must be an integer between 0 and {MAX_LEGACY_LOGPROBS}",
           "logprobs")
    return value  # type: ignore[return-value]


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema as compact JSON text (the grammar cache key). Key order is kept: the
    output's properties come in the schema's order."""
    if isinstance(schema, str):
        try:
            schema = _json_text(schema, "the JSON schema")
        except json_depth.TooDeep as exc:
            raise bad_request(str(exc), param) from None
        except ValueError:
            raise bad_request("the JSON schema is not valid JSON", param) from None
    _check(isinstance(schema, (dict, bool)), "the JSON schema must be an object", param)
    return json.dumps(schema, separators=(",", ":"))


def structured_output(r: ChatCompletionRequest | CompletionRequest) -> tuple[StructuredOutput | None, str | None]:
    """The request's output constraint and the field that set it; 400 on a malformed one.

    A constraint its grammar engine rejects (an unsupported schema keyword, a bad regex) is
    refused by the engine before the request is scheduled, also with a 400 (see ``Api.first_output`` in
    tidal/service/api.py).
    """
    found: list[tuple[StructuredOutput, str]] = []
    fmt = r.response_format
    if fmt is not None:
        if fmt.type == "json_schema":
            _check(fmt.json_schema is not None and fmt.json_schema.schema is not None,
                   "response_format json_schema needs json_schema.schema", "response_format")
            found.append((StructuredOutput("json_schema", _schema_text(fmt.json_schema.schema,  # type: ignore[union-attr]
                                                                          "response_format")), "response_format"))
        elif fmt.type == "json_object":
            found.append((StructuredOutput("json_object"), "response_format"))
        else:
            _check(fmt.type == "text", "response_format.type must be one of text, json_object, json_schema",
                   "response_format")
    so = r.structured_outputs
    options = [("json", so.json if so else None, r.guided_json), ("regex", so.regex if so else None, r.guided_regex),
               ("choice", so.choice if so else None, r.guided_choice),
               ("grammar", so.grammar if so else None, r.guided_grammar)]
    for name, new_style, old_style in options:
        for value, param in ((new_style, "structured_outputs"), (old_style, f"guided_{name}")):
            if value is None:
                continue
            if name == "json":
                found.append((StructuredOutput("json_schema", _schema_text(value, param)), param))
            elif name == "choice":
                _check(bool(value) and all(isinstance(c, str) and c for c in value),
                       "choice must be a non-empty list of non-empty strings", param)
                found.append((StructuredOutput("choice", json.dumps(value)), param))
            else:
                _check(bool(value), f"{name} must not be empty", param)
                found.append((StructuredOutput(name, value), param))  # type: ignore[arg-type]
    if so is not None and so.json_object:
        found.append((StructuredOutput("json_object"), "structured_outputs"))
    if not found:
        return None, None
    _check(len(found) == 1, "give at most one output constraint (response_format, structured_outputs, guided_*)",
           found[-1][1])
    return found[0]


MAX_TOOLS = 128  # OpenAI's bound
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolUse:
    """How a chat request uses its tools: passed to the template, and how the answer is read."""

    tools: list[dict[str, Any]]  # OpenAI tool objects, for the chat template
    mode: Literal["auto", "required", "named"]
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def functions(self) -> list[dict[str, Any]]:
        return [tool["function"] for tool in self.tools]


def tool_use(r: ChatCompletionRequest | CompletionRequest) -> ToolUse | None:
    """The request's tools and tool_choice, checked (400 naming the field otherwise)."""
    if not isinstance(r, ChatCompletionRequest):
        return None
    tools, choice = r.tools or [], r.tool_choice
    _check(len(tools) <= MAX_TOOLS, f"at most {MAX_TOOLS} tools are supported", "tools")
    names = []
    for i, tool in enumerate(tools):
        _check(tool.type == "function", f"tools[{i}].type must be 'function'", f"tools[{i}].type")
        _check(bool(_TOOL_NAME.fullmatch(tool.function.name)),
               f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'", f"tools[{i}].function.name")
        names.append(tool.function.name)
    _check(len(set(names)) == len(names), "tool names must be unique", "tools")
    if isinstance(choice, NamedToolChoice):
        _check(choice.type == "function", "tool_choice.type must be 'function'", "tool_choice")
        _check(choice.function.name in names, f"tool_choice names a function that is not in tools: "
               f"{choice.function.name!r}", "tool_choice")
        mode, function = "named", choice.function.name
    else:
        _check(choice in (None, "none", "auto", "required"),
               "tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
        _check(choice in (None, "none") or tools, f"tool_choice {choice!r} needs tools", "tool_choice")
        if not tools or choice == "none":
            return None  # tools with "none" are still shown to the template (Api.admit_choices)
        mode, function = ("auto" if choice in (None, "auto") else "required"), None
    plain = [msgspec.to_builtins(tool) for tool in tools]
    return ToolUse(plain, mode, function, r.parallel_tool_calls)  # type: ignore[arg-type]


def _forced_tool_call(use: ToolUse | None) -> StructuredOutput | None:
    if use is None or use.mode == "auto":
        return None
    if use.mode == "named":
        tool = next(f for f in use.functions if f["name"] == use.function)
        schema = named_schema(tool)
    else:
        schema = required_schema(use.functions, use.parallel)
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))


def within_request_bounds(defaults: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """The model's sampling defaults that a request could have set itself, and a line for each that it could not
    (a generation_config.json's ``top_p`` of 5 would otherwise reach the sampler unchecked)."""
    kept, refused = {}, []
    for key, value in defaults.items():
        try:
            checked = msgspec.convert({"prompt": "", key: value}, CompletionRequest, strict=False)
        except msgspec.ValidationError as error:
            refused.append(f"{key} {value!r}: {error}")
        else:
            kept[key] = getattr(checked, key)
    return kept, refused


def validate(request: ChatCompletionRequest | CompletionRequest, vocab_size: int,
             defaults: dict[str, float] | None = None) -> Validated:
    """Range checks shared by both endpoints. Prompt length is checked after tokenising. ``defaults``: the
    model's sampling defaults (tidal/sampling_defaults.py) for the fields the request leaves unset."""
    defaults = defaults or {}
    r = request
    num_logprobs = _logprobs(r)
    structured, structured_param = structured_output(r)
    tools = tool_use(r)
    forced = _forced_tool_call(tools)
    if forced is not None:
        _check(structured is None, "tool_choice 'required' or a named function cannot be combined with another "
               "output constraint", structured_param or "tool_choice")
        structured, structured_param = forced, "tools"
    if isinstance(r, CompletionRequest):
        _check(not r.echo, "echo is not supported", "echo")
        _check(r.suffix is None, "suffix is not supported", "suffix")
    max_tokens = r.max_tokens
    if isinstance(r, ChatCompletionRequest) and r.max_completion_tokens is not None:
        max_tokens = r.max_completion_tokens
    temperature = defaults.get("temperature", 1.0) if r.temperature is None else r.temperature
    top_p = defaults.get("top_p", 1.0) if r.top_p is None else r.top_p
    top_k = defaults.get("top_k") if r.top_k is None else r.top_k
    if top_k is not None and top_k <= 0:
        top_k = None
    min_p = 0.0 if r.min_p is None else r.min_p
    presence = r.presence_penalty or 0.0
    frequency = r.frequency_penalty or 0.0
    repetition = defaults.get("repetition_penalty", 1.0) if r.repetition_penalty is None else r.repetition_penalty
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    _check(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are supported "
           f"(got {len(stop)})", "stop")
    _check(all(stop), "stop strings must not be empty", "stop")
    longest = max(map(len, stop), default=0)
    _check(longest <= MAX_STOP_CHARS, f"a stop string may have at most {MAX_STOP_CHARS} characters "
           f"(got {longest})", "stop")
    stop_ids = r.stop_token_ids or []
    _check(len(stop_ids) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported "
           f"(got {len(stop_ids)})", "stop_token_ids")
    _check(all(0 <= t < vocab_size for t in stop_ids), f"stop_token_ids must be in [0, {vocab_size})",
           "stop_token_ids")
    params = SamplingParams(
        max_tokens=max_tokens or 1,  # replaced by the room left in the context when not given
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=r.seed,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=r.ignore_eos,
        skip_special_tokens=r.skip_special_tokens,
        logprobs=num_logprobs,
        structured=structured,
    )
    include_usage = bool(r.stream_options and r.stream_options.include_usage)
    return Validated(params, max_tokens is not None, r.stream, include_usage, r.stream_interval, r.priority,
                     r.return_tokens_as_token_ids, structured_param, tools,
                     "chat" if isinstance(r, ChatCompletionRequest) else "completions", r.n)


def fit_max_tokens(v: Validated, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """Check the prompt against the context window; default max_tokens to the room left."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise context_too_long(max_model_len, f"your request has {num_prompt_tokens} input tokens. Please reduce "
                               "the length of the input.", "messages")
    if not v.max_tokens_given:
        return msgspec.structs.replace(v.params, max_tokens=room)
    if v.params.max_tokens > room:
        raise context_too_long(max_model_len, f"you requested {v.params.max_tokens + num_prompt_tokens} tokens "
                               f"({num_prompt_tokens} in the input, {v.params.max_tokens} in the completion). "
                               "Please reduce the length of the input or the completion.", "max_tokens")
    return v.params


