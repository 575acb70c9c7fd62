"""Speculative decoding on the real model: SmolLM2-135M-Instruct's Q4_1 GGUF served without and with
``--speculative-config`` (n-gram, 4 tokens; and a draft model: the same model as a bf16 directory), one
server per setting for the whole module. What a user
depends on: the same greedy tokens and the same logprobs with speculation as without, on both APIs,
streamed and not, with n > 1; structured output still valid; and the counters showing that proposals
were made and accepted (a prompt that asks the model to repeat a given text, where n-gram lookup pays).

Greedy requests only, so the two servers must agree token for token; max_tokens stays short. Every server runs
``--dtype float32``: under ``--dtype auto`` a GGUF's activations are rounded to int8 blocks, and a verification
pass, a prefill and a decode round the same row's sums in different orders, which can turn a near-tie greedy
token (seen once in about five runs); in float32 those differences are ~1e-6, far below any margin here."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import openai
import pytest

from live_server import LiveServer

pytestmark = pytest.mark.slow

MODEL = "smollm2"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
TEXT = ("The library opens at nine on weekdays and at ten on Saturdays. Members may borrow six books for "
        "three weeks, and late returns cost twenty cents a day.")
GROUNDED = f"Repeat this text exactly: {TEXT}"
PROMPTS = [
    GROUNDED,
    "What is the capital of France?",
    "Copy this list: apples, pears, plums, apples, pears, plums, apples,",
]
DRAFT_PROMPTS = ["Name the colours of the rainbow, in order.", "Write one sentence about the moon."]
LOGPROB_TOLERANCE = 1e-3  # a verification pass computes several rows at once; the sums may round apart


@pytest.fixture(scope="module")
def servers(smollm2_gguf, smollm2_dir, server_pool):
    # smollm2_dir: the GGUF's tokenizer is converted once (cached) before either server's clock starts
    common = ("--model", str(smollm2_gguf), "--served-model-name", MODEL, "--max-model-len", "2048", "--no-ui",
              "--dtype", "float32")
    names = {"smollm2-spec-off": common,
             "smollm2-spec-on": (*common, "--vllm-metric-names", "--speculative-config", SPEC)}
    for name, args in names.items():  # both start at once, through the pool's start slots
        server_pool.start(name, *args)
    yield [server_pool.get(name, *args) for name, args in names.items()]
    server_pool.release(*names)


@pytest.fixture(scope="module")
def draft_server(smollm2_gguf, smollm2_dir, smollm2_hf_dir, server_pool):
    """The GGUF served with its bf16 twin as the draft model."""
    spec = json.dumps({"method": "draft_model", "model": smollm2_hf_dir, "num_speculative_tokens": 3})
    args = ("--model", str(smollm2_gguf), "--served-model-name", MODEL, "--max-model-len", "2048", "--no-ui",
            "--dtype", "float32", "--vllm-metric-names", "--speculative-config", spec)
    yield server_pool.get("smollm2-spec-draft", *args)
    server_pool.release("smollm2-spec-draft")


def post(server: LiveServer, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json={"model": MODEL, "temperature": 0, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: LiveServer, path: str, body: dict) -> list[str]:
    """The text of each choice of a streamed answer."""
    texts: dict[int, str] = {}
    request = {"model": MODEL, "temperature": 0, **body, "stream": True}
    with httpx.stream("POST", server.url + path, json=request, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                piece = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return [texts[i] for i in sorted(texts)]


def chat_tokens(answer: dict) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token, logprob, top logprobs) of each generated token of a chat answer's one choice."""
    return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in answer["choices"][0]["logprobs"]["content"]]


def assert_same_logprobs(off: list[float], on: list[float]) -> None:
    assert len(off) == len(on)
    for a, b in zip(off, on):
        assert math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE), (off, on)


def test_greedy_chat_is_the_same_token_for_token_with_its_logprobs(servers):
    off, on = servers
    for prompt in PROMPTS:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "logprobs": True,
                "top_logprobs": 2}
        a, b = post(off, "/v1/chat/completions", body), post(on, "/v1/chat/completions", body)
        assert [t for t, _, _ in chat_tokens(a)] == [t for t, _, _ in chat_tokens(b)], prompt
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
        assert a["usage"] == b["usage"]
        assert_same_logprobs([lp for _, lp, _ in chat_tokens(a)], [lp for _, lp, _ in chat_tokens(b)])
        for (_, _, top_a), (_, _, top_b) in zip(chat_tokens(a), chat_tokens(b)):
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            assert_same_logprobs([lp for _, lp in top_a], [lp for _, lp in top_b])
        assert stream(on, "/v1/chat/completions", body) == [a["choices"][0]["message"]["content"]]


