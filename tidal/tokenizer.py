"""Chat templates and tokenisation, off the event loop.

Long prompts run in worker threads (``trio.to_thread``) behind a CapacityLimiter of
``--tokenizer-workers``, and are encoded with ``encode_batch``, which releases the GIL while
Rust works (``encode`` does not), so rendering a 100k-token prompt delays no other request's
frames. At most ``MAX_WAITING_PER_WORKER`` x workers prompts wait for a thread; more get a
503 at once. A cancelled caller abandons the thread (its result is dropped) but the limiter
slot stays taken until the thread finishes, so the bound holds. A prompt with more characters
than the context's tokens can hold is refused before tokenising.

The tokenizer is the one ``transformers.AutoTokenizer`` builds for the model directory (see
``load_auto_tokenizer``), so prompts get the ids users compare against.

Short prompts (up to ``INLINE_MAX_CHARS`` characters of everything the template renders:
content, names, earlier tool calls' arguments, template variables) are tokenised on the event
loop: that takes tens of microseconds, less than handing the work to a thread and back
(measured: the thread round trip was a quarter of a short request's frontend CPU).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from typing import Any

import trio

from tidal.errors import ApiError, bad_request, context_too_long

log = logging.getLogger("tidal.tokenizer")

INLINE_MAX_CHARS = 2048  # ~0.1 ms of work at most on the event loop
MAX_WAITING_PER_WORKER = 16  # prompts that may wait for a tokenizer thread, per thread
# NFC/NFKC compose at most 4 code points into 1 (the longest canonical decomposition, e.g. U+1F87)
NORMALIZER_MAX_MERGE = 4
TOKENIZER_QUEUE_FULL = "The tokenizer queue is full."
# A prompt longer than HEAD_CHARS_PER_TOKEN characters per token of context is tokenised by its
# head first: a head that alone holds more tokens than the context (plus a slack for the last
# word, cut where the head ends) refuses the prompt without tokenising the rest. So what a
# hostile prompt costs is bounded by the context, not by its length: a 1 MB prompt for a 4k
# context costs ~32k characters of tokenising, not 1M, and its neighbours keep the CPU.
HEAD_CHARS_PER_TOKEN = 8
HEAD_SLACK_TOKENS = 64


def rendered_size(value: Any, limit: int) -> int:
    """Characters a template could render from ``value``: each string's length, one for each entry of
    a container and for any other value; counted only until past ``limit`` (work <= ``limit`` entries)."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (dict, list, tuple)):
            total += len(item)
            if total <= limit:
                stack.extend(item.values() if isinstance(item, dict) else item)
        else:
            total += 1
    return total


