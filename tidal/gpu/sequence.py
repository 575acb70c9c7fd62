"""One request's state inside the engine: its tokens, its KV blocks, its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal.wire import FinishReason, SamplingParams

if TYPE_CHECKING:
    import torch

    from tidal.gpu.detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet scheduled, or preempted back to the queue
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    arrival_order: int  # tie-breaker that keeps FCFS order stable
    detokenizer: "IncrementalDetokenizer"
    generator: "torch.Generator | None" = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first schedule)
    block_hashes: list[bytes] = field(default_factory=list)  # content digest of each full block
    started: bool = False  # has been scheduled at least once (left the queue)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self, by_priority: bool) -> tuple:
        """Lower sorts first: served earlier, preempted later."""
        if by_priority:
            return (self.priority, self.arrival_time, self.arrival_order)
        return (self.arrival_time, self.arrival_order)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
