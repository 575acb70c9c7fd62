"""logprobs through a live server: values against transformers' own logits, shapes through the SDK.

The server runs a tiny random-weight float32 Qwen2 checkpoint (tests/hf_models.py) that
transformers loads too. Prompts are token ids and ``return_tokens_as_token_ids`` names every
token by id, so each reported value can be looked up in transformers' log-softmax exactly.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from hf_models import make_hf_model
from live_server import LiveServer

from .support import assert_openai_error, sse_chunks

PROMPT = [5, 300, 41, 1200, 77, 9, 640]
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2-logprobs"), seed=3)


@pytest.fixture(scope="module")
def server(model_dir):
    # float32 explicitly: --dtype auto is bf16 on CPUs with native bf16, and the values are compared exactly
    with LiveServer("--model", model_dir, "--served-model-name", "m", "--num-kv-blocks", "64",
                    "--dtype", "float32") as s:
        yield s



@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """log-softmax of transformers' float32 logits after each prefix of a token sequence."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def run(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return run


def _id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_logprobs_match_transformers(client, hf_logprobs, temperature):
    """Sampled-token and top-5 logprobs equal transformers' log-softmax at every position,
    also at temperature 1 with top_p (the values are taken before any sampling transform)."""
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=temperature,
                                    top_p=0.5, seed=7, logprobs=5,
                                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = out.choices[0].logprobs
    generated = [_id(t) for t in lp.tokens]
    assert len(generated) == 12 == len(lp.token_logprobs) == len(lp.top_logprobs)
    reference = hf_logprobs(PROMPT + generated)[len(PROMPT) - 1:-1]  # the rows that predicted them
    for step, (token_id, value, top) in enumerate(zip(generated, lp.token_logprobs, lp.top_logprobs)):
        assert abs(value - reference[step, token_id].item()) < TOLERANCE, step
        want_values, want_ids = reference[step].topk(5)
        assert len(top) == 5
        for token, got in top.items():
            assert abs(got - reference[step, _id(token)].item()) < TOLERANCE, (step, token)
        assert sorted(top.values(), reverse=True) == pytest.approx(want_values.tolist(), abs=TOLERANCE)
        if temperature == 0.0:
            assert token_id == want_ids[0].item()


def test_chat_logprobs_stream_equals_non_stream(client):
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
                  logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == 8 == full.usage.completion_tokens
    assert "".join(c.token for c in content) == full.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top token was sampled
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_chat_logprobs_without_top_logprobs(client):
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                         logprobs=True, extra_body={"ignore_eos": True})
    assert [len(c.top_logprobs) for c in out.choices[0].logprobs.content] == [0, 0, 0]
    assert all(math.isfinite(c.logprob) and c.logprob <= 0 for c in out.choices[0].logprobs.content)


def test_completion_stream_logprobs_and_text_offset(server):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "stream": True,
            "stream_interval": 2, "ignore_eos": True}
    chunks = sse_chunks(httpx.post(server.url + "/v1/completions", json=body, timeout=60).content)
    tokens, offsets, text = [], [], ""
    for chunk in chunks:
        choice = chunk["choices"][0]
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert all(len(top) <= 2 for top in lp["top_logprobs"])
        tokens += lp["tokens"]
        offsets += lp["text_offset"]
        text += choice["text"]
    assert len(tokens) == 6 and "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(6)]


def test_no_logprobs_unless_asked(client):
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.choices[0].logprobs is None
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=2).choices[0].logprobs is None


@pytest.mark.parametrize("path, body, ok", [
    ("chat", {"logprobs": True, "top_logprobs": 20}, True),
    ("chat", {"logprobs": True, "top_logprobs": 21}, False),
    ("chat", {"logprobs": True, "top_logprobs": -1}, False),
    ("chat", {"top_logprobs": 2}, False),  # needs logprobs: true
    ("chat", {"logprobs": 3}, False),  # chat logprobs is a boolean
    ("completions", {"logprobs": 5}, True),
    ("completions", {"logprobs": 6}, False),
    ("completions", {"logprobs": -1}, False),
    ("completions", {"logprobs": True}, False),
])
def test_logprobs_bounds(server, path, body, ok):
    base = {"model": "m", "max_tokens": 1}
    base.update({"messages": [{"role": "user", "content": "Hi"}]} if path == "chat" else {"prompt": PROMPT})
    response = httpx.post(f"{server.url}/v1/{'chat/completions' if path == 'chat' else path}",
                          json={**base, **body}, timeout=60)
    if ok:
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        tops = choice["logprobs"]["content"][0]["top_logprobs"] if path == "chat" else \
            choice["logprobs"]["top_logprobs"][0]
        assert len(tops) == (20 if path == "chat" else 5)
    else:
        param = "top_logprobs" if "top_logprobs" in body else "logprobs"
        assert_openai_error(response, 400, param)
