"""The real model served as users serve it: SmolLM2-135M-Instruct's Q4_1 GGUF from PyPI, pulled into an Ollama
store and started with ``tidal serve --model ollama:smollm2:135m``, one server for the whole module. What a user
depends on, through curl-like HTTP and the real SDKs: a question answered and ended by the model itself, streaming
equal to not streaming, structured output and a required tool call well formed, the Responses and Messages APIs,
logprobs, n > 1, and the second turn of a chat reusing the first turn's cached prefix."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from live_server import LiveServer
from test_gguf_model import fake_ollama_store

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SPECIAL = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def server(smollm2_gguf, smollm2_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("ollama")
    fake_ollama_store(store, str(smollm2_gguf))
    # smollm2_dir: the GGUF's tokenizer is converted once (cached) before the server's clock starts
    with LiveServer("--model", "ollama:smollm2:135m", "--served-model-name", MODEL, "--max-model-len", "2048",
                    env={"OLLAMA_MODELS": str(store)}) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


def chat(client, messages=QUESTION, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **{"temperature": 0, **kwargs})


def test_a_question_is_answered_and_ended_by_the_model(client, server):
    response = chat(client, max_tokens=64)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # <|im_end|>, the model's own end of turn, well before max_tokens
    assert response.usage.completion_tokens < 64
    assert not any(token in choice.message.content for token in SPECIAL)
    assert "GGUF Q4_1 x210" in server.log()  # the ready line says how the file loaded


def test_streaming_gives_the_same_answer(client):
    expected = chat(client, max_tokens=48).choices[0]
    stream = chat(client, max_tokens=48, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == expected.message.content and finish == [expected.finish_reason]


# bounded fields: a free number lets a 135M model run on in digits until max_tokens
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                        "country": {"type": "string", "maxLength": 40}, "is_capital": {"type": "boolean"}},
        "required": ["city", "country", "is_capital"], "additionalProperties": False}


def test_json_schema_output_is_valid(client):
    response = chat(client, [{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=80,
                    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    assert response.choices[0].finish_reason == "stop"
    answer = json.loads(response.choices[0].message.content)
    jsonschema.validate(answer, CITY)
    assert answer["city"] == "Paris" and answer["is_capital"] is True


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def test_a_required_tool_call_is_well_formed(client):
    response = chat(client, [{"role": "user", "content": "What's the weather in Paris?"}], max_tokens=60,
                    tools=[WEATHER], tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert "Paris" in arguments["city"]


def test_responses_through_the_openai_sdk(client):
    response = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                       max_output_tokens=64)
    assert response.status == "completed" and "Paris" in response.output_text
    assert not any(token in response.output_text for token in SPECIAL)


def test_messages_through_the_anthropic_sdk(server):
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300) as claude:
        message = claude.messages.create(model=MODEL, max_tokens=64, extra_body={"temperature": 0.0}, messages=QUESTION)
    assert message.stop_reason == "end_turn"
    assert "Paris" in message.content[0].text and not any(t in message.content[0].text for t in SPECIAL)


def test_logprobs_describe_the_greedy_choice(client):
    response = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        best = max(entry.top_logprobs, key=lambda t: t.logprob)
        assert best.token == entry.token and abs(best.logprob - entry.logprob) < 1e-5  # greedy took the top one
    # the end-of-turn token is counted and described, as vLLM does, and kept out of the text
    assert response.choices[0].finish_reason == "stop" and content[-1].token == "<|im_end|>"
    assert "".join(e.token for e in content[:-1]) == response.choices[0].message.content


def test_n_choices_are_each_a_whole_answer(client, server):
    response = chat(client, n=3, temperature=0.3, seed=1, max_tokens=40)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert choice.finish_reason in ("stop", "length") and choice.message.content.strip()
        assert not any(token in choice.message.content for token in SPECIAL)
    def tokens(text: str) -> int:
        body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
        return server.client.post(server.url + "/tokenize", json=body).json()["count"]

    # the usage counts every choice's tokens (the end-of-turn token of those that stopped included)
    assert response.usage.completion_tokens == sum(
        tokens(c.message.content) + (c.finish_reason == "stop") for c in response.choices)


def test_the_second_turn_reuses_the_first_turns_cached_prefix(client):
    first = chat(client, [{"role": "user", "content": "Name three rivers in Europe, briefly."}], max_tokens=48)
    history = [{"role": "user", "content": "Name three rivers in Europe, briefly."},
               {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "Which of them is the longest?"}]
    second = chat(client, history, max_tokens=48)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 - 16  # the first prompt's whole blocks, at least
    assert 0 < cached < second.usage.prompt_tokens
    assert second.choices[0].message.content.strip()
