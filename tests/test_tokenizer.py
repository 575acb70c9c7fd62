"""Prompt tokenisation: short prompts inline on the event loop, longer ones in a limited
worker thread, the same token ids either way. The bound is INLINE_MAX_CHARS characters."""

from __future__ import annotations

import os

import pytest
import trio

import tidal
from tidal import tokenizer as tokenizer_module
from tidal.tokenizer import INLINE_MAX_CHARS, PromptTokenizer

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


async def test_chat_bound_counts_message_content(prompt_tokenizer, thread_calls):
    half = INLINE_MAX_CHARS // 2
    at_bound = [{"role": "system", "content": "s" * half}, {"role": "user", "content": "u" * half}]
    over = [{"role": "system", "content": "s" * half}, {"role": "user", "content": "u" * (half + 1)}]
    inline_ids = await prompt_tokenizer.encode_chat(at_bound)
    assert thread_calls == []
    threaded_ids = await prompt_tokenizer.encode_chat(over)
    assert thread_calls == ["_encode_chat"]
    rendered = prompt_tokenizer.tokenizer.apply_chat_template(over, add_generation_prompt=True, tokenize=False)
    assert threaded_ids == prompt_tokenizer.tokenizer.encode(rendered, add_special_tokens=False)
    assert inline_ids[0] == threaded_ids[0]  # both start with the template's BOS, added once
