"""Prompt tokenisation: short prompts inline on the event loop, longer ones in a limited
worker thread, the same token ids either way. The bound is INLINE_MAX_CHARS characters.
Long prompts leave the event loop running, the wait for a thread is bounded, and a prompt
longer than the context can hold is refused before tokenising."""

from __future__ import annotations

import os
import threading

import pytest
import trio
import trio.testing

import tidal
from tidal import tokenizer as tokenizer_module
from tidal.errors import ApiError
from tidal.tokenizer import INLINE_MAX_CHARS, MAX_WAITING_PER_WORKER, TOKENIZER_QUEUE_FULL, PromptTokenizer, rendered_size

ASSETS = os.path.join(os.path.dirname(tidal.__file__), "assets", "tidal-tiny")


@pytest.fixture(scope="module")
def prompt_tokenizer():
    return PromptTokenizer(ASSETS, workers=1)


@pytest.fixture
def thread_calls(monkeypatch):
    calls = []
    original = trio.to_thread.run_sync

    async def counting(fn, *args, **kwargs):
        calls.append(fn.__name__)
        return await original(fn, *args, **kwargs)

    monkeypatch.setattr(tokenizer_module.trio.to_thread, "run_sync", counting)
    return calls


async def test_text_at_the_bound_is_inline_and_one_more_character_is_threaded(prompt_tokenizer, thread_calls):
    at_bound = "a" * INLINE_MAX_CHARS
    over = at_bound + "b"
    assert await prompt_tokenizer.encode_text(at_bound) == prompt_tokenizer.tokenizer.encode(at_bound)
    assert thread_calls == []
    assert await prompt_tokenizer.encode_text(over) == prompt_tokenizer.tokenizer.encode(over)
    assert thread_calls == ["_encode_text"]


async def test_chat_bound_counts_everything_the_template_renders(prompt_tokenizer, thread_calls):
    # roles and each entry count too, not only content (earlier tool calls' arguments: test_body_cost.py)
    empty = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    room = INLINE_MAX_CHARS - rendered_size((empty, None), 10 * INLINE_MAX_CHARS)
    half = room // 2
    at_bound = [{"role": "system", "content": "s" * half}, {"role": "user", "content": "u" * (room - half)}]
    over = [{"role": "system", "content": "s" * half}, {"role": "user", "content": "u" * (room - half + 1)}]
    assert rendered_size((at_bound, None), INLINE_MAX_CHARS) == INLINE_MAX_CHARS
    inline_ids = await prompt_tokenizer.encode_chat(at_bound)
    assert thread_calls == []
    threaded_ids = await prompt_tokenizer.encode_chat(over)
    assert thread_calls == ["_encode_chat"]
    rendered = prompt_tokenizer.tokenizer.apply_chat_template(over, add_generation_prompt=True, tokenize=False)
    assert threaded_ids == prompt_tokenizer.tokenizer.encode(rendered, add_special_tokens=False)
    assert inline_ids[0] == threaded_ids[0]  # both start with the template's BOS, added once


async def test_a_long_prompt_leaves_the_event_loop_running(prompt_tokenizer):
    """Tokenising ~1 MB takes about a second; with the GIL held (``encode``) no other task ran
    meanwhile. Now a task that wakes every 10 ms keeps waking while the thread works."""
    text = ("The tide comes in and the tide goes out. " * 25000)[:1_000_000]
    ticks = 0
    done = False

    async def ticker():
        nonlocal ticks
        while not done:
            await trio.sleep(0.01)
            ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.05)
        start, ticks_before = trio.current_time(), ticks
        ids = await prompt_tokenizer.encode_text(text)
        elapsed, ticked = trio.current_time() - start, ticks - ticks_before
        done = True
    assert len(ids) > 100_000
    # with the GIL held a handful of wake-ups happen (4 of ~150 measured); now most of them do
    assert ticked >= max(10, elapsed / 0.01 / 10), (ticked, elapsed)


async def test_at_most_max_waiting_prompts_wait_for_a_thread_then_503(prompt_tokenizer, monkeypatch):
    release = threading.Event()
    original = prompt_tokenizer._encode_text

    def blocked(text, *options):
        release.wait(30)
        return original(text, *options)

    monkeypatch.setattr(prompt_tokenizer, "_encode_text", blocked)
    bound = MAX_WAITING_PER_WORKER * 1  # the fixture has one worker
    assert prompt_tokenizer.max_waiting == bound
    long_text = "x" * (INLINE_MAX_CHARS + 1)
    results = []

    async def encode():
        results.append(await prompt_tokenizer.encode_text(long_text))

    async with trio.open_nursery() as nursery:
        for _ in range(1 + bound):  # one runs, `bound` wait: the last of them is at the bound
            nursery.start_soon(encode)
        await trio.testing.wait_all_tasks_blocked()
        assert prompt_tokenizer.limiter.statistics().tasks_waiting == bound
        with pytest.raises(ApiError) as refused:
            await prompt_tokenizer.encode_text(long_text)
        assert refused.value.status == 503 and refused.value.message == TOKENIZER_QUEUE_FULL
        assert refused.value.type == "service_unavailable" and refused.value.headers == {"Retry-After": "1"}
        release.set()
    assert len(results) == 1 + bound and all(ids == results[0] for ids in results)


