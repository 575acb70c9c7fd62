"""Issue 23 rows 1, 2 and 13, and the structural promises, without a server (pure functions).

- Every number a request type holds is bounded in the type itself (msgspec ``Meta``), within
  what the wire and the engine hold; anything ``validate`` accepts encodes and decodes on the
  engine's side (before the fix, ``top_k: 2**64`` passed and killed the engine client's writer).
- Nested data is depth-bounded by one reader (tidal/service/json_depth.py): JSON in strings,
  tool arguments, schemas, and model output parsed as a tool call.
- Logprobs count toward the per-stream buffer bound.
"""

from __future__ import annotations

import json

import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.errors import ApiError
from tidal.http.routes import REQUEST_BODIES
from tidal.registry.mailbox import Mailbox
from tidal.service import json_depth
from tidal.openai.requests import parse_body, validate
from tidal.service.tool_calls import ToolCallStream
from tidal.wire import HEADER_SIZE, AddRequest, Logprobs, RequestOutput, decode_to_engine, encode_frame

from .bodies import chat_bodies, completion_bodies

VOCAB = 8192
NUMBERLESS = {"TokenizeRequest", "LoadLoraAdapterRequest"}  # request types holding no number at all
HELLO = [{"role": "user", "content": "hi"}]


def _numbers(info, path: str):
    """(path, type info) of every int or float anywhere in a request type."""
    if isinstance(info, mi.Metadata):
        yield from _numbers(info.type, path)
    elif isinstance(info, (mi.IntType, mi.FloatType)):
        yield path, info
    elif isinstance(info, mi.StructType):
        for field in info.fields:
            yield from _numbers(field.type, f"{path}.{field.name}")
    elif isinstance(info, mi.UnionType):
        for member in info.types:
            yield from _numbers(member, path)
    elif isinstance(info, (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType)):
        yield from _numbers(getattr(info, "item_type", None), path + "[]")
    elif isinstance(info, mi.DictType):
        yield from _numbers(info.value_type, path + "{}")


@pytest.mark.parametrize("request_type", sorted(set(REQUEST_BODIES.values()), key=lambda t: t.__name__))
def test_every_number_a_request_holds_is_bounded_in_its_type(request_type):
    numbers = list(_numbers(mi.type_info(request_type), request_type.__name__))
    assert numbers or request_type.__name__ in NUMBERLESS  # the walk sees the fields
    for path, info in numbers:
        low = info.ge if info.ge is not None else info.gt
        high = info.le if info.le is not None else info.lt
        assert low is not None and high is not None, f"{path} has no bounds"
        if isinstance(info, mi.IntType):
            assert -(2**63) <= low and high < 2**63, f"{path}: [{low}, {high}] does not fit the wire"


@pytest.mark.parametrize("field, value", [("top_k", 2**64), ("top_k", 2**64 - 1), ("seed", 2**64), ("seed", -(2**63) - 1),
                                          ("max_tokens", 2**64), ("priority", 2**63), ("stream_interval", 2**64),
                                          ("n", 2**64), ("stop_token_ids", [2**64]), ("top_logprobs", 2**64)])
def test_a_number_past_its_bound_is_a_400_naming_the_field(field, value):
    with pytest.raises(ApiError) as info:
        parse_body("chat", json.dumps({"messages": HELLO, field: value}).encode())
    assert info.value.status == 400 and info.value.param.startswith(field), info.value.body()
    with pytest.raises(ApiError):  # the WebSocket's bodies come decoded
        parse_body("chat", {"messages": HELLO, field: value})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(chat_bodies.map(lambda b: ("chat", b)), completion_bodies.map(lambda b: ("completions", b))))
def test_whatever_is_accepted_encodes_and_the_engine_decodes(body):
    kind, fields = body
    try:
        checked = validate(parse_body(kind, json.dumps(fields).encode()), VOCAB)
    except ApiError as error:
        assert error.status == 400
        return
    add = AddRequest(1, [1, 2, 3], checked.params, checked.priority, 0.0)
    assert decode_to_engine(encode_frame(add)[HEADER_SIZE:]) == add


def deep(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + "1" + closer * depth


@pytest.mark.parametrize("fields", [
    {"guided_json": deep(5000)},
    {"guided_json": deep(5000, '{"a":', "}")},
    {"structured_outputs": {"json": deep(200)}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": json.loads(deep(300, '{"a":', "}"))}}},
    {"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep(5000)}}]}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": json.loads(deep(200, '{"a":', "}"))}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}}},
], ids=["guided-json-arrays", "guided-json-objects", "structured-outputs", "response-format-schema",
        "tool-call-arguments", "forced-tool-parameters"])
def test_json_nested_inside_a_field_is_a_400(fields):
    body = {"messages": HELLO, **fields}
    for raw in (json.dumps(body).encode(), body):
        with pytest.raises(ApiError) as info:
            request = parse_body("chat", raw)
            validate(request, VOCAB)
            from tidal.openai.requests import chat_messages
            chat_messages(request)
        assert info.value.status == 400, info.value.body()
        assert "nested too deeply" in info.value.message


def test_json_depth_bounds_text_and_values_alike():
    ok, too_deep = deep(json_depth.MAX_DEPTH), deep(json_depth.MAX_DEPTH + 1)
    assert json_depth.loads(ok) == json.loads(ok)
    json_depth.check(json.loads(ok))
    with pytest.raises(json_depth.TooDeep):
        json_depth.loads(too_deep)
    with pytest.raises(json_depth.TooDeep):
        json_depth.check(json.loads(too_deep))
    assert json_depth.loads('["[[[[' + "[" * 500 + '"]') == ["[[[[" + "[" * 500]  # brackets in strings do not count
    with pytest.raises(json_depth.TooDeep):
        json_depth.check_text("[" * 16_000_000)  # stops at the first level too deep


@pytest.mark.parametrize("stream", [ToolCallStream(forced="f", named=True), ToolCallStream(forced="required"),
                                    ToolCallStream(parser="hermes"), ToolCallStream(parser="mistral"),
                                    ToolCallStream(parser="llama3_json")], ids=["named", "required", "hermes",
                                                                                "mistral", "llama3_json"])
def test_model_output_nested_too_deep_ends_the_request_with_an_error(stream):
    prefix = {"hermes": '<tool_call>{"name": "f", "arguments": ', "mistral": '[TOOL_CALLS][{"name": "f", "arguments": ',
              "llama3_json": '{"name": "f", "parameters": '}.get(stream.parser, "")
    stream.feed(prefix + deep(1500, '{"a":', "}") + "}")
    with pytest.raises(ApiError) as info:  # before: RecursionError, a cut stream
        stream.finish()
    assert info.value.status == 400 and "nested too deeply" in info.value.message


async def test_logprobs_count_toward_the_stream_buffer_bound():
    mailbox = Mailbox(max_bytes=1 << 20)
    # 1000 tokens of 1 character with 20 top logprobs: 5 KB of text and ids, ~250 KB of logprobs
    for _ in range(5):
        fine = mailbox.put_nowait(RequestOutput(1, [7] * 1000, "x" * 1000, logprobs=Logprobs(
            [-0.5] * 1000, [[1] * 20] * 1000, [[-1.0] * 20] * 1000)))
    assert not fine, mailbox.pending_bytes  # over 1 MiB undelivered: the reader is a slow client
    assert mailbox.pending_bytes > 1 << 20
