"""Documented request bounds at N and N+1, through a live ``tidal serve`` and real clients.

The server runs ``tidal-test`` (tidal-tiny's tokenizer, a forward pass that costs nothing): its
next token is a fixed function of the current one with logit 100 and every other token 0, so greedy
output is deterministic, and wherever a grammar masks that token the greedy choice among the rest
(all 0) is the lowest allowed token id. The bounds (docs/admission.md, "Bounds and their tests"):

* ``n``: at most 16 choices; ``n=16`` is served with 16 choices, ``n=17`` is a 400;
* ``cached_tokens`` of an n > 1 response: the prompt's cache hits, counted once;
* tool names: 64 characters pass, 65 are a 400 naming the field;
* tool_choice "required": at most 16 parallel calls, even where the model would write more;
* logprobs of a constrained request are the model's, taken before the grammar's mask.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from api.support import assert_openai_error

from tidal.openai.requests import MAX_N
from tidal.service.tool_calls import MAX_PARALLEL_TOOL_CALLS

# this module's server; conftest.py starts it alongside the other modules' servers
SERVER_ARGS = ("--model", "tidal-test", "--num-kv-blocks", "512")
MODEL = "tidal-test"
BLOCK_SIZE = 16  # the server's default --block-size
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


# ------------------------------------------------------------------ n


def test_n_16_is_served_and_17_is_refused(sdk, http):
    assert MAX_N == 16
    out = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, n=16, max_tokens=4, temperature=1.0, seed=1)
    assert sorted(c.index for c in out.choices) == list(range(16))
    assert all(c.finish_reason == "length" and c.message.content for c in out.choices)
    assert out.usage.completion_tokens == 16 * 4
    refused = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "n": 17, "max_tokens": 4})
    assert_openai_error(refused, 400, "n")


def test_cached_tokens_of_n_choices_count_the_prompts_cache_hits_once(sdk):
    prompt = "The bound on cached tokens with several choices. " * 6  # several full blocks
    first = sdk.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3)
    prompt_tokens = first.usage.prompt_tokens
    full_blocks = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt token is always computed
    assert full_blocks >= 2 * BLOCK_SIZE
    # the first sight of the prompt hits nothing (its forks reuse choice 0's prefill, which is not billed)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.completion_tokens == 4 * 3 and len(first.choices) == 4
    again = sdk.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3)
    assert again.usage.prompt_tokens == prompt_tokens  # the prompt counted once, not four times
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks
    alone = sdk.completions.create(model=MODEL, prompt=prompt, n=1, max_tokens=3)
    assert alone.usage.prompt_tokens_details.cached_tokens == full_blocks


# ------------------------------------------------------------------ tools


def ping_tool(name: str) -> dict:
    # arguments can only be {}: the one freedom left to the model is another call or the end of the list
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}


def test_a_tool_name_of_64_characters_passes_and_65_is_refused(sdk, http):
    name = "t" * 64
    out = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[ping_tool(name)], max_tokens=400,
                                      temperature=0, tool_choice={"type": "function", "function": {"name": name}})
    assert [c.function.name for c in out.choices[0].message.tool_calls] == [name]
    body = {"model": MODEL, "messages": MESSAGES, "tools": [ping_tool("t" * 65)], "max_tokens": 4}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "tools[0].function.name")
    assert "1-64" in error["message"]


def test_required_tool_calls_stop_at_16_where_the_model_would_write_more(sdk):
    assert MAX_PARALLEL_TOOL_CALLS == 16
    common = dict(model=MODEL, messages=MESSAGES, tools=[ping_tool("ping")], tool_choice="required",
                  temperature=0, max_tokens=2000)
    out = sdk.chat.completions.create(**common)
    choice = out.choices[0]
    # greedy tidal-test takes another call whenever the grammar allows one: only the bound ends the list,
    # well before max_tokens
    assert choice.finish_reason == "tool_calls" and out.usage.completion_tokens < 2000
    assert [c.function.name for c in choice.message.tool_calls] == ["ping"] * 16
    assert all(c.function.arguments == "{}" for c in choice.message.tool_calls)
    single = sdk.chat.completions.create(**common, parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


# ------------------------------------------------------------------ logprobs and the mask


def test_logprobs_of_a_constrained_request_are_taken_before_the_mask(http):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    free = http.post("/v1/completions", json=body).json()["choices"][0]
    digits = http.post("/v1/completions", json={**body, "guided_regex": "[0-9]{3}"}).json()["choices"][0]
    assert len(digits["text"]) == 3 and digits["text"].isdigit()
    free_first = free["logprobs"]["top_logprobs"][0]
    first = digits["logprobs"]["top_logprobs"][0]
    # the model's favourite first token (logprob ~0) is not a digit: the mask forbade it, yet it leads the
    # constrained request's top logprobs with the value the unconstrained request reports
    winner = max(free_first, key=free_first.get)
    assert not winner.isdigit() and winner in first
    assert first[winner] == pytest.approx(free_first[winner]) and free_first[winner] > -1e-3
    # the digit drawn has the model's logprob (~ -100: logit 0 beside the winner's 100), not the
    # renormalised one a post-mask value would give (-log of the number of allowed tokens, > -12)
    assert digits["logprobs"]["tokens"][0] == digits["text"][0]
    assert digits["logprobs"]["token_logprobs"][0] < -50
    assert all(math.isfinite(v) for v in digits["logprobs"]["token_logprobs"])
