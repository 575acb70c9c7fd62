"""An abort that arrives in the middle of a forward pass frees the blocks when that pass ends.

Server: ``--min-step-time 1.0``: every forward pass lasts one second, so "0.1 s into a
step" is a wide, well-defined target. The engine cannot free blocks while a forward pass
may still write them; it drains its inbox right after the pass, before postprocessing,
so the blocks must be free at the end of *that* step (about 0.9 s after the disconnect),
never a step later, and the token the interrupted pass computed is dropped. The test counts steps
(the engine's step counter), not seconds, so a loaded host cannot fail it.
"""

from __future__ import annotations

import time

from cancel_helpers import RawHttp, aborted, completion_body, scrape, steps, unique_prompt, wait_blocks_free

STEP = 1.0  # slow_step_server's --min-step-time


def test_abort_mid_forward_frees_blocks_when_that_step_ends(slow_step_server):
    server = slow_step_server
    m0 = scrape(server)
    with RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(8, seed=201), 100)) as client:
        client.next_chunk()  # step 1 (the prefill) just ended; the engine started step 2 at once
        time.sleep(0.1)  # early in the step: a loaded host has 0.9 s to close and scrape before it ends
        client.close()
        closed_at = time.monotonic()
        m_d = scrape(server)  # S_d: the last report the frontend had (step 1's)
    assert m_d["tidal:kv_cache_blocks_used"] >= 1
    m_f, _ = wait_blocks_free(server, timeout=5)
    seconds = time.monotonic() - closed_at
    print(f"mid-step abort: S_f - S_d = {steps(m_f) - steps(m_d)}, blocks free {seconds * 1000:.0f} ms after "
          f"close, 0.1 s into a {STEP} s step")
    # Counted in steps, not seconds: the blocks were still held after the disconnect (m_d), and the
    # report of the step in flight then, the next one, shows them free: not earlier (while its forward
    # pass could still write them), not a step later.
    assert steps(m_f) == steps(m_d) + 1
    assert seconds < 5  # wait_blocks_free's own bound; about 0.9 s on a quiet host
    # The token the interrupted pass computed is never reported.
    assert m_f["tidal:generation_tokens_total"] == m_d["tidal:generation_tokens_total"]
    m = server.wait_idle()
    assert aborted(m, "client_disconnect") == aborted(m0, "client_disconnect") + 1
