"""n > 1 in the engine: choices 1..n-1 wait for choice 0's prefill and take its prompt's full
blocks from the prefix cache (tidal.gpu.engine, AddRequest.fork_of)."""

from __future__ import annotations

from tidal.gpu.engine import Engine
from tidal.wire import AddRequest, EngineConfig, SamplingParams

PROMPT = list(range(10, 50))  # 40 tokens, block size 16: two full blocks and 8 more


def run(engine, requests):
    for request in requests:
        engine.add_request(request)
    tokens, cached = {}, {}
    while engine.has_work():
        engine.step()
        report = engine.take_report()
        for out in report.outputs if report else []:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            cached[out.request_id] = out.num_cached_tokens
    assert not engine.sequences and engine.block_manager.num_used_blocks == 0
    return tokens, cached


def test_forks_reuse_the_prefilled_prompt_and_draw_their_own_tokens():
    engine = Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=256))
    requests = [AddRequest(1 + i, PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i),
                           fork_of=None if i == 0 else 1) for i in range(4)]
    tokens, cached = run(engine, requests)
    assert cached == {1: 0, 2: 32, 3: 32, 4: 32}  # only the partial block (8 tokens) is recomputed
    assert len({tuple(t) for t in tokens.values()}) == 4
    # a fork draws exactly what a lone request with its seed draws
    alone, _ = run(Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=256)),
                   [AddRequest(9, PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=9))])
    assert alone[9] == tokens[3]


def test_a_waiting_fork_can_be_aborted_and_outlives_an_aborted_parent():
    engine = Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=256))
    engine.add_request(AddRequest(1, PROMPT, SamplingParams(max_tokens=4)))
    engine.add_request(AddRequest(2, PROMPT, SamplingParams(max_tokens=4), fork_of=1))
    engine.add_request(AddRequest(3, PROMPT, SamplingParams(max_tokens=4), fork_of=1))
    engine.abort([2])  # still waiting for the parent's prefill
    engine.abort([1])  # the parent goes before its first token: its other fork runs on its own
    tokens, _ = run(engine, [])
    assert list(tokens) == [3] and len(tokens[3]) == 4
