"""Chat templates and tokenisation, off the event loop.

Long prompts run in worker threads (``trio.to_thread``) behind a CapacityLimiter of
``--tokenizer-workers``, so rendering a 100k-token prompt delays no other request's
frames. A cancelled caller abandons the thread (its result is dropped) but the limiter
slot stays taken until the thread finishes, so the bound holds.

Short prompts (up to ``INLINE_MAX_CHARS`` characters of content) are tokenised on the event
loop: that takes tens of microseconds, less than handing the work to a thread and back
(measured: the thread round trip was a quarter of a short request's frontend CPU).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from tidal.protocol import bad_request

log = logging.getLogger("tidal.tokenizer")

INLINE_MAX_CHARS = 2048  # ~0.1 ms of work at most on the event loop


class PromptTokenizer:
    def __init__(self, model_dir: str, workers: int):
        # The fast tokenizer class reads any tokenizer.json (+ tokenizer_config.json with the chat
        # template). Unlike AutoTokenizer it does not import model modules, and never torch.
        from transformers import PreTrainedTokenizerFast

        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        # encode with the Rust tokenizer itself: the same ids without transformers' Python layers
        self._fast = self.tokenizer.backend_tokenizer
        self.limiter = trio.CapacityLimiter(workers)
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))

    @classmethod
    async def load(cls, model_dir: str, workers: int) -> "PromptTokenizer":
        return await trio.to_thread.run_sync(cls, model_dir, workers)

    async def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if sum(len(m["content"]) for m in messages) <= INLINE_MAX_CHARS:
            await trio.lowlevel.checkpoint()
            return self._encode_chat(messages)
        return await trio.to_thread.run_sync(self._encode_chat, messages, limiter=self.limiter,
                                             abandon_on_cancel=True)

    async def encode_text(self, text: str) -> list[int]:
        if len(text) <= INLINE_MAX_CHARS:
            await trio.lowlevel.checkpoint()
            return self._encode_text(text)
        return await trio.to_thread.run_sync(self._encode_text, text, limiter=self.limiter,
                                             abandon_on_cancel=True)

    def _encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not self.has_chat_template:
            raise bad_request("This model has no chat template; use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template may raise on roles or orders it does not support
            raise bad_request(f"The chat template could not render these messages: {exc}", "messages") from None
        # the template writes the special tokens it wants (e.g. BOS); add none of our own
        return self._fast.encode(text, add_special_tokens=False).ids

    def _encode_text(self, text: str) -> list[int]:
        return self._fast.encode(text, add_special_tokens=True).ids
