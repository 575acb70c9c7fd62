"""POST /v1/messages (Anthropic Messages) on a live server through the anthropic SDK
(messages.create / .stream), and raw httpx for Anthropic's error shape and disconnects."""

from __future__ import annotations

import anthropic
import pytest

from .think_model import API_KEY, SERVED_MODEL
from .test_responses import assert_disconnect_frees_kv


@pytest.fixture(scope="module")
def server(think_server):
    """This module's tests talk to the think-model server."""
    return think_server


pytestmark = pytest.mark.slow

NO_THINKING = {"type": "disabled"}
TIDE_TOOL = {"name": "get_tide", "description": "Tide height at a port",
             "input_schema": {"type": "object", "properties": {"port": {"type": "string", "maxLength": 8}},
                              "required": ["port"], "additionalProperties": False}}
ANTHROPIC_HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_create_answers_text_with_usage(claude):
    message = claude.messages.create(model=SERVED_MODEL, max_tokens=6, system="Be brief.",
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    assert message.usage.input_tokens > 0


def test_stream_sends_the_events_in_order(claude):
    with claude.messages.stream(model=SERVED_MODEL, max_tokens=8,
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                   "content_block_stop", "message_delta", "message_stop")]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8


def test_stop_sequences_end_the_turn(claude):
    first = claude.messages.create(model=SERVED_MODEL, max_tokens=12, extra_body={"temperature": 0.0},
                                   messages=[{"role": "user", "content": "Hello"}])
    text = first.content[0].text
    stop = text[3:6]
    assert stop.strip(), text
    stopped = claude.messages.create(model=SERVED_MODEL, max_tokens=12, extra_body={"temperature": 0.0},
                                     stop_sequences=[stop], messages=[{"role": "user", "content": "Hello"}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[:text.index(stop)]


def test_a_forced_tool_use_round_trip(claude):
    args = dict(model=SERVED_MODEL, max_tokens=60, tools=[TIDE_TOOL], thinking=NO_THINKING,
                tool_choice={"type": "any", "disable_parallel_tool_use": True})
    message = claude.messages.create(messages=[{"role": "user", "content": "Tide at Brest?"}], **args)
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_tide" and isinstance(use.input["port"], str) and message.stop_reason == "tool_use"
    with claude.messages.stream(messages=[{"role": "user", "content": "Tide at Brest?"}], **args) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content][-1] == "tool_use" and final.stop_reason == "tool_use"
    followup = claude.messages.create(model=SERVED_MODEL, max_tokens=4, tools=[TIDE_TOOL], thinking=NO_THINKING,
                                      messages=[{"role": "user", "content": "Tide at Brest?"},
                                                {"role": "assistant", "content": message.content},
                                                {"role": "user", "content": [{"type": "tool_result",
                                                                              "tool_use_id": use.id,
                                                                              "content": "4 metres"}]}])
    assert followup.usage.input_tokens > message.usage.input_tokens


@pytest.mark.parametrize("body, status, kind", [
    ({"model": SERVED_MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
    ({"model": SERVED_MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error"),
    ({"model": SERVED_MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error"),
    ({"model": SERVED_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error"),
    ({"model": SERVED_MODEL, "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
     400, "invalid_request_error"),
    ({"model": SERVED_MODEL, "max_tokens": 5, "tool_choice": {"type": "any"},
      "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
    ({"model": SERVED_MODEL, "max_tokens": 5000, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error"),
    ({"model": "claude-other", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error"),
])
def test_bad_input_is_a_4xx_in_anthropic_shape(server, body, status, kind):
    answer = server.client.post(server.url + "/v1/messages", headers=ANTHROPIC_HEADERS, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"], error


def test_bounds_are_named_as_anthropic_states_them(server):
    answer = server.client.post(server.url + "/v1/messages", headers=ANTHROPIC_HEADERS, json={
        "model": SERVED_MODEL, "max_tokens": 2**31, "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 400 and "max_tokens must be between 1 and 2^31-1" in answer.json()["error"]["message"]


def test_a_wrong_key_is_a_401_in_anthropic_shape(server):
    answer = server.client.post(server.url + "/v1/messages", headers={"x-api-key": "wrong"},
                                json={"model": SERVED_MODEL, "max_tokens": 5, "messages": []})
    assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=SERVED_MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])


def test_a_disconnect_mid_stream_frees_the_kv(server):
    assert_disconnect_frees_kv(server, "/v1/messages", {"model": SERVED_MODEL, "max_tokens": 480, "stream": True,
                                                        "messages": [{"role": "user", "content": "Hello"}]},
                               "event: message_start")
