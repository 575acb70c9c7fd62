"""The whole engine in-process (scheduler + blocks + model + sampler + stops) against
transformers: greedy tokens equal ``generate(do_sample=False)`` token for token, also when
a batch of mixed-length requests forces chunked prefill, preemption and prefix-cache hits.

Rules for determinism: float32 on CPU, greedy sampling, tiny random models whose logit gaps
are far above float32 noise (tests/hf_models.py)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from hf_models import make_hf_model
from tidal.gpu.engine import Engine
from tidal.wire import AbortRequests, AddRequest, EngineConfig, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory):
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_engine(engine: Engine, requests: dict[int, tuple[list[int], SamplingParams]],
               max_steps: int = 10_000) -> dict[int, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(AddRequest(rid, prompt, params, 0, 0.0))
    tokens: dict[int, list[int]] = {rid: [] for rid in requests}
    finished: set[int] = set()
    for _ in range(max_steps):
        if not engine.has_work():
            break
        engine.step()
        report = engine.take_report()
        if report:
            for out in report.outputs:
                tokens[out.request_id].extend(out.token_ids)
            finished.update(report.finished)
    assert finished == set(requests), "every request must finish"
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0, "all KV blocks free at the end"
    assert not engine.sequences
    return tokens


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts(seed: int, count: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def test_single_request_matches_transformers(model_dir, hf_model):
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=16))
    prompt = prompts(1, 1, 20, 20, hf_model.config.vocab_size)[0]
    got = run_engine(engine, {1: (prompt, greedy(16))})[1]
    assert got == hf_greedy(hf_model, prompt, 16)


def test_batch_with_chunked_prefill_preemption_and_prefix_hits(model_dir, hf_model):
    vocab = hf_model.config.vocab_size
    system = prompts(7, 1, 40, 40, vocab)[0]  # a shared "system prompt" of 2.5 blocks
    reqs = prompts(3, 6, 3, 70, vocab)  # mixed lengths, some longer than the token budget
    reqs += [system + p for p in prompts(4, 4, 2, 12, vocab)]
    expected = {i: hf_greedy(hf_model, p, 12) for i, p in enumerate(reqs)}
    # a budget of 24 tokens chunks every long prompt; 14 blocks of 8 tokens cannot hold all
    # ten requests at once, so the scheduler must preempt and recompute
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=14, block_size=8,
                                 max_num_batched_tokens=24, max_num_seqs=8))
    got = run_engine(engine, {i: (p, greedy(12)) for i, p in enumerate(reqs)})
    assert got == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the cache was sized to force preemption"
    assert stats.num_prefix_hit_tokens > 0, "the shared system prompt was served from the prefix cache"


@pytest.mark.parametrize("passes", ["deferred", "thread", "launched"])
def test_abort_mid_step_frees_blocks_and_drops_the_token(model_dir, passes):
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=32, block_size=8),
                    passes=passes)
    engine.add_request(AddRequest(1, list(range(10, 30)), greedy(50), 0, 0.0))
    engine.add_request(AddRequest(2, list(range(40, 50)), greedy(50), 0, 0.0))
    engine.step()
    engine.take_report()
    # an abort that arrives while the forward pass runs (as the pipe reader hands it over) is
    # applied between the pass and the booking of its outputs
    engine.abort_arrived(AbortRequests([1, 999]))  # 999: unknown id is a no-op
    engine.step()
    report = engine.take_report()
    assert 1 in report.finished
    assert all(o.request_id != 1 for o in report.outputs), "no token of an aborted request is emitted"
    assert [o.request_id for o in report.outputs] == [2]
    remaining = engine.sequences[2]
    assert engine.block_manager.num_used_blocks == len(remaining.block_table)
    # arrived while step 1's report was the last (step 1), freed in step 2's report: one step
    assert engine.stats().aborts_freed == [0, 1, 0, 0]
    engine.abort([1, 2])  # finished and live: both fine
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("passes", ["deferred", "thread", "launched"])
def test_abort_during_the_commit_never_enters_the_next_pass(model_dir, passes):
    """An abort that arrives after the step's abort window, while it commits, is applied before the
    next pass launches: that pass never carries the request, its blocks are free in this step's
    report, and the token the commit booked for it is dropped."""
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=32, block_size=8),
                    passes=passes)
    engine.add_request(AddRequest(1, list(range(10, 30)), greedy(50), 0, 0.0))
    engine.add_request(AddRequest(2, list(range(40, 50)), greedy(50), 0, 0.0))
    engine.step()
    engine.take_report()
    commit = engine.scheduler.commit

    def commit_then_abort_arrives(*args):
        appended = commit(*args)
        engine.abort_arrived(AbortRequests([1]))  # as the pipe reader thread would, mid-commit
        return appended

    engine.scheduler.commit = commit_then_abort_arrives
    engine.step()
    engine.scheduler.commit = commit
    report = engine.take_report()
    assert 1 in report.finished and [o.request_id for o in report.outputs] == [2]
    assert [seq.request_id for seq, _ in engine._in_flight.batch.entries] == [2], "the next pass carries it"
    assert engine.block_manager.num_used_blocks == len(engine.sequences[2].block_table)
    assert report.stats.aborts_freed == [0, 1, 0, 0]


@pytest.mark.parametrize("passes", ["deferred", "thread", "launched"])
def test_abort_between_steps_waits_for_the_pass_in_flight(model_dir, passes):
    """The process loop handles aborts between steps, while the next forward pass already runs
    (or, deferred, is launched but not yet run): the blocks are free when abort() returns, and
    that pass's token for the request never shows."""
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=32, block_size=8),
                    passes=passes)
    engine.add_request(AddRequest(1, list(range(10, 30)), greedy(50), 0, 0.0))
    engine.add_request(AddRequest(2, list(range(40, 50)), greedy(50), 0, 0.0))
    engine.step()
    assert {o.request_id for o in engine.take_report().outputs} == {1, 2}
    held_by_2 = len(engine.sequences[2].block_table)
    engine.abort([1])  # the second pass (both requests) is in flight now
    assert engine.block_manager.num_used_blocks == held_by_2
    engine.step()  # books the pass that was in flight
    report = engine.take_report()
    assert 1 in report.finished and [o.request_id for o in report.outputs] == [2]
    engine.abort_all()
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_work()


