"""The grammar path's bounds on a live server (issue 23 rows 7, 11, 12): what a client sees.

tidal-tiny has random weights: at temperature 1 its text is noise, so an exact choice or a
refusal below is the grammar's doing. The engine-side mechanics are in tests/gpu/test_grammar.py.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .support import assert_openai_error, sse_data

COMPILE_TIMEOUT = 0.5
SLOW_SCHEMA = {"enum": [f"value-{i:05d}" for i in range(20000)]}  # seconds to compile, even on a fast host


SERVER_ARGS = ("--min-step-time", "0.01", "--num-kv-blocks", "256", "--grammar-compile-timeout", str(COMPILE_TIMEOUT))


def completion(server, stream=False, **extra) -> httpx.Response:
    body = {"model": "tidal-tiny", "prompt": "Answer:", "temperature": 1.0, "max_tokens": 40, "stream": stream,
            **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def test_a_choice_outside_the_bmp_comes_back_exactly(server):
    choices = ["😀 yes", "no 🚀", "𝄞"]
    for seed in range(4):
        choice = completion(server, seed=seed, guided_choice=choices).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] in choices, choice


def test_a_compile_past_its_bound_is_a_400_and_the_next_schema_does_not_wait_for_it(server):
    refused = completion(server, guided_json=SLOW_SCHEMA)
    error = assert_openai_error(refused, 400, "guided_json")
    assert error["message"] == (f"The output constraint did not compile within {COMPILE_TIMEOUT:g} s "
                                "(--grammar-compile-timeout).")
    started = time.monotonic()
    quick = completion(server, seed=1, guided_regex="[ab]{3}").json()["choices"][0]
    assert quick["finish_reason"] == "stop" and len(quick["text"]) == 3
    assert time.monotonic() - started < 30  # the slow compile's thread is still busy; this one has its own


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_the_model_cannot_meet_is_an_error_never_a_stop(server, stream):
    control = {"type": "string", "pattern": "^\\x01$"}  # compact JSON never holds a raw control character
    response = completion(server, stream=stream, seed=1, guided_json=control)
    message = "The output constraint cannot be met: no token this model can produce continues it."
    if not stream:
        assert assert_openai_error(response, 400)["message"] == message
        return
    assert response.status_code == 200  # the first token ('"') was streamed before the dead end
    data = sse_data(response.content)
    assert data[-1] == "[DONE]"
    frames = [json.loads(d) for d in data[:-1]]
    assert frames[-1]["error"]["message"] == message
    assert all(choice["finish_reason"] is None for f in frames[:-1] for choice in f["choices"])
