"""Tool calls through the openai SDK on a live server, streaming and not.

tidal-tiny is random: "required" and named calls are valid only because the grammar makes
them so. For tool_choice "auto" the server parses Hermes-style ``<tool_call>`` output
(``--tool-call-parser hermes``); a grammar makes the random model write one.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from .support import assert_openai_error

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


SERVER_ARGS = ("--tool-call-parser", "hermes", "--num-kv-blocks", "256")



def _check_calls(calls, allowed_names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed_names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("seed", range(4))
def test_named_function_is_a_valid_call(client, seed):
    out = client.chat.completions.create(
        model="tidal-tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, {"get_time"})
    assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("seed", range(4))
def test_required_is_a_valid_call_of_some_tool(client, seed):
    out = client.chat.completions.create(model="tidal-tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                         seed=seed, max_tokens=200, tool_choice="required",
                                         parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    assert len(choice.message.tool_calls) == 1


def test_streamed_calls_assemble_with_the_sdk_helpers(client):
    with client.chat.completions.stream(model="tidal-tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                        seed=3, max_tokens=600, tool_choice="required") as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    # and the same deltas read by hand: index, id, name and arguments
    deltas = [c.choices[0].delta.tool_calls for c in client.chat.completions.create(
        model="tidal-tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=3, max_tokens=600,
        tool_choice="required", stream=True) if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1  # one chunk carries every call, whole
    # the same seed gives the same calls (ids are fresh per response)
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas[0]] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]
    assert all(d.id.startswith("call_") and d.type == "function" for d in deltas[0])
    assert 1 <= len(deltas[0]) <= 16  # parallel calls, at most MAX_PARALLEL_TOOL_CALLS


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_tool_calls(client, stream):
    kwargs = dict(model="tidal-tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                  extra_body={"guided_grammar": f"root ::= {json.dumps(HERMES_CALL)}"})
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            content = "".join(e.delta for e in s if e.type == "content.delta")
            final = s.get_final_completion()
        assert content == "Checking. "  # streamed as it came; the call never shows as text
    else:
        final = client.chat.completions.create(**kwargs)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.strip() == "Checking."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo", "days": 2})


def test_auto_without_a_call_is_plain_content(client):
    out = client.chat.completions.create(model="tidal-tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                         temperature=0)
    plain = client.chat.completions.create(model="tidal-tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content  # the tidal-tiny template ignores tools, so the same text
    assert choice.message.content == plain.choices[0].message.content


def test_tool_choice_none_and_multi_turn_history(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    # the grammar makes the model write a well-formed call, which "auto" would parse (test above): "none"
    # must leave it as text
    out = client.chat.completions.create(model="tidal-tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=200,
                                         extra_body={"guided_grammar": f"root ::= {json.dumps(HERMES_CALL)}"})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == HERMES_CALL


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_fields_are_400(server, extra, param):
    body = {"model": "tidal-tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60), 400, param)


def test_128_tools_are_accepted(server):
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(128)]
    body = {"model": "tidal-tiny", "messages": MESSAGES, "max_tokens": 2, "tools": tools}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


async def test_websocket_streams_carry_tool_calls_and_logprobs(server):
    """/v1/ws chunks are the SSE chunks: the last carries the calls, every one its logprobs."""
    import trio
    import trio_websocket

    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "max_tokens": 60, "temperature": 1.0, "seed": 2, "logprobs": True, "top_logprobs": 2}
    url = server.url.replace("http://", "ws://") + "/v1/ws"
    async with trio_websocket.open_websocket_url(url) as ws:
        await ws.send_message(json.dumps({"type": "request", "id": "t", "endpoint": "chat.completions",
                                          "body": body}))
        messages = []
        with trio.fail_after(60):
            while not messages or messages[-1]["type"] not in ("done", "error"):
                messages.append(json.loads(await ws.get_message()))
    *chunks, done = messages
    assert done["type"] == "done", done
    choices = [m["data"]["choices"][0] for m in chunks]
    assert choices[-1]["finish_reason"] == "tool_calls"
    [call] = choices[-1]["delta"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS["get_time"])
    tokens = [entry for c in choices if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert len(tokens) == done["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in tokens)