@pytest.mark.parametrize("passes", ["thread", "launched"])
def test_other_passes_give_the_same_tokens(model_dir, hf_model, passes):
    """The thread tidal-test uses and the launch-now passes CUDA uses compute what the CPU's
    deferred passes do: transformers' greedy tokens."""
    vocab = hf_model.config.vocab_size
    reqs = prompts(5, 4, 3, 40, vocab)
    expected = {i: hf_greedy(hf_model, p, 8) for i, p in enumerate(reqs)}
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=32, block_size=8,
                                 max_num_batched_tokens=24), passes=passes)
    assert run_engine(engine, {i: (p, greedy(8)) for i, p in enumerate(reqs)}) == expected


@pytest.mark.parametrize("passes", ["thread", "deferred", "launched"])
def test_a_min_step_time_pass_lasts_that_long_from_its_launch(passes):
    """tidal-test's pass is a fixed-length device: however the step loop waits for it (the thread
    hands its tokens over early, the step loop sleeps until the pass's end), a step never books a
    pass before min_step_time has passed since that pass was launched."""
    step_time = 0.03
    engine = Engine(EngineConfig(model="tidal-test", min_step_time=step_time, num_kv_blocks=32, block_size=8),
                    passes=passes)
    launched, booked = [], []
    launch = engine._launch

    def recorded():
        launched.append(time.monotonic())
        return launch()

    engine._launch = recorded
    engine.add_request(AddRequest(1, list(range(100, 110)), greedy(5), 0, 0.0))
    while engine.has_work():
        engine.step()  # books the pass launched[len(booked)], launches the next
        booked.append(time.monotonic())
    assert len(engine.take_report().outputs) == 5
    assert len(booked) == 5 and all(b - a >= step_time for a, b in zip(launched, booked))


def test_cpu_pass_runs_on_the_step_loop_after_the_previous_step_is_reported(model_dir):
    """On a CPU each step runs the pass launched by the step before, on the caller's thread, so a
    step's token is out (take_report) before the next pass computes anything."""
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=32, block_size=8))
    ran_on = []
    execute = engine.runner.execute

    def counted(entries):
        ran_on.append(threading.current_thread())
        return execute(entries)

    engine.runner.execute = counted
    engine.add_request(AddRequest(1, list(range(10, 30)), greedy(3), 0, 0.0))
    engine.step()  # the prefill; the first decode is launched, not run
    assert ran_on == [threading.current_thread()]
    assert [o.token_ids for o in engine.take_report().outputs] == [[engine.sequences[1].output_token_ids[0]]]
    engine.step()
    engine.step()
    assert len(ran_on) == 3 and engine.take_report().finished == [1] and not engine.has_work()


