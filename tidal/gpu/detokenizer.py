"""Per-request incremental detokenization with stop strings.

Two layers:

* decoding: each new token is decoded together with a short window of the tokens before it,
  and only the text that can no longer change is released. Byte-level BPE (and byte-fallback)
  tokens can end in the middle of a UTF-8 character, which decodes to U+FFFD until the rest of
  the character arrives, so a trailing run of U+FFFD is held back.
* stop strings: released text that could still turn out to be the start of a stop string is
  held back until it cannot; when a stop string completes, the text is cut just before it.
  ``stop_strings.StopMatcher`` tracks what to hold, in time linear in the text.

The output text continues the prompt: the window starts with the prompt's last tokens, so a
decoder that drops a leading space at the start of a text (SentencePiece's Metaspace) keeps
the space of the first output token. For byte-level BPE this is exactly
``tokenizer.decode(output_ids)``.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from tidal.gpu.stop_strings import StopMatcher

REPLACEMENT = "\ufffd"
# prompt tokens used as context for the first output token (only its boundary matters)
PROMPT_CONTEXT_TOKENS = 4
# past this many undecodable tokens in a row, look for a point where the window can be cut
# (at most 4 tokens can be waiting for the rest of one UTF-8 character)
MAX_PENDING_TOKENS = 16
MAX_INCOMPLETE_TOKENS = 4


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, one token at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # window = context tokens (already accounted for) + pending tokens
        self._window = self._prompt_context(prompt_token_ids)
        self._num_context = len(self._window)
        # characters of decode(window) already released
        self._num_released = len(self._decode(self._window))
        self._stops = tuple(s for s in stop if s)
        self._matcher = StopMatcher(self._stops) if self._stops else None
        self._held = ""
        self.stop_string: str | None = None

    # ------------------------------------------------------------------ public

    def append(self, token_id: int) -> str:
        """Add one output token; return the text that became releasable (maybe empty).

        Sets ``stop_string`` when this token completes a stop string; the returned text then
        ends just before it, and the caller must not append further tokens.
        """
        if self.stop_string is not None:
            return ""
        return self._release(self._decode_next(token_id))

    def flush(self) -> str:
        """All text still held back, for a request that ends for another reason than a stop
        string (EOS, length, abort). Partial characters come out as U+FFFD, as in ``decode``."""
        if self.stop_string is not None:
            return ""
        text = self._decode(self._window)
        new = text[self._num_released:]
        self._num_released = len(text)
        released = self._release(new)
        tail, self._held = self._held, ""
        return released + tail

    # ------------------------------------------------------------------ decoding

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        # A prompt ending in an incomplete character must not be completed by output bytes
        # (the output text would then lose them), so leave such tokens out of the context.
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(REPLACEMENT):
            context.pop()
        return context

    def _decode_next(self, token_id: int) -> str:
        """Text of the window that became final with this token."""
        window = self._window
        window.append(token_id)
        text = self._decode(window)
        stable = len(text.rstrip(REPLACEMENT))
        if stable == len(text):
            new = text[self._num_released:]
            # Everything is final: the pending tokens become the context of the next ones.
            del window[: self._num_context]
            self._num_context = len(window)
            self._num_released = len(self._decode(window))
            return new
        new = text[self._num_released:stable] if stable > self._num_released else ""
        self._num_released = max(self._num_released, stable)
        if len(window) - self._num_context > MAX_PENDING_TOKENS:
            new += self._shrink_window(text)
        return new

    def _shrink_window(self, text: str) -> str:
        """Keep a long undecodable run (e.g. a model emitting stray bytes) from making every
        step decode the whole run. Cuts the window at a point later tokens cannot reach back
        across; returns the part before the cut not yet released."""
        window = self._window
        first = max(self._num_context + 1, len(window) - MAX_INCOMPLETE_TOKENS)
        for cut in range(len(window) - 1, first - 1, -1):
            head, tail = self._decode(window[:cut]), self._decode(window[cut:])
            # If decoding the halves apart gives the same text as decoding them together, the
            # first bytes after the cut do not continue a character of the head, so no later
            # byte can either. That proves nothing when the tail has no bytes at all (say, a
            # skipped special token) and the head ends in a partial character.
            informative = bool(tail) or not head.endswith(REPLACEMENT)
            if informative and head + tail == text:
                new = head[self._num_released:]
                del window[:cut]
                self._num_context = 0
                self._num_released = max(self._num_released - len(head), 0)
                return new
        return ""

    # ------------------------------------------------------------------ stop strings

    def _release(self, new: str) -> str:
        """Apply stop strings to newly decoded text; return what may be sent now.

        Per call the work is linear in ``new`` plus the held text (bounded by the longest stop
        string), so no request's stop strings can make a step slow."""
        matcher = self._matcher
        if matcher is None:
            return new
        text = self._held + new
        if matcher.feed(new):
            # The held text never contains a whole stop string, and any stop string that starts
            # in text released earlier would have been held, so only held + new needs searching.
            # Of the stop strings in it, the one that starts first wins.
            earliest: tuple[int, str] | None = None
            for stop in self._stops:
                at = text.find(stop)
                if at != -1 and (earliest is None or at < earliest[0]):
                    earliest = (at, stop)
            assert earliest is not None
            self.stop_string = earliest[1]
            self._held = ""
            return text[: earliest[0]]
        hold = matcher.held_length
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]
