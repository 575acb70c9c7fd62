"""One request's state inside the engine: its tokens, its KV blocks, its progress.

Where a sequence is (``SequenceStatus``) changes only through ``Sequence.move_to``, against
the table ``TRANSITIONS``; an illegal move raises. The scheduler is its only caller: it owns
every place a sequence waits (tidal/gpu/scheduler.py).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as _Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

from tidal.wire import EngineTiming, FinishReason, SamplingParams, adapter_root_hash

if TYPE_CHECKING:
    import torch

    from tidal.gpu.detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    NEW = "new"  # created, not yet placed by the scheduler
    COMPILING = "compiling"  # waiting for its grammar to compile (no KV, no batch slot)
    FORKED = "forked"  # a choice waiting for its parent's prefill (n > 1)
    WAITING = "waiting"  # in the queue: not yet scheduled, or preempted back to it
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


S = SequenceStatus
# status -> the statuses it may move to; FINISHED is final
TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    S.NEW: frozenset({S.COMPILING, S.FORKED, S.WAITING, S.FINISHED}),
    S.COMPILING: frozenset({S.WAITING, S.FINISHED}),
    S.FORKED: frozenset({S.WAITING, S.FINISHED}),
    S.WAITING: frozenset({S.RUNNING, S.FINISHED}),
    S.RUNNING: frozenset({S.WAITING, S.FINISHED}),  # WAITING: preempted
    S.FINISHED: frozenset(),
}
del S


class IllegalTransition(RuntimeError):
    """A sequence was moved where the table does not allow (a bug in the engine)."""


class TokenSpan(_Sequence):
    """A live, read-only view of part of a sequence's one token list: its prompt or its output.

    Costs no copy to make and sees tokens appended later (the sampler keeps one per row across
    steps); a slice of it is a list."""

    __slots__ = ("_ids", "_start", "_stop")

    def __init__(self, ids: list[int], start: int, stop: int | None = None):
        self._ids, self._start, self._stop = ids, start, stop

    def __len__(self) -> int:
        return (len(self._ids) if self._stop is None else self._stop) - self._start

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return self._ids[self._start + start:self._start + stop:step]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self._ids[self._start + index]

    def __iter__(self):
        return iter(self._ids[self._start:self._stop])

    def __add__(self, other: list[int]) -> list[int]:
        return self[:] + list(other)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, TokenSpan)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_token_ids: InitVar[list[int]]  # becomes the head of token_ids (read back as a TokenSpan)
    params: SamplingParams
    priority: int
    arrival_time: float  # admitted at, on the frontend's clock (AddRequest.arrival_time)
    detokenizer: "IncrementalDetokenizer"
    generator: "torch.Generator | None" = None
    status: SequenceStatus = SequenceStatus.NEW  # written only by move_to
    token_ids: list[int] = field(init=False)  # the one token list: prompt, then output
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (written by the scheduler alone)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first schedule; the scheduler)
    block_hashes: list[bytes] = field(default_factory=list)  # content digest of each full block
    started: bool = False  # has been scheduled at least once (left the queue)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why it ended without completing (reported instead of a token)
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    # text: output tokens fed to the detokenizer so far, and released text not yet reported
    num_detokenized: int = 0
    text: str = ""
    # the engine's stamps of its way to the first token; sent with its first output, then None
    timing: "EngineTiming | None" = None
    adapter_id: int | None = None  # the LoRA adapter it runs through; None: the base model
    # speculative decoding: the proposal riding this step's pass after the last token (set by the
    # scheduler's schedule, cleared by its commit), the speculator's per-sequence state, and the
    # request's proposed and accepted token counts
    draft_token_ids: list[int] = field(default_factory=list)
    speculation: object | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_new_outputs: int = 0  # output tokens the last commit appended (one output each)
    # len(text) after each output token decoded since the last take: one text piece per token
    _text_marks: list[int] = field(default_factory=list)

    def __post_init__(self, prompt_token_ids: list[int]) -> None:
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        params = self.params
        # every id that ends the sequence when sampled (EOS unless ignored, stop_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        limit = self.num_prompt_tokens + params.max_tokens
        self.max_num_tokens = min(limit, self.max_model_len) if self.max_model_len else limit
        # the prefix cache's chain starts here: two adapters' KV for the same tokens differ
        self.root_hash = adapter_root_hash(self.adapter_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def move_to(self, status: SequenceStatus) -> None:
        """The one writer of ``status``; raises ``IllegalTransition`` off the table."""
        if status not in TRANSITIONS[self.status]:
            raise IllegalTransition(f"sequence {self.request_id}: {self.status.value} -> {status.value}")
        self.status = status

    def sort_key(self, by_priority: bool) -> tuple:
        """Lower sorts first: served earlier, preempted later.

        Ties of the same instant go by request id: the frontend hands ids out in admission order
        (``ActiveRequest.urgency`` orders the same way), so the engine keeps no count of its own.
        """
        if by_priority:
            return (self.priority, self.arrival_time, self.request_id)
        return (self.arrival_time, self.request_id)

    def append_token(self, token_id: int) -> FinishReason | None:
        """Add one sampled token; return why the sequence ends with it, or None.

        Stop checks in order: EOS, stop_token_ids (the id is the stop reason), stop strings
        (which need this token's text now), max_tokens and max_model_len.
        """
        self.token_ids.append(token_id)
        if token_id in self.stop_ids:
            if token_id not in self.eos_token_ids or self.params.ignore_eos:
                self.stop_reason = token_id
            return "stop"
        if self.params.stop:
            self.detokenize()
            if self.detokenizer.stop_string is not None:
                self.stop_reason = self.detokenizer.stop_string
                return "stop"
        if len(self.token_ids) >= self.max_num_tokens:
            return "length"
        return None

    def detokenize(self) -> None:
        """Feed the output tokens not yet decoded to the detokenizer; collect released text.

        A token that ended the sequence by its id (EOS, stop_token_ids) has no text; a
        sequence that ended for any reason but a stop string releases all held-back text.
        """
        end = len(self.output_token_ids)
        if self.finish_reason == "stop" and self.detokenizer.stop_string is None:
            end -= 1  # the stop token
        detokenizer = self.detokenizer
        marks = self._text_marks
        for token_id in self.output_token_ids[self.num_detokenized:end]:
            self.text += detokenizer.append(token_id)
            marks.append(len(self.text))
        self.num_detokenized = max(end, self.num_detokenized)
        if self.finish_reason is not None and self.finish_reason != "abort":
            self.text += detokenizer.flush()

    def take_text(self) -> str:
        """The text released since the last call (decoding what is still undecoded)."""
        self.detokenize()
        text, self.text = self.text, ""
        self._text_marks.clear()
        return text

    def take_texts(self, count: int) -> list[str]:
        """The text released since the last take, cut into one piece per output token of the last
        ``count`` (a stop token's piece is empty; what the end releases goes with the last)."""
        self.detokenize()
        text, marks = self.text, self._text_marks
        self.text, self._text_marks = "", []
        pieces = [text[a:b] for a, b in zip([0] + marks, marks)][-count:]
        pieces += [""] * (count - len(pieces))
        pieces[-1] += text[marks[-1] if marks else 0:]
        return pieces

# read back from the one list (set after the class: the name is also the constructor's argument)
Sequence.prompt_token_ids = property(  # type: ignore[attr-defined]
    lambda self: TokenSpan(self.token_ids, 0, self.num_prompt_tokens), doc="The prompt (a view of token_ids).")
Sequence.output_token_ids = property(  # type: ignore[attr-defined]
    lambda self: TokenSpan(self.token_ids, self.num_prompt_tokens), doc="The output so far (a view of token_ids).")
