"""Speculative decoding as a client sees it, on two live servers (tidal-tiny) with and without
``--speculative-config``: the same greedy answers on both APIs, streamed and not, with n > 1 and logprobs;
one frame per token; the counters under tidal's and vLLM's names.

Rules for determinism: greedy requests on tidal-tiny (fixed weights); prompts that repeat themselves, so
proposals are made and accepted (checked through the counters)."""

from __future__ import annotations

import json

import httpx
import pytest

from live_server import LiveServer, start_all, stop_all

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears,",
]


@pytest.fixture(scope="module")
def servers():
    pair = [LiveServer("--model", "tidal-tiny", "--no-ui", start_timeout=600),
            # 20 ms steps: time for the frontend to write a step's accepted tokens as frames of their own even
            # when the host is busy (a frontend that falls behind merges them, and counts it)
            LiveServer("--model", "tidal-tiny", "--no-ui", "--vllm-metric-names", "--speculative-config", SPEC,
                       "--min-step-time", "0.02", start_timeout=600)]
    start_all(pair)
    yield pair
    stop_all(pair)


def post(server: LiveServer, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: LiveServer, path: str, body: dict) -> tuple[list[str], list[dict]]:
    """(the content of each choice, every chunk) of a streamed answer."""
    chunks = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            piece = choice.get("text", None)
            if piece is None:
                piece = (choice.get("delta") or {}).get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return [texts[i] for i in sorted(texts)], chunks


def test_the_same_answers_with_and_without_speculation(servers):
    off, on = servers
    before = on.metrics()["tidal:spec_decode_accepted_tokens_total"]
    for prompt in PROMPTS:
        completion = {"model": "tidal-tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "n": 2,
                      "logprobs": 2}
        a, b = post(off, "/v1/completions", completion), post(on, "/v1/completions", completion)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
        assert [c["logprobs"]["tokens"] for c in a["choices"]] == [c["logprobs"]["tokens"] for c in b["choices"]]
        assert a["usage"] == b["usage"]
        assert stream(off, "/v1/completions", completion)[0] == stream(on, "/v1/completions", completion)[0] == \
            [c["text"] for c in a["choices"]]
        chat = {"model": "tidal-tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 40,
                "temperature": 0}
        a, b = post(off, "/v1/chat/completions", chat), post(on, "/v1/chat/completions", chat)
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert stream(on, "/v1/chat/completions", chat)[0] == [a["choices"][0]["message"]["content"]]
    assert on.metrics()["tidal:spec_decode_accepted_tokens_total"] - before >= 10


def test_accepted_tokens_stream_one_frame_each(servers):
    _, on = servers
    body = {"model": "tidal-tiny", "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    before = on.metrics()
    _, chunks = stream(on, "/v1/completions", body)
    after = on.metrics()
    frames = [c for c in chunks if c["choices"] and c["choices"][0].get("text")]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert after["tidal:spec_decode_accepted_tokens_total"] > before["tidal:spec_decode_accepted_tokens_total"]
    # each token is a frame of its own, unless the client fell behind and outputs were merged (counted)
    coalesced = after["tidal:stream_coalesced_chunks_total"] - before["tidal:stream_coalesced_chunks_total"]
    assert len(frames) + coalesced >= usage["completion_tokens"] - 1  # a last token can be held text-less
    assert len(frames) >= usage["completion_tokens"] // 2


def test_the_counters_move_under_both_names(servers):
    off, on = servers
    m = on.metrics()
    for tidal, vllm in (("tidal:spec_decode_drafts_total", "vllm:spec_decode_num_drafts_total"),
                        ("tidal:spec_decode_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
                        ("tidal:spec_decode_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")):
        assert m[tidal] == m[vllm] > 0, tidal
    assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tidal-tiny",position="0"}'] > 0
    assert m["tidal:spec_decode_accepted_tokens_total"] <= m["tidal:spec_decode_draft_tokens_total"]
    assert off.metrics()["tidal:spec_decode_drafts_total"] == 0
    on.wait_idle()
