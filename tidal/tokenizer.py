"""Chat templates and tokenisation, off the event loop.

Long prompts run in worker threads (``trio.to_thread``) behind a CapacityLimiter of
``--tokenizer-workers``, so rendering a 100k-token prompt delays no other request's
frames. A cancelled caller abandons the thread (its result is dropped) but the limiter
slot stays taken until the thread finishes, so the bound holds.

The tokenizer is the one ``transformers.AutoTokenizer`` builds for the model directory (see
``load_auto_tokenizer``), so prompts get the ids users compare against.

Short prompts (up to ``INLINE_MAX_CHARS`` characters of content) are tokenised on the event
loop: that takes tens of microseconds, less than handing the work to a thread and back
(measured: the thread round trip was a quarter of a short request's frontend CPU).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from typing import Any

import trio

from tidal.protocol import bad_request

log = logging.getLogger("tidal.tokenizer")

INLINE_MAX_CHARS = 2048  # ~0.1 ms of work at most on the event loop


# Run in a child process: build the tokenizer exactly as AutoTokenizer does and save it as it was built.
# transformers imports torch for AutoTokenizer (its config modules do) when torch is installed; hiding
# torch changes nothing about tokenizers and keeps the child fast (~0.7 s instead of ~3 s of CPU).
_SAVE_AUTO_TOKENIZER = """
import sys
sys.modules["torch"] = None
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
"""


def load_auto_tokenizer(model_dir: str):
    """The tokenizer ``transformers.AutoTokenizer.from_pretrained(model_dir)`` builds, loaded here
    without importing torch (the frontend never does).

    AutoTokenizer picks a class from tokenizer_config.json and config.json, and that class may
    rebuild parts of tokenizer.json (Qwen2Tokenizer puts Qwen's split regex and NFC in front of a
    plain byte-level pre-tokenizer), so reading tokenizer.json as is gives other ids for some text.
    A child process builds it and saves it; the generic fast class reads the saved files as they
    are, so encoding with its backend gives AutoTokenizer's ids (tests/test_tokenizer_fidelity.py).
    """
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory(prefix="tidal-tokenizer-") as saved:
        child = subprocess.run([sys.executable, "-c", _SAVE_AUTO_TOKENIZER, model_dir, saved],
                               capture_output=True, text=True, timeout=600)
        if child.returncode != 0:
            raise RuntimeError(f"transformers.AutoTokenizer could not load {model_dir}:\n{child.stderr[-2000:]}")
        return PreTrainedTokenizerFast.from_pretrained(saved)


class PromptTokenizer:
    def __init__(self, model_dir: str, workers: int):
        self.tokenizer = load_auto_tokenizer(model_dir)
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
