"""Issue 23 rows 4 and 5: every choice of an n > 1 request is read as its output comes.

Before the fix the choices were read one after another: without stream, the unread choices'
output piled up past ``--stream-stall-timeout`` while the first was collected (a 503
``slow_client`` after a 200's worth of work); with stream, the reader waited on a choice still
queued (``--max-num-seqs`` below n) while the running ones went unread. Here the stall timeout
is 2 s and each choice takes at least 200 steps of 20 ms, with two of the four queued behind the
other two (two rounds: 8 s). Both tests fail with the old tidal/openai/choices.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import LiveServer

MAX_TOKENS = 200
BODY = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": 4}


@pytest.fixture(scope="module")
def server():
    with LiveServer("--max-model-len", "256", "--num-kv-blocks", "128", "--max-num-seqs", "2",
                    "--stream-stall-timeout", "2", "--min-step-time", "0.02") as live:
        yield live


def test_choices_longer_than_the_stall_timeout_all_answer(server):
    response = httpx.post(server.url + "/v1/completions", json=BODY, timeout=120)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in choices), choices
    assert response.json()["usage"]["completion_tokens"] == 4 * MAX_TOKENS
    server.wait_idle()


def test_streamed_choices_queued_behind_others_all_stream_to_their_end(server):
    finish, errors = {}, []
    with httpx.stream("POST", server.url + "/v1/completions", json={**BODY, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            errors.append(chunk)
            continue
        for choice in chunk["choices"]:
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
    assert not errors, errors
    assert finish == {i: "length" for i in range(4)}
    server.wait_idle()