def test_stop_conditions(model_dir, hf_model):
    vocab = hf_model.config.vocab_size
    prompt = prompts(11, 1, 12, 12, vocab)[0]
    reference = hf_greedy(hf_model, prompt, 10)
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=8,
                                 max_model_len=len(prompt) + 5))
    # stop_token_ids: ends at the first occurrence, reason = that id
    stop_id = reference[3]
    engine.add_request(AddRequest(1, prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                            stop_token_ids=(stop_id,)), 0, 0.0))
    # max-model-len ends a request that asks for more than the context allows
    engine.add_request(AddRequest(2, prompt, greedy(10), 0, 0.0))
    outs: dict[int, list] = {1: [], 2: []}
    while engine.has_work():
        engine.step()
        for o in engine.take_report().outputs:
            outs[o.request_id].append(o)
    first_stop = reference.index(stop_id)
    assert [t for o in outs[1] for t in o.token_ids] == reference[: first_stop + 1]
    assert outs[1][-1].finish_reason == "stop" and outs[1][-1].stop_reason == stop_id
    assert [t for o in outs[2] for t in o.token_ids] == reference[:5]
    assert outs[2][-1].finish_reason == "length"


def test_stop_string_ends_in_the_step_that_produced_it(model_dir):
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=8))
    prompt = list(range(100, 112))
    engine.add_request(AddRequest(1, prompt, greedy(12), 0, 0.0))
    texts, ids = [], []
    while engine.has_work():
        engine.step()
        for o in engine.take_report().outputs:
            texts.append(o.text)
            ids.extend(o.token_ids)
    full = "".join(texts)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full  # the seeded model's greedy text is fixed, and has text where the stop is cut
    cut = full.index(stop)
    engine.add_request(AddRequest(2, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                            stop=(stop,)), 0, 0.0))
    outs = []
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        outs.extend(engine.take_report().outputs)
    text = "".join(o.text for o in outs)
    assert text == full[:cut]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    produced = sum(len(o.token_ids) for o in outs)
    # it stopped at the token that completed the stop string: no wasted decode step
    prefix_text = engine.tokenizer.decode(ids[:produced])
    assert stop in prefix_text and stop not in engine.tokenizer.decode(ids[: produced - 1])
    assert steps == produced


def test_seeded_sampling_is_reproducible_and_batch_independent(model_dir):
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=8))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run_engine(engine, {1: ([5, 6, 7, 8], params)})[1]
    others = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    batched = run_engine(engine, {2: ([5, 6, 7, 8], params), 3: ([9, 9, 9], others), 4: ([1, 2], others)})[2]
    assert alone == batched


def test_the_first_output_carries_the_engines_stamps_in_order_and_only_the_first(model_dir):
    # a budget of 8 tokens prefills a 20-token prompt in three chunks
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=8,
                                 max_num_batched_tokens=8))
    engine.add_request(AddRequest(1, list(range(10, 30)), greedy(4), 0, 0.0, None, received_at=2.0))
    timings = []
    while engine.has_work():
        engine.step()
        report = engine.take_report()
        timings += [out.timing for out in report.outputs] if report else []
    first, rest = timings[0], timings[1:]
    assert first is not None and all(t is None for t in rest)
    assert first.received_at == 2.0
    assert len(first.prefill_chunks) == 3
    assert first.scheduled_at == first.prefill_chunks[0]
    assert first.prefill_chunks == sorted(first.prefill_chunks) and first.sampled_at >= first.prefill_chunks[-1]


def test_a_cpu_step_below_the_one_thread_bound_runs_on_one_thread_and_gives_the_threads_back(hf_model_dir, request):
    """A CPU pass multiplying fewer than ONE_THREAD_MACS weights (rows x the weights of one row) runs on one
    thread; at the bound and above on all; after the pass the caller's thread count is back."""
    from tidal.gpu.model_runner import ONE_THREAD_MACS

    threads = max(2, torch.get_num_threads())  # the suite's workers run one thread: give it two to drop from
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    request.addfinalizer(lambda: torch.set_num_threads(before))
    engine = Engine(EngineConfig(model=hf_model_dir("llama"), dtype="float32", enable_prefix_caching=False))
    runner = engine.runner
    assert 0 < runner.row_macs < ONE_THREAD_MACS  # a tiny model: one decode row is below the bound
    seen: list[tuple[int, int]] = []  # (rows, threads) of each pass
    forward = runner.model.forward

    def recording(batch, kv_caches):
        seen.append((batch.input_ids.shape[0], torch.get_num_threads()))
        return forward(batch, kv_caches)

    runner.model.forward = recording
    rows_at_bound = 8
    runner.row_macs = ONE_THREAD_MACS // rows_at_bound  # so a prefill of 8 tokens is exactly at the bound
    run_engine(engine, {1: ([5] * (rows_at_bound - 1), greedy(2))})  # a prefill of 7 rows, then 1-row decodes
    run_engine(engine, {2: ([7] * rows_at_bound, greedy(2))})  # a prefill of 8 rows
    assert seen[0] == (rows_at_bound - 1, 1) and (1, 1) in seen and (rows_at_bound, threads) in seen
    assert all(n == (1 if rows < rows_at_bound else threads) for rows, n in seen)
    assert torch.get_num_threads() == threads
