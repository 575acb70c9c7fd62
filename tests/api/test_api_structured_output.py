"""Structured output (response_format, vLLM's structured_outputs / guided_*) on a live server.

tidal-tiny has random weights: at temperature 1 its text is noise, so every valid document
below is the grammar's doing. The schemas have finite languages (enums, bounded integers,
short strings), so compact JSON must close well within max_tokens whatever the model does.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import jsonschema
import pytest
import xgrammar
import xgrammar.testing
from live_server import parse_metrics

from .support import assert_openai_error, sse_chunks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "ok", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 200


SERVER_ARGS = ("--min-step-time", "0.01", "--num-kv-blocks", "256")



def test_json_schema_output_is_valid_for_every_seed(client):
    """24 seeds at temperature 1, all in flight at once (one batched mask per step)."""
    def one(seed: int):
        return client.chat.completions.create(model="tidal-tiny", messages=MESSAGES, temperature=1.0, seed=seed,
                                              max_tokens=MAX_TOKENS, response_format=RESPONSE_FORMAT)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(24)))
    texts = set()
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        text = choice.message.content
        jsonschema.validate(json.loads(text), SCHEMA)  # strict json.loads: no raw control characters
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text  # compact: no free whitespace
        texts.add(text)
    assert len(texts) > 12  # the model still chooses: seeds give different documents


def test_streamed_json_schema_parses(server):
    body = {"model": "tidal-tiny", "messages": MESSAGES, "temperature": 1.0, "seed": 5, "max_tokens": MAX_TOKENS,
            "response_format": RESPONSE_FORMAT, "stream": True}
    chunks = sse_chunks(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).content)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_json_object(client):
    json_grammar = xgrammar.Grammar.builtin_json_grammar()
    finished = 0
    for seed in range(3):
        out = client.chat.completions.create(model="tidal-tiny", messages=MESSAGES, temperature=1.0, seed=seed,
                                             max_tokens=400, response_format={"type": "json_object"})
        choice = out.choices[0]
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
        else:  # an open-ended object may run to max_tokens: then what came is the start of a JSON document
            assert choice.finish_reason == "length" and out.usage.completion_tokens == 400
            assert xgrammar.testing._is_grammar_accept_string(json_grammar, text, require_termination=False), text
    assert finished  # a whole document was checked at least once


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, lambda t: t in ("yes", "no", "maybe")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": r"[a-c]{3}-[0-9]{2}"}}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}},
     lambda t: jsonschema.validate(json.loads(t), {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                                   "maxItems": 3}) is None),
    ({"structured_outputs": {"grammar": 'root ::= "A" ("b" | "c")'}}, lambda t: t in ("Ab", "Ac")),
])
def test_vllm_structured_outputs_fields(server, extra, check):
    for seed in range(3):
        body = {"model": "tidal-tiny", "prompt": "Answer:", "temperature": 1.0, "seed": seed, "max_tokens": 60,
                **extra}
        choice = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
])
def test_bad_constraints_are_400_before_any_byte(server, extra, param, stream):
    body = {"model": "tidal-tiny", "messages": MESSAGES, "max_tokens": 8, "stream": stream, **extra}
    assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60), 400, param)


def _metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)


def test_cancelling_a_constrained_stream_frees_all_kv(server):
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    body = {"model": "tidal-tiny", "messages": MESSAGES, "max_tokens": 1000, "stream": True, "temperature": 1.0,
            "ignore_eos": True, "stream_interval": 1, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)
        assert _metrics(server)["tidal:kv_cache_blocks_used"] > 0
    deadline = time.monotonic() + 10
    while True:
        m = _metrics(server)
        if m["tidal:kv_cache_blocks_used"] == 0 and m["tidal:frontend_requests_active"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def test_openai_sdk_parse_with_a_pydantic_model(client):
    """The SDK's ``parse`` helper sends a strict schema built from a pydantic model ($defs, $ref,
    enums) and parses the answer back into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = Field(ge=0, le=4)

    class Owner(BaseModel):
        name: str = Field(max_length=10)
        pets: list[Pet] = Field(max_length=2)
        verified: bool

    for seed in range(4):
        out = client.chat.completions.parse(model="tidal-tiny", messages=MESSAGES, temperature=1.0, seed=seed,
                                            max_tokens=MAX_TOKENS, response_format=Owner)
        owner = out.choices[0].message.parsed
        assert isinstance(owner, Owner) and all(isinstance(p, Pet) for p in owner.pets)
