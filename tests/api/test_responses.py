"""POST /v1/responses on a live server through the openai SDK (responses.create / .stream), the
OpenAI Agents SDK, and raw httpx for the event order, bad input and disconnects.

The model has random weights and thinks by default (see conftest.py): tests that need a
constraint from the first token (a forced tool call, text.format) pass
``chat_template_kwargs: {"enable_thinking": false}``."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest

from .think_model import API_KEY, AUTH, SERVED_MODEL


@pytest.fixture(scope="module")
def server(think_server):
    """This module's tests talk to the think-model server."""
    return think_server


pytestmark = pytest.mark.slow

DISCONNECTS = f'tidal:requests_aborted_total{{model_name="{SERVED_MODEL}",reason="client_disconnect"}}'
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
OPEN_THINKING = {"chat_template_kwargs": {"open_thinking": True}}
TIDE_TOOL = {"type": "function", "name": "get_tide", "description": "Tide height at a port",
             "parameters": {"type": "object", "properties": {"port": {"type": "string", "maxLength": 8}},
                            "required": ["port"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"height": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "rising": {"type": "boolean"}},
          "required": ["height", "rising"], "additionalProperties": False}


def test_create_answers_text_with_usage(client, server):
    response = client.responses.create(model=SERVED_MODEL, input="Hello", instructions="Be brief.",
                                       max_output_tokens=6, temperature=1.0, top_p=0.9, extra_body={"seed": 1})
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and response.output_text
    tokenized = server.client.post(server.url + "/tokenize", headers=AUTH, json={"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]}).json()
    assert response.usage.input_tokens == tokenized["count"]
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_stream_sends_the_typed_events_in_order(client):
    with client.responses.stream(model=SERVED_MODEL, input="Hello", max_output_tokens=8,
                                 extra_body={"seed": 2}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.usage.output_tokens == 8 and final.status == "incomplete"


def test_a_required_function_call_streamed_and_not(client):
    args = dict(model=SERVED_MODEL, input="Tide at Brest?", tools=[TIDE_TOOL], tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=60, extra_body={**NO_THINKING, "seed": 3})
    response = client.responses.create(**args)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_tide" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TIDE_TOOL["parameters"])
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert deltas == streamed.arguments == call.arguments  # the same seed: the same call
    assert "response.function_call_arguments.done" in [e.type for e in events]


def test_text_format_json_schema_is_followed(client):
    response = client.responses.create(model=SERVED_MODEL, input="Tide?", max_output_tokens=40, extra_body={
        **NO_THINKING, "seed": 4}, text={"format": {"type": "json_schema", "name": "tide", "schema": SCHEMA,
                                                    "strict": True}})
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_previous_response_id_carries_the_conversation(client, server):
    first = client.responses.create(model=SERVED_MODEL, input="Tide at Brest?", tools=[TIDE_TOOL],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                    extra_body={**NO_THINKING, "seed": 5})
    [call] = [item for item in first.output if item.type == "function_call"]
    second = client.responses.create(model=SERVED_MODEL, previous_response_id=first.id, max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "4 metres"}], extra_body=NO_THINKING)
    assert second.previous_response_id == first.id
    # the second prompt is the whole conversation: the first's input, its call, the call's output
    conversation = [
        {"role": "user", "content": "Tide at Brest?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "4 metres"},
    ]
    expected = server.client.post(server.url + "/tokenize", headers=AUTH, json={
        "messages": conversation, **NO_THINKING}).json()
    assert second.usage.input_tokens == expected["count"]
    with pytest.raises(Exception) as missing:
        client.responses.create(model=SERVED_MODEL, previous_response_id="resp_gone", input="hi")
    assert missing.value.status_code == 404 and "resp_gone" in str(missing.value)


def test_thinking_becomes_a_reasoning_item(client):
    """A template that opens <think> in the prompt: the random model never closes it, so its whole
    answer is thinking, a reasoning item (streamed as reasoning_text deltas)."""
    response = client.responses.create(model=SERVED_MODEL, input="Hello", max_output_tokens=6,
                                       extra_body={**OPEN_THINKING, "seed": 6})
    [item] = response.output
    assert item.type == "reasoning" and item.content[0].text
    with client.responses.stream(model=SERVED_MODEL, input="Hello", max_output_tokens=6,
                                 extra_body={**OPEN_THINKING, "seed": 6}) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == item.content[0].text


def test_an_agents_sdk_agent_runs_a_turn_with_a_function_tool(server):
    """Turn 1 is forced to call the tool; the SDK then resets tool_choice, and the agent's output
    type (a JSON schema, so the random model's answer ends) is the final output of turn 2."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI
    from pydantic import BaseModel, Field

    set_tracing_disabled(True)
    calls = []

    class Tide(BaseModel):
        metres: int = Field(ge=0, le=20)

    @function_tool
    def get_tide(port: Literal["brest", "cork"]) -> str:
        """Tide height at a port."""
        calls.append(port)
        return "4 metres"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    agent = Agent(name="tides", instructions="Answer with the tide.", tools=[get_tide], output_type=Tide,
                  model=OpenAIResponsesModel(model=SERVED_MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                               extra_body=NO_THINKING))
    result = Runner.run_sync(agent, "Tide at Brest?", max_turns=3)
    assert calls in (["brest"], ["cork"])
    assert isinstance(result.final_output, Tide) and 0 <= result.final_output.metres <= 20
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "input"),
    ({"input": [{"type": "image", "image_url": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": 5}, 400, "temperature"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "text.format"),
    ({"input": "word " * 2000}, 400, "input"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "x", "model": "other"}, 404, "model"),
    ({"input": "x", "max_output_tokens": 2**31}, 400, "max_output_tokens"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, 400, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata"),
])
def test_bad_input_is_a_4xx_in_openai_shape(server, body, status, param):
    answer = server.client.post(server.url + "/v1/responses", headers=AUTH, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"], error


def test_metadata_at_openais_bounds_is_kept_and_answered(server):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # 16 pairs, 64-char keys, 512-char values
    answer = server.client.post(server.url + "/v1/responses", headers=AUTH,
                                json={"input": "x", "max_output_tokens": 1, "metadata": metadata})
    assert answer.status_code == 200, answer.text
    assert answer.json()["metadata"] == metadata


def test_bounds_are_named_in_the_responses_own_fields(server):
    answer = server.client.post(server.url + "/v1/responses", headers=AUTH,
                                json={"input": "x", "max_output_tokens": 2**31})
    assert "max_output_tokens must be between 1 and 2^31-1" in answer.json()["error"]["message"]
    answer = server.client.post(server.url + "/v1/responses", headers=AUTH,
                                json={"input": "x", "metadata": {"k": "v" * 513}})
    assert "at most 16 pairs, keys of at most 64 characters" in answer.json()["error"]["message"]
    answer = server.client.post(server.url + "/v1/responses", headers=AUTH,
                                json={"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}})
    assert answer.json()["error"]["message"] == "text.format of type json_schema needs a schema"


def test_a_disconnect_mid_stream_frees_the_kv(server):
    assert_disconnect_frees_kv(server, "/v1/responses", {"input": "Hello", "stream": True, "max_output_tokens": 480},
                               "event: response.created")


def assert_disconnect_frees_kv(server, path: str, body: dict, first_line: str) -> None:
    """A client that reads the stream's first event and goes: its request is aborted as a
    disconnect and every KV block is free again."""
    before = server.metrics().get(DISCONNECTS, 0.0)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + path, headers=AUTH, json=body) as answer:
            assert answer.status_code == 200
            assert next(answer.iter_lines()) == first_line
    server.wait_for(lambda m: m.get(DISCONNECTS, 0.0) == before + 1)
    server.wait_idle()