async def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenising(thread_calls, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "HEAD_CHARS_PER_TOKEN", 10**9)  # this test is about the character bound
    tokenizer = PromptTokenizer(ASSETS, workers=1, max_model_len=64)
    bound = tokenizer.max_prompt_chars
    longest_token = max(map(len, tokenizer._fast.get_vocab(with_added_tokens=True)))
    assert bound == 64 * longest_token  # tidal-tiny has no normalizer
    at_bound = "x" * bound
    assert await tokenizer.encode_text(at_bound) == tokenizer.tokenizer.encode(at_bound)
    assert thread_calls == ["_encode_text"]
    with pytest.raises(ApiError) as refused:
        await tokenizer.encode_text(at_bound + "x")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert f"at most {bound} characters" in refused.value.message
    half = bound // 2
    with pytest.raises(ApiError) as refused:
        await tokenizer.encode_chat([{"role": "system", "content": "s" * half},
                                     {"role": "user", "content": "u" * (bound - half + 1)}])
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert thread_calls == ["_encode_text"]  # neither refusal reached a thread


async def test_a_long_prompt_over_the_context_is_refused_by_its_head(monkeypatch):
    """Issue 23 row 15: a hostile 1 MB prompt within the character bound costs tokenising a head of
    HEAD_CHARS_PER_TOKEN characters per context token, not the megabyte (before: all of it, ~1 s
    of CPU per prompt on a 2-core host, which starved the neighbours' streams)."""
    tokenizer = PromptTokenizer(ASSETS, workers=1, max_model_len=4096)
    lengths = []
    encode_batch = tokenizer._encode_batch

    def recording(texts, **kwargs):
        lengths.append(len(texts[0]))
        return encode_batch(texts, **kwargs)

    monkeypatch.setattr(tokenizer, "_encode_batch", recording)
    hostile = ("The quick brown fox jumps over the lazy dog. " * 6000)[:tokenizer.max_prompt_chars]
    assert len(hostile) > 250_000
    with pytest.raises(ApiError) as refused:
        await tokenizer.encode_text(hostile)
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert "maximum context length is 4096 tokens" in refused.value.message
    assert lengths == [tokenizer_module.HEAD_CHARS_PER_TOKEN * 4096]  # the head only
    lengths.clear()
    fits = " " * 40_000  # ~1,300 tokens in 40k characters: the head passes it on, then all of it is encoded
    assert await tokenizer.encode_text(fits) == tokenizer.tokenizer.encode(fits)
    assert lengths == [tokenizer_module.HEAD_CHARS_PER_TOKEN * 4096, len(fits)]


def test_the_inline_template_decision_counts_every_string_it_renders():
    short = [{"role": "user", "content": "Hi"}]
    calls = [*short, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"text": "x" * INLINE_MAX_CHARS}}}]}]
    assert rendered_size((short, {}), INLINE_MAX_CHARS) <= INLINE_MAX_CHARS
    assert rendered_size((calls, {}), INLINE_MAX_CHARS) > INLINE_MAX_CHARS  # content alone: 2
    assert rendered_size((short, {"x": ["a"] * INLINE_MAX_CHARS}), INLINE_MAX_CHARS) > INLINE_MAX_CHARS

async def test_the_tokenizer_loaded_during_the_engine_start_gets_the_engines_length_bound(tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(tokenizer_module, "load_auto_tokenizer",
                        lambda d, real=tokenizer_module.load_auto_tokenizer: loads.append(d) or real(d))
    ahead = tokenizer_module.TokenizerAhead(ASSETS, workers=1)
    await ahead.run()  # the server runs it beside the engine's start
    tokenizer = await ahead.get(ASSETS, max_model_len=64)
    assert loads == [ASSETS]  # loaded once, early: not again when the engine is ready
    assert tokenizer.max_model_len == 64
    with pytest.raises(ApiError) as refused:
        await tokenizer.encode_text("x" * (tokenizer.max_prompt_chars + 1))
    assert refused.value.status == 400 and "maximum context length is 64 tokens" in refused.value.message


async def test_a_model_the_frontend_cannot_load_early_is_loaded_from_the_engines_directory(tmp_path):
    # a name the engine resolves itself (the built-in model), and a directory whose early load fails
    for early_name in ("tidal-tiny", str(tmp_path)):
        ahead = tokenizer_module.TokenizerAhead(early_name, workers=1)
        await ahead.run()
        tokenizer = await ahead.get(ASSETS, max_model_len=128)
        assert tokenizer.max_model_len == 128
        assert await tokenizer.encode_text("hello") == tokenizer.tokenizer.encode("hello")
    ahead = tokenizer_module.TokenizerAhead(str(tmp_path), workers=1)  # no tokenizer there, none elsewhere
    await ahead.run()
    with pytest.raises(Exception):
        await ahead.get(str(tmp_path), max_model_len=128)  # the same error a start without the early load gave
