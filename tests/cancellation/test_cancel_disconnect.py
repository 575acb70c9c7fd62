"""A client that disconnects is aborted wherever its request is: queued, prefilling, decoding, or done.

Server: ``--max-num-seqs 1 --max-num-batched-tokens 32 --min-step-time 0.1`` (one step
lasts 0.1 s; a second request waits; a 640-token prompt is prefilled in 20 steps).

The step clock. ``tidal:engine_steps_total`` and ``tidal:kv_cache_blocks_used`` in one /metrics
scrape come from the same engine report. ``S_d`` is the step count scraped right after
the client's ``close()``: the last step whose report the frontend had when the client was
gone (the abort reaches the engine about a millisecond later, while step ``S_d + 1`` is
in flight). ``S_f`` is the step count of the first scrape that shows every block free.
The engine drains its inbox between a forward pass and its postprocessing, so the step
in flight frees the blocks: ``S_f <= S_d + 1``. (``S_f == S_d`` when that step's report
landed between ``close()`` and the scrape.) With a single request there is no next step
to wait for: if the abort misses the mid-step drain, the engine finds it at the top of its
loop, has no work left and reports at once, still under step ``S_d + 1``.
"""

from __future__ import annotations

import math
import time

import openai

from cancel_helpers import (
    MODEL,
    RawHttp,
    aborted,
    all_aborts,
    completion_body,
    finish_reasons,
    labelled,
    poll,
    scrape,
    steps,
    unique_prompt,
    wait_blocks_free,
)

STEP = 0.1  # seq1_server's --min-step-time
BLOCK = 16


def test_disconnect_while_queued_never_runs(seq1_server):
    server = seq1_server
    m = scrape(server)
    aborts0 = aborted(m, "client_disconnect")
    generated0 = m["tidal:generation_tokens_total"]
    prompt_a = unique_prompt(17, seed=101)  # 17 tokens: 2 blocks, until A has 15 more
    with RawHttp(server.port, "/v1/completions", completion_body(prompt_a, 1000)) as running:
        running.next_chunk()  # A holds the only engine slot
        m = scrape(server)
        starts0 = m["tidal:request_queue_time_seconds_count"]  # observed when a request is first scheduled
        queued = RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(8, seed=102), 1000))
        poll(server, lambda m: m["tidal:num_requests_waiting"] == 1 and m["tidal:frontend_requests_active"] == 2)
        queued.close()  # B's client leaves before B has a response head

        samples = []
        m = poll(server, lambda m: samples.append(m) or (
            m["tidal:num_requests_waiting"] == 0 and m["tidal:frontend_requests_active"] == 1))
        # B never ran: A stayed the only running request and nothing but A held blocks.
        # A with k tokens generated holds at most ceil((17 + k) / 16) blocks (2 for most of
        # this test); B, scheduled, would have taken one more.
        for s in samples:
            assert s["tidal:num_requests_running"] == 1
            a_tokens = s["tidal:generation_tokens_total"] - generated0
            assert s["tidal:kv_cache_blocks_used"] <= math.ceil((17 + a_tokens) / BLOCK)
        assert m["tidal:request_queue_time_seconds_count"] == starts0, "the queued request was scheduled"
        assert aborted(m, "client_disconnect") == aborts0 + 1
    m = server.wait_idle()
    assert aborted(m, "client_disconnect") == aborts0 + 2


def test_disconnect_during_chunked_prefill(seq1_server):
    server = seq1_server
    prompt = unique_prompt(640, seed=103)  # 20 steps of 32 tokens: 2 s, far longer than this test needs
    m0 = scrape(server)
    with RawHttp(server.port, "/v1/completions", completion_body(prompt, 50)) as client:
        # the first 32-token chunk has run (2 blocks), the prompt is far from done
        m = poll(server, lambda m: m["tidal:kv_cache_blocks_used"] >= 2)
        client.close()
        m_d = scrape(server)
    assert 2 <= m["tidal:kv_cache_blocks_used"] < 640 // BLOCK
    m_f, seconds = wait_blocks_free(server)
    print(f"prefill abort: S_f - S_d = {steps(m_f) - steps(m_d)}, {seconds * 1000:.0f} ms at {STEP} s/step")
    assert steps(m_f) - steps(m_d) <= 1  # see the module docstring for what S_d and S_f are
    assert steps(m_f) - steps(m0) < 20, "the prefill ran to the end after the client left"
    assert m_f["tidal:generation_tokens_total"] == m0["tidal:generation_tokens_total"]
    assert m_f["tidal:time_to_first_token_seconds_count"] == m0["tidal:time_to_first_token_seconds_count"]
    m = server.wait_idle()
    assert aborted(m, "client_disconnect") == aborted(m0, "client_disconnect") + 1


def test_disconnect_during_decode_frees_blocks_within_one_step(seq1_server):
    server = seq1_server
    m0 = scrape(server)
    with RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(8, seed=104), 1000)) as client:
        for _ in range(5):
            client.next_chunk()
        client.close()
        closed_at = time.monotonic()
        m_d = scrape(server)
    assert m_d["tidal:kv_cache_blocks_used"] >= 1
    m_f, _ = wait_blocks_free(server)
    seconds = time.monotonic() - closed_at
    print(f"decode abort: S_f - S_d = {steps(m_f) - steps(m_d)}, blocks free {seconds * 1000:.0f} ms after "
          f"close at {STEP} s/step")
    assert steps(m_f) - steps(m_d) <= 1  # see the module docstring
    # wall clock, generously: one step plus a noisy shared machine's scheduling delays
    assert seconds < STEP + 1.0
    m = server.wait_idle()
    assert aborted(m, "client_disconnect") == aborted(m0, "client_disconnect") + 1


def test_disconnect_after_finish_is_a_noop(seq1_server):
    server = seq1_server
    m0 = scrape(server)
    log_start = len(server.log())

    with RawHttp(server.port, "/v1/completions", completion_body("Hello", 3)) as client:
        events = client.rest_of_stream()  # up to [DONE]; then the connection drops
    assert finish_reasons(events)[-1] == "length"

    with RawHttp(server.port, "/v1/completions", completion_body("Hello", 3, stream=False)) as client:
        assert client.read_head() == 200
        assert client.read_json()["choices"][0]["finish_reason"] == "length"

    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True)
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
        stream.close()
        done = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert done.choices[0].finish_reason == "length"
    finally:
        sdk.close()

    m = server.wait_idle()
    assert all_aborts(m) == all_aborts(m0), "closing after the end counted an abort"
    finished = "tidal:requests_finished_total"
    assert labelled(m, finished, finished_reason="length") == labelled(m0, finished, finished_reason="length") + 4
    log = server.log()[log_start:]
    assert "Traceback" not in log and " ERROR " not in log, log
