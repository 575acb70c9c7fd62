"""--reasoning-parser qwen3 on a live server: thinking goes to reasoning_content, the rest to
content, streamed (tags cut across frames when the client keeps up) and not; tool calls and constraints after thinking."""

from __future__ import annotations

import json
import re

import pytest

from .think_model import AUTH, SERVED_MODEL


@pytest.fixture(scope="module")
def server(think_server):
    """This module's tests talk to the think-model server."""
    return think_server


pytestmark = pytest.mark.slow

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
THINK_THEN_ANSWER = r"<think>[a-z]{4,12} [a-z]{4,12}</think>[a-z]{4,12}"
HELLO = [{"role": "user", "content": "Hello"}]


def forced(regex: str, seed: int) -> dict:
    return {**NO_THINKING, "structured_outputs": {"regex": regex}, "seed": seed}


def test_the_think_tags_are_several_tokens_each(server):
    for tag in ("<think>", "</think>"):
        count = server.client.post(server.url + "/tokenize", json={"prompt": tag, "add_special_tokens": False},
                                   headers=AUTH).json()["count"]
        assert count > 1, tag  # so a stream of one token per frame cuts every tag across frames


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_thinking_is_split_out_streamed_and_not(client, seed):
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=60, temperature=1.0,
                                           extra_body=forced(THINK_THEN_ANSWER, seed))
    message = whole.choices[0].message
    reasoning, content = message.model_extra["reasoning_content"], message.content
    assert re.fullmatch(THINK_THEN_ANSWER, f"<think>{reasoning}</think>{content}"), (reasoning, content)
    assert "<" not in reasoning + content and reasoning and content

    stream = client.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=60, temperature=1.0,
                                            stream=True, extra_body={**forced(THINK_THEN_ANSWER, seed),
                                                                     "stream_interval": 1})
    streamed_reasoning, streamed_content = [], []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        streamed_reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        streamed_content.append(delta.content or "")
    # how many frames the tokens come in depends on how fast this client reads them (a lagging
    # reader gets several tokens per frame); every cut of the tags is in test_reasoning_split.py
    assert "".join(streamed_reasoning) == reasoning and "".join(streamed_content) == content


def test_without_thinking_everything_is_content(client):
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=8, temperature=1.0,
                                           seed=4, extra_body=forced("[a-z]{3,8}", 4))
    message = whole.choices[0].message
    assert re.fullmatch("[a-z]{3,8}", message.content) and message.model_extra.get("reasoning_content") is None


def test_a_required_tool_call_is_read_after_the_thinking(client):
    tools = [{"type": "function", "function": {"name": "get_tide", "parameters": {
        "type": "object", "properties": {"port": {"type": "string", "maxLength": 8}}, "required": ["port"]}}}]
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=80, temperature=1.0,
                                           seed=5, tools=tools, tool_choice="required", parallel_tool_calls=False,
                                           extra_body=NO_THINKING)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_tide" and "port" in json.loads(call.function.arguments)
    assert whole.choices[0].finish_reason == "tool_calls"


def test_a_constraint_waits_while_the_model_thinks(client):
    """With thinking on, the random model never closes its thinking: the constraint never starts,
    so the answer is free text (a constraint from the first token would make it match)."""
    texts = []
    for seed in range(3):
        whole = client.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=12, temperature=1.0,
                                               seed=seed, extra_body={"structured_outputs": {"regex": "[0-9]+"}})
        message = whole.choices[0].message
        texts.append((message.content or "") + (message.model_extra.get("reasoning_content") or ""))
    assert not all(re.fullmatch("[0-9]+", text) for text in texts), texts


def test_bad_template_kwargs_are_a_400(client, server):
    answer = server.client.post(server.url + "/v1/chat/completions", headers=AUTH, json={
        "messages": HELLO, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template_kwargs"