def test_the_grounded_prompt_is_repeated_and_accepted(servers):
    off, on = servers
    before = on.metrics()
    body = {"messages": [{"role": "user", "content": GROUNDED}], "max_tokens": 40}
    answer = post(on, "/v1/chat/completions", body)
    after = on.metrics()
    assert TEXT[TEXT.index("Members"):] in answer["choices"][0]["message"]["content"]  # the model copies it
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before["vllm:spec_decode_num_accepted_tokens_total"]
    drafted = after["vllm:spec_decode_num_draft_tokens_total"] - before["vllm:spec_decode_num_draft_tokens_total"]
    # a copied text is proposed from the prompt and mostly accepted: fewer steps than tokens
    assert accepted >= answer["usage"]["completion_tokens"] // 4 and accepted <= drafted
    assert after["vllm:spec_decode_num_drafts_total"] > before["vllm:spec_decode_num_drafts_total"]
    assert after['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",position="0"}'] > \
        before['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",position="0"}']
    for tidal, vllm in (("tidal:spec_decode_drafts_total", "vllm:spec_decode_num_drafts_total"),
                        ("tidal:spec_decode_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
                        ("tidal:spec_decode_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")):
        assert after[tidal] == after[vllm], tidal
    assert off.metrics()["tidal:spec_decode_drafts_total"] == 0


def test_a_repeated_answer_is_proposed_from_the_pool_shared_across_requests(servers):
    """A question asked again (a new request, with nothing to copy in its prompt) is answered the same, and
    its proposals come from the first answer's n-grams: far more accepted the second time."""
    off, on = servers
    body = {"messages": [{"role": "user", "content": "Describe a lighthouse at night in two sentences."}],
            "max_tokens": 48}

    def accepted_by(request: dict) -> tuple[str, float]:
        before = on.metrics()["vllm:spec_decode_num_accepted_tokens_total"]
        text = post(on, "/v1/chat/completions", request)["choices"][0]["message"]["content"]
        return text, on.metrics()["vllm:spec_decode_num_accepted_tokens_total"] - before

    first_text, first = accepted_by(body)
    second_text, second = accepted_by(body)
    assert second_text == first_text == post(off, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert second >= first + 10, (first, second)


def test_completions_with_n_choices_streamed_and_not(servers):
    off, on = servers
    body = {"prompt": f"{TEXT}\n\nThe same text again, word for word:\n\n{TEXT[:30]}", "max_tokens": 32, "n": 2,
            "logprobs": 1}
    a, b = post(off, "/v1/completions", body), post(on, "/v1/completions", body)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert [c["logprobs"]["tokens"] for c in a["choices"]] == [c["logprobs"]["tokens"] for c in b["choices"]]
    for choice_a, choice_b in zip(a["choices"], b["choices"]):
        assert_same_logprobs(choice_a["logprobs"]["token_logprobs"], choice_b["logprobs"]["token_logprobs"])
    assert a["usage"] == b["usage"]
    assert stream(off, "/v1/completions", body) == stream(on, "/v1/completions", body) == \
        [c["text"] for c in a["choices"]]


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                        "country": {"type": "string", "maxLength": 40}, "is_capital": {"type": "boolean"}},
        "required": ["city", "country", "is_capital"], "additionalProperties": False}


def test_json_schema_output_is_valid_and_the_same(servers):
    off, on = servers
    body = {"messages": [{"role": "user", "content": 'Describe Paris as JSON like {"city": "Paris", '
                                                     '"country": "France", "is_capital": true}.'}],
            "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}}
    before = on.metrics()["tidal:spec_decode_draft_tokens_total"]
    a, b = post(off, "/v1/chat/completions", body), post(on, "/v1/chat/completions", body)
    assert b["choices"][0]["finish_reason"] == "stop"
    answer = json.loads(b["choices"][0]["message"]["content"])
    jsonschema.validate(answer, CITY)
    assert answer["city"] == "Paris"
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert on.metrics()["tidal:spec_decode_draft_tokens_total"] > before  # the grammar let proposals through
    on.wait_idle()


def test_a_draft_model_through_the_openai_sdk(servers, draft_server):
    """The same greedy answers as without speculation, streamed and not; most proposals accepted."""
    off = servers[0]
    before = draft_server.metrics()
    with openai.OpenAI(base_url=off.url + "/v1", api_key="none", max_retries=0, timeout=300) as plain, \
            openai.OpenAI(base_url=draft_server.url + "/v1", api_key="none", max_retries=0, timeout=300) as drafted:
        for prompt in DRAFT_PROMPTS:
            request = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 40,
                       "temperature": 0, "logprobs": True}
            a, b = plain.chat.completions.create(**request), drafted.chat.completions.create(**request)
            assert b.choices[0].message.content == a.choices[0].message.content, prompt
            assert [t.token for t in b.choices[0].logprobs.content] == [t.token for t in a.choices[0].logprobs.content]
            assert_same_logprobs([t.logprob for t in a.choices[0].logprobs.content],
                                 [t.logprob for t in b.choices[0].logprobs.content])
            assert b.usage.completion_tokens == a.usage.completion_tokens
        chunks = drafted.chat.completions.create(**request, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    after = draft_server.metrics()
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before["vllm:spec_decode_num_accepted_tokens_total"]
    drafted_tokens = after["vllm:spec_decode_num_draft_tokens_total"] - before["vllm:spec_decode_num_draft_tokens_total"]
    # the draft is the target at another precision: it proposes what the target picks, nearly always
    assert drafted_tokens > 0 and accepted >= 0.7 * drafted_tokens
    assert after["tidal:spec_decode_accepted_tokens_total"] == after["vllm:spec_decode_num_accepted_tokens_total"]
