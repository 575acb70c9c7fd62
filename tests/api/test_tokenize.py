"""POST /tokenize and /detokenize (vLLM's shapes) on a live server: the ids a prompt really gets,
the chat template's rendering with chat_template_kwargs, and the prompt bounds as 4xx."""

from __future__ import annotations

import httpx
import pytest

from .think_model import API_KEY, AUTH, MAX_MODEL_LEN, SERVED_MODEL


@pytest.fixture(scope="module")
def server(think_server):
    """This module's tests talk to the think-model server."""
    return think_server


pytestmark = pytest.mark.slow


def post(server, path: str, body, headers=AUTH) -> httpx.Response:
    return server.client.post(server.url + path, json=body, headers=headers)


def test_tokenize_gives_the_ids_a_completion_prompt_gets(server, client):
    answer = post(server, "/tokenize", {"model": SERVED_MODEL, "prompt": "The tide comes in", "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert len(body["token_strs"]) == body["count"]
    completion = client.completions.create(model=SERVED_MODEL, prompt="The tide comes in", max_tokens=1)
    assert completion.usage.prompt_tokens == body["count"]
    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].endswith("The tide comes in")


def test_tokenize_messages_renders_the_template_with_its_kwargs(server, client):
    messages = [{"role": "user", "content": "Hello"}]
    thinking = post(server, "/tokenize", {"messages": messages}).json()
    chat = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == thinking["count"]
    closed = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert closed.status_code == 200, closed.text
    text = post(server, "/detokenize", {"tokens": closed.json()["tokens"]}).json()["prompt"]
    assert text.endswith("<think>\n\n</think>\n\n"), text
    assert closed.json()["count"] > thinking["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "word " * (MAX_MODEL_LEN * 2)}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs"),
    ("/detokenize", {"tokens": [0, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_is_a_400_in_openai_shape(server, path, body, param):
    answer = post(server, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_the_api_key_guards_them_and_x_api_key_is_accepted(server):
    assert post(server, "/tokenize", {"prompt": "a"}, headers={}).status_code == 401
    assert post(server, "/detokenize", {"tokens": [5]}, headers={}).status_code == 401
    assert post(server, "/tokenize", {"prompt": "a"}, headers={"x-api-key": API_KEY}).status_code == 200
    wrong = post(server, "/tokenize", {"model": "other", "prompt": "a"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
