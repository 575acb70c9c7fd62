"""OpenAI conformance against a live server, with the clients people actually use.

The official ``openai`` SDK (sync and async, streaming and not, chat and completions), raw
httpx for the exact SSE bytes, and curl. tidal-tiny never emits EOS, so a request runs to
``max_tokens`` unless a stop condition ends it; at temperature 0 its text is deterministic,
which lets every streamed text be checked against the non-streamed one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import httpx
import openai
import pytest
import trio
from tokenizers import Tokenizer

import tidal

from .support import API_KEY, AUTH, HELLO, MAX_MODEL_LEN, METRIC_NAMES, SERVED_MODEL, sse_chunks

GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def client(api_server):
    with openai.OpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def aclient(api_server):
    # One per test: an async client belongs to the event loop (trio run) that first uses it.
    return openai.AsyncOpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy(client):
    """The non-streamed greedy chat completion of HELLO, GREEDY_TOKENS tokens long."""
    return client.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=GREEDY_TOKENS,
                                          temperature=0)


def chat(client, **kwargs):
    kwargs.setdefault("messages", HELLO)
    return client.chat.completions.create(model=SERVED_MODEL, **kwargs)


def check_chat_stream(chunks, *, max_tokens: int | None, finish_reason: str, usage: bool) -> str:
    """Assert the shape of a streamed chat completion; return its text."""
    content = [c for c in chunks if c.choices]
    assert content, chunks
    if usage:
        assert not chunks[-1].choices and chunks[-1].usage is not None
        assert len(content) == len(chunks) - 1
        assert chunks[-1].usage.completion_tokens == max_tokens
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + max_tokens
    else:
        assert len(content) == len(chunks)
    first = content[0].choices[0]
    assert first.delta.role == "assistant"
    assert first.delta.content, "the first chunk must carry the first token, not an empty string"
    for chunk in content:
        assert chunk.object == "chat.completion.chunk"
        assert chunk.id == content[0].id and chunk.id.startswith("chatcmpl-")
        assert chunk.model == SERVED_MODEL
        assert [choice.index for choice in chunk.choices] == [0]
    for chunk in content[1:]:
        assert chunk.choices[0].delta.role is None
    for chunk in content[:-1]:
        assert chunk.choices[0].finish_reason is None
        assert chunk.choices[0].delta.content, "no empty chunk in the middle of a stream"
    assert content[-1].choices[0].finish_reason == finish_reason
    return "".join(c.choices[0].delta.content or "" for c in content)


# ------------------------------------------------------------------ models, health


def test_models_lists_the_served_model_name(client, api_server):
    assert [m.id for m in client.models.list().data] == [SERVED_MODEL]
    body = httpx.get(api_server.url + "/v1/models", headers=AUTH).json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == SERVED_MODEL and body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_models_default_to_the_model_argument(ws_server):
    """Without --served-model-name the model is called by its --model value."""
    assert [m["id"] for m in httpx.get(ws_server.url + "/v1/models").json()["data"]] == ["tidal-tiny"]


def test_health_and_metrics_need_no_api_key(api_server):
    assert httpx.get(api_server.url + "/health").status_code == 200
    response = httpx.get(api_server.url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")


# ------------------------------------------------------------------ chat


def test_greedy_chat_is_deterministic_and_complete(client, greedy):
    assert greedy.object == "chat.completion" and greedy.model == SERVED_MODEL
    choice = greedy.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    assert greedy.usage.completion_tokens == GREEDY_TOKENS
    assert greedy.usage.prompt_tokens > 0
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + GREEDY_TOKENS
    again = chat(client, max_tokens=GREEDY_TOKENS, temperature=0)
    assert again.choices[0].message.content == choice.message.content


def test_sync_chat_stream_matches_the_non_streamed_text(client, greedy):
    chunks = list(chat(client, max_tokens=GREEDY_TOKENS, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    text = check_chat_stream(chunks, max_tokens=GREEDY_TOKENS, finish_reason="length", usage=True)
    assert text == greedy.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == greedy.usage.prompt_tokens


async def test_async_chat_stream_without_usage_has_no_usage_chunk(aclient, greedy):
    stream = await aclient.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=GREEDY_TOKENS,
                                                   temperature=0, stream=True)
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is None for chunk in chunks)
    text = check_chat_stream(chunks, max_tokens=None, finish_reason="length", usage=False)
    assert text == greedy.choices[0].message.content


async def test_async_chat_non_streamed(aclient):
    response = await aclient.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=5)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5


# ------------------------------------------------------------------ completions


def test_sync_completions_stream_and_non_stream(client):
    full = client.completions.create(model=SERVED_MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.model == SERVED_MODEL
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=SERVED_MODEL, prompt="Once upon a time", max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    texts = [c for c in chunks if c.choices]
    assert all(c.object == "text_completion" and c.id.startswith("cmpl-") for c in texts)
    assert all(c.choices[0].text for c in texts[:-1])
    assert [c.choices[0].finish_reason for c in texts] == [None] * (len(texts) - 1) + ["length"]
    assert "".join(c.choices[0].text for c in texts) == full.choices[0].text


async def test_async_completions_stream_with_token_id_prompt(aclient):
    stream = await aclient.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7, 8], max_tokens=6, stream=True,
                                              stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage.completion_tokens == 6
    # the prompt is exactly these ids: no BOS is added to a token-id prompt
    assert chunks[-1].usage.prompt_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


# ------------------------------------------------------------------ the raw stream


def test_raw_sse_bytes_end_with_done(api_server, greedy):
    body = {"model": SERVED_MODEL, "messages": HELLO, "max_tokens": GREEDY_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", api_server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        raw = r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = sse_chunks(raw)
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == GREEDY_TOKENS
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    for chunk in content:
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == greedy.choices[0].message.content


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_sse(api_server, greedy):
    body = json.dumps({"model": SERVED_MODEL, "messages": HELLO, "max_tokens": GREEDY_TOKENS, "temperature": 0,
                       "stream": True})
    result = subprocess.run(
        ["curl", "-N", "-sS", "--fail-with-body", "--max-time", "60", api_server.url + "/v1/chat/completions",
         "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {API_KEY}", "-d", body],
        capture_output=True, timeout=90, check=True)
    chunks = sse_chunks(result.stdout)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == greedy.choices[0].message.content


# ------------------------------------------------------------------ sampling fields


async def test_seed_makes_sampling_reproducible(aclient):
    async def sample(seed: int) -> str:
        response = await aclient.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=8,
                                                         temperature=1.0, seed=seed)
        return response.choices[0].message.content

    texts: dict[int, str] = {}
    again: list[str] = []

    async def run(index: int, seed: int) -> None:
        text = await sample(seed)
        if index < 4:
            texts[seed] = text
        else:
            again.append(text)

    async with trio.open_nursery() as nursery:  # batched together: seeds must not depend on batch mates
        for index, seed in enumerate([11, 12, 13, 14, 11]):
            nursery.start_soon(run, index, seed)
    assert again == [texts[11]]
    assert len(set(texts.values())) >= 2, texts


async def test_truncating_samplers_reduce_to_greedy(aclient, greedy):
    """top_k=1, top_p near 0 and min_p=1 each keep only the most likely token: greedy text at temperature 1."""
    results: dict[str, str] = {}

    async def run(name: str, **fields) -> None:
        response = await aclient.chat.completions.create(model=SERVED_MODEL, messages=HELLO,
                                                         max_tokens=GREEDY_TOKENS, temperature=1.0, **fields)
        results[name] = response.choices[0].message.content

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: run("top_k", extra_body={"top_k": 1}))
        nursery.start_soon(lambda: run("top_p", top_p=1e-6))
        nursery.start_soon(lambda: run("min_p", extra_body={"min_p": 1.0}))
    assert results == dict.fromkeys(["top_k", "top_p", "min_p"], greedy.choices[0].message.content)


def test_penalties_priority_and_ignore_eos_are_accepted(client):
    response = chat(client, max_tokens=6, presence_penalty=1.5, frequency_penalty=-0.5,
                    extra_body={"repetition_penalty": 1.3, "ignore_eos": True, "priority": -3,
                                "top_k": 50, "top_p": 0.9, "min_p": 0.05})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 6


def test_max_completion_tokens_wins_over_max_tokens(client):
    response = chat(client, max_tokens=9, max_completion_tokens=4)
    assert response.usage.completion_tokens == 4
    assert response.choices[0].finish_reason == "length"


def pick_stop_string(text: str) -> str:
    """A short ASCII word-ish piece from the middle of ``text`` (whose first occurrence is there)."""
    for start in range(len(text) // 3, len(text) - 3):
        piece = text[start:start + 3]
        if piece.isascii() and piece.isalnum() and text.find(piece) == start:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("as_list", [False, True], ids=["string", "list"])
def test_stop_string_cuts_the_text_before_it(client, greedy, as_list):
    text = greedy.choices[0].message.content
    stop = pick_stop_string(text)
    expected = text[:text.find(stop)]
    assert expected
    stop_field = ["never-generated-zz", stop] if as_list else stop
    full = chat(client, max_tokens=GREEDY_TOKENS, temperature=0, stop=stop_field)
    assert full.choices[0].message.content == expected
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].model_extra["stop_reason"] == stop  # vLLM's extension: which stop matched
    assert full.usage.completion_tokens < GREEDY_TOKENS
    chunks = list(chat(client, max_tokens=GREEDY_TOKENS, temperature=0, stop=stop_field, stream=True,
                       stream_options={"include_usage": True}))
    assert check_chat_stream(chunks, max_tokens=full.usage.completion_tokens, finish_reason="stop",
                             usage=True) == expected


def test_stop_token_ids_end_the_completion(client):
    """Stop at the 4th greedy token: the text is that of the first three, finish_reason "stop"."""
    def greedy_text(n: int) -> str:
        return client.completions.create(model=SERVED_MODEL, prompt="Once upon a time", max_tokens=n,
                                         temperature=0).choices[0].text

    three, four = greedy_text(3), greedy_text(4)
    assert four.startswith(three) and len(four) > len(three)
    tokenizer = Tokenizer.from_file(os.path.join(os.path.dirname(tidal.__file__), "assets", "tidal-tiny",
                                                 "tokenizer.json"))
    (fourth_id,) = tokenizer.encode(four[len(three):], add_special_tokens=False).ids
    response = client.completions.create(model=SERVED_MODEL, prompt="Once upon a time", max_tokens=12,
                                         temperature=0, extra_body={"stop_token_ids": [fourth_id]})
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (three, "stop")
    assert choice.model_extra["stop_reason"] == fourth_id
    assert response.usage.completion_tokens == 4  # the stop token is generated, not shown
    chunks = list(client.completions.create(model=SERVED_MODEL, prompt="Once upon a time", max_tokens=12,
                                            temperature=0, stream=True, extra_body={"stop_token_ids": [fourth_id]}))
    assert "".join(c.choices[0].text for c in chunks) == three
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]


def test_n_above_its_bound_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=4, n=17)
    assert info.value.status_code == 400
    assert info.value.param == "n" and "between 1 and 16" in info.value.body["message"]


# ------------------------------------------------------------------ metrics


def test_metrics_count_what_the_responses_report(client, api_server):
    before = api_server.wait_idle()
    response = chat(client, max_tokens=8, temperature=0)
    after = api_server.wait_idle()
    text = httpx.get(api_server.url + "/metrics").text
    for name in METRIC_NAMES:  # a sample of each (histograms: their _count)
        assert re.search(rf"^{re.escape(name)}(_count)?{{", text, re.MULTILINE), f"{name} is not exposed"

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("tidal:prompt_tokens_total") == response.usage.prompt_tokens
    assert delta("tidal:generation_tokens_total") == response.usage.completion_tokens == 8
    for histogram in ("time_to_first_token", "time_to_first_output", "e2e_request_latency", "request_queue_time"):
        assert delta(f"tidal:{histogram}_seconds_count") == 1
        assert after[f"tidal:{histogram}_seconds_sum"] > before[f"tidal:{histogram}_seconds_sum"]
    assert 1 <= delta("tidal:inter_output_latency_seconds_count") <= 7  # one per engine output after the first
    assert delta("tidal:inter_token_latency_seconds_count") == 0  # not streamed: no gap between frames
    finished = f'tidal:requests_finished_total{{finished_reason="length",model_name="{SERVED_MODEL}"}}'
    assert after[finished] - before.get(finished, 0) == 1
    assert after["tidal:kv_cache_blocks_total"] == 128
    assert after["tidal:engine_steps_total"] > before["tidal:engine_steps_total"]