# Run in a child process: build the tokenizer exactly as AutoTokenizer does and save it as it was built.
# transformers imports torch for AutoTokenizer (its config modules do) when torch is installed; hiding
# torch changes nothing about tokenizers and keeps the child fast (~1.4 s instead of ~3 s of CPU).
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
    """Encodes prompts with the model's tokenizer, never holding up the event loop.

    ``max_model_len`` (when given) refuses, before any tokenising, prompts with more characters
    than that many tokens can hold: a 1 MB prompt for a 4k-token model costs nothing then.
    """

    def __init__(self, model_dir: str, workers: int, max_model_len: int | None = None):
        self.tokenizer = load_auto_tokenizer(model_dir)
        # encode with the Rust tokenizer itself: the same ids without transformers' Python layers
        self._fast = self.tokenizer.backend_tokenizer
        self._encode_batch = getattr(self._fast, "encode_batch_fast", self._fast.encode_batch)  # older tokenizers
        self.limiter = trio.CapacityLimiter(workers)
        self.max_waiting = MAX_WAITING_PER_WORKER * workers
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.limit_length(max_model_len)

    def limit_length(self, max_model_len: int | None) -> None:
        """Refuse prompts longer than ``max_model_len`` tokens can hold (the engine says it once it is ready)."""
        self.max_model_len = max_model_len
        self.max_prompt_chars = None if max_model_len is None else max_model_len * self._max_chars_per_token()

    @classmethod
    async def load(cls, model_dir: str, workers: int, max_model_len: int | None = None) -> "PromptTokenizer":
        return await trio.to_thread.run_sync(cls, model_dir, workers, max_model_len)

    def _max_chars_per_token(self) -> int:
        """Characters of prompt text one token can stand for, at most: every token holds at most
        as many characters as its vocabulary string (byte-level strings have one character per
        byte), and a normalizer may first merge characters (NFC composes at most 4 into 1)."""
        longest = max(map(len, self._fast.get_vocab(with_added_tokens=True)), default=1)
        return longest * (NORMALIZER_MAX_MERGE if self._fast.normalizer is not None else 1)

    def _check_length(self, num_chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise context_too_long(
                self.max_model_len, f"your prompt has {num_chars} characters, more than that many tokens can hold "  # type: ignore[arg-type]
                f"(at most {self.max_prompt_chars} characters). Please reduce the length of the input.", param)

    async def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None,
                          add_generation_prompt: bool = True) -> list[int]:
        """The chat prompt's ids; ``template_kwargs`` (a request's ``chat_template_kwargs``, e.g.
        ``{"enable_thinking": false}``) are extra variables for the template."""
        num_chars = sum(len(m["content"]) for m in messages)
        self._check_length(num_chars, "messages")  # the template only adds text
        options = (tools, template_kwargs or {}, add_generation_prompt)
        # inline only what renders short: every string the template may render counts (earlier tool
        # calls' arguments, names, kwargs), not only the content; tool schemas: always a worker
        if not tools and rendered_size((messages, template_kwargs), INLINE_MAX_CHARS) <= INLINE_MAX_CHARS:
            await trio.lowlevel.checkpoint()
            return self._encode_chat(messages, *options)
        return await self._in_worker(self._encode_chat, messages, *options)

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_length(len(text), "prompt")
        if len(text) <= INLINE_MAX_CHARS:
            await trio.lowlevel.checkpoint()
            return self._encode_text(text, add_special_tokens)
        return await self._in_worker(self._encode_text, text, add_special_tokens)

    async def _in_worker(self, fn, *args):
        """Run ``fn(*args)`` in a worker thread: at most ``workers`` at once, at most ``max_waiting``
        waiting for one (FIFO); past that the caller gets a 503 at once."""
        if self.limiter.statistics().tasks_waiting >= self.max_waiting:
            raise ApiError(503, TOKENIZER_QUEUE_FULL, "service_unavailable", headers={"Retry-After": "1"})
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter, abandon_on_cancel=True)

    def _encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                     template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise bad_request("This model has no chat template; use /v1/completions", "messages")
        try:
            # tools go to the template as transformers passes them (it renders them its own way)
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **(template_kwargs or {}))
        except Exception as exc:  # a template may raise on roles or orders it does not support
            raise bad_request(f"The chat template could not render these messages: {exc}", "messages") from None
        # the template writes the special tokens it wants (e.g. BOS); add none of our own
        return self._encode(text, add_special_tokens=False, param="messages")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (short work: the caller bounds the count)."""
        return self._fast.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary string (byte-level strings as stored, e.g. "Ġthe")."""
        return [self._fast.id_to_token(t) or "" for t in token_ids]

    def _encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, add_special_tokens, param="prompt")

    def _encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        # encode() holds the GIL throughout (a 1 MB prompt froze the event loop for ~1 s);
        # encode_batch_fast releases it while the Rust code runs, and skips the character
        # offsets nobody here reads: a third less CPU per prompt than encode (the same ids)
        limit = self.max_model_len
        if limit is not None and len(text) > HEAD_CHARS_PER_TOKEN * limit:
            head = self._encode_batch([text[:HEAD_CHARS_PER_TOKEN * limit]], add_special_tokens=add_special_tokens)[0]
            if len(head.ids) > limit + HEAD_SLACK_TOKENS:
                raise context_too_long(limit, f"your request has more than {len(head.ids) - HEAD_SLACK_TOKENS} "
                                              "input tokens. Please reduce the length of the input.", param)
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class TokenizerAhead:
    """The prompt tokenizer, loaded while the engine starts: both take seconds (the tokenizer runs transformers in
    a child process), so a start pays the longer of the two rather than their sum. Only for a model the frontend
    already knows as a directory (a local or GGUF-prepared one); ``get`` falls back to loading the engine's
    directory once it is ready, as before, where that differs or the early load failed (its error then comes
    after the engine's, as it always did)."""

    def __init__(self, model: str, workers: int) -> None:
        self.path = model if os.path.isdir(model) else None
        self.workers = workers
        self._tokenizer: PromptTokenizer | None = None
        self._done = trio.Event()

    async def run(self) -> None:
        try:
            if self.path is not None:
                self._tokenizer = await trio.to_thread.run_sync(PromptTokenizer, self.path, self.workers,
                                                                abandon_on_cancel=True)
        except Exception:  # noqa: BLE001 - loaded again, and reported, after the engine's start
            self._tokenizer = None
        finally:
            self._done.set()

    async def get(self, model_dir: str, max_model_len: int) -> PromptTokenizer:
        await self._done.wait()
        early = self._tokenizer
        if early is not None and os.path.realpath(model_dir) == os.path.realpath(self.path):
            early.limit_length(max_model_len)
            return early
        return await PromptTokenizer.load(model_dir, self.workers, max_model_len)
