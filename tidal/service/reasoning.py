"""Reasoning output: the model's thinking between ``<think>`` tags, split from its answer.

``--reasoning-parser`` (vLLM's flag) names the model family:

- ``qwen3``: the model opens its thinking with ``<think>`` itself, as the first thing it says;
  an answer that does not start with it has no thinking.
- ``deepseek_r1``: the template opens the thinking (R1 and its distills often never print
  ``<think>``): everything up to ``</think>`` is thinking, a leading ``<think>`` is dropped.

Either way a prompt whose last ``<think>`` is still open (a template that opens the block) starts
the answer in thinking, and one that already closed it (Qwen3's ``enable_thinking: false``
renders an empty ``<think></think>``) starts it outside, where only a leading ``<think>`` opens one.

``ReasoningSplitter`` does the split on a text stream: tags may arrive cut anywhere across
deltas, so a tail that may be the start of a tag is held until the next delta (or the end).
Only the first thinking block counts; anything after ``</think>`` is the answer.
"""

from __future__ import annotations

from typing import Literal

PARSERS = ("qwen3", "deepseek_r1")
THINK_START = "<think>"
THINK_END = "</think>"

_State = Literal["start", "reasoning", "content"]


def prompt_state(prompt_tail: str) -> Literal["open", "closed", "none"]:
    """Where the prompt's end leaves the thinking: inside an open block, right after a closed one, or neither."""
    start, end = prompt_tail.rfind(THINK_START), prompt_tail.rfind(THINK_END)
    if start > end:
        return "open"
    if end >= 0 and not prompt_tail[end + len(THINK_END):].strip():
        return "closed"
    return "none"


def thinks_first(parser: str, prompt: Literal["open", "closed", "none"]) -> bool:
    """Whether the answer starts in thinking (so a constraint waits for ``</think>``)."""
    return prompt == "open" or (parser == "deepseek_r1" and prompt == "none")


class ReasoningSplitter:
    """One answer's text -> (reasoning, content) deltas."""

    def __init__(self, parser: str, prompt: Literal["open", "closed", "none"] = "none"):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.parser = parser
        self._state: _State = "reasoning" if thinks_first(parser, prompt) else "start"
        self._drop_start = self._state == "reasoning"  # R1: a leading <think> is not thinking text
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) this text releases; a possible tag's start is held back."""
        held = self._held + text
        self._held = ""
        reasoning, content = [], []
        while held:
            if self._state == "content":
                content.append(held)
                break
            if self._state == "start" or self._drop_start:
                stripped = held.lstrip()
                if not stripped or (THINK_START.startswith(stripped) and stripped != THINK_START):
                    self._held = held  # blank so far, or part of "<think>": wait for more
                    break
                if stripped.startswith(THINK_START):
                    held = stripped[len(THINK_START):]
                    self._state, self._drop_start = "reasoning", False
                    continue
                self._drop_start = False
                if self._state == "start":
                    self._state = "content"
                    continue
            end = held.find(THINK_END)
            if end >= 0:
                reasoning.append(held[:end])
                held = held[end + len(THINK_END):]
                self._state = "content"
                continue
            keep = _partial_suffix(held, THINK_END)
            reasoning.append(held[:len(held) - keep])
            self._held = held[len(held) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held, once the answer is over: thinking if it was thinking, else content."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
